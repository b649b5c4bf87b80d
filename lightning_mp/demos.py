"""Small, real workloads for trying precisions: byte-level language modelling on Python's own source, and
image classification with a BatchNorm ResNet on scikit-learn's handwritten digits
(:class:`DigitsDataModule`, :class:`ResNet`; see their docstrings and ``examples/train_resnet.py``).

The text workload has two pieces:

* :class:`StdlibTextDataModule` reads the standard library's ``.py`` files, which ship with every Python
  install, so the demo needs no download and no tokenizer: every byte is a token (vocabulary 256).
* :class:`GPT` is a nanoGPT-style causal transformer, written so that it also runs with its parameters
  stored in ``bfloat16``/``float16`` and its forward under ``torch.autocast``, which is what Lightning's
  ``"bf16-mixed"``/``"16-mixed"``/``"bf16-true"`` precision settings do to a model.

The text is deterministic for a given Python install (files sorted, then concatenated), but it is not
the same across Python versions or distributions: a different stdlib gives different bytes. Compare
losses between runs on the same interpreter.

Typical use::

    import lightning as L
    from lightning_mp.demos import GPT, StdlibTextDataModule

    L.seed_everything(0)
    dm = StdlibTextDataModule(block_size=128, batch_size=16)
    model = GPT(vocab_size=dm.vocab_size, block_size=128)
    L.Trainer(max_steps=200, precision="bf16-mixed").fit(model, dm)
"""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from lightning_mp.validation import check_bool, check_int, check_number

# Directories skipped while walking. site-packages/dist-packages are third-party installs, not the stdlib,
# and would make the text depend on what happens to be installed. encodings/ (~1.5 MB) is mostly generated
# codec tables and pydoc_data/ is one huge docstring: with a cut at the end of the sorted stream,
# encodings/cp*.py would otherwise *be* the validation set at the default size, and a table is not Python.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"})
# _sysconfigdata_*.py is written by the build and holds this machine's compiler flags and paths.
_SKIP_FILE_PREFIXES = ("_sysconfigdata_",)


class _Chunks(Dataset):
    """``(x, y)`` pairs cut from a 1-D uint8 tensor at the given start offsets.

    Each item reads ``block_size + 1`` bytes: ``x`` is the first ``block_size``, ``y`` is the same
    span shifted one byte on, so ``y[t]`` is the byte that follows ``x[:t + 1]``. The stream stays
    uint8 (1 byte per token); only the returned window is widened to int64, which is what embedding
    lookups and ``cross_entropy`` targets need.
    """

    def __init__(self, data: Tensor, starts: Tensor, block_size: int) -> None:
        self.data = data
        self.starts = starts
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        s = int(self.starts[i])
        window = self.data[s : s + self.block_size + 1].long()
        return window[:-1], window[1:]


class StdlibTextDataModule(L.LightningDataModule):
    """Byte-level text from the Python standard library's ``.py`` sources.

    Args:
        block_size: tokens (bytes) per training example.
        batch_size: examples per batch, for both training and validation.
        max_bytes: how much text to read. The default, 4 MiB, loads in well under a second.
        val_fraction: the last ``val_fraction`` of the byte stream is held out for validation. The split
            is one cut, so no training window overlaps a validation window.
        num_workers: DataLoader worker processes. Items are cheap slices of an in-memory tensor, so 0
            is usually fastest.
        root: read ``.py`` files from this directory instead of the stdlib.
        max_val_batches: validation uses at most this many batches (evenly spaced over the held-out
            text), so a validation pass stays quick whatever ``max_bytes`` is.
        seed: if given, the training DataLoader shuffles with its own ``torch.Generator`` seeded with
            this, independent of the global RNG. If ``None``, shuffling draws from the global torch RNG,
            which ``lightning.seed_everything`` seeds; either way the batch order is reproducible.

    Training examples are the non-overlapping ``block_size`` chunks of the training text in shuffled
    order, so one epoch predicts every training byte once. (Chunks rather than random offsets sampled
    with replacement: a plain shuffled dataset is what Lightning's DistributedSampler knows how to shard,
    so the same module works on several devices.)
    """

    vocab_size = 256

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        max_bytes: int = 4 * 1024 * 1024,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        root: Optional[Union[str, os.PathLike]] = None,
        max_val_batches: int = 16,
        seed: Optional[int] = None,
    ) -> None:
        super().__init__()
        check_int("block_size", block_size, 1)
        check_int("batch_size", batch_size, 1)
        check_int("max_bytes", max_bytes, 1)
        check_int("num_workers", num_workers, 0)
        check_int("max_val_batches", max_val_batches, 1)
        if seed is not None:
            check_int("seed", seed, 0)
        check_number("val_fraction", val_fraction, 0.0, low_open=True, high=1.0)
        if root is not None and not Path(root).is_dir():
            raise ValueError(f"root must be an existing directory or None (the stdlib), got {root!r}")
        self.save_hyperparameters()
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = float(val_fraction)
        self.num_workers = num_workers
        self.root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
        self.max_val_batches = max_val_batches
        self.seed = seed
        self.files: list[str] = []  # relative paths actually read, in order
        self.train_data: Optional[Tensor] = None
        self.val_data: Optional[Tensor] = None

    def _read_text(self) -> bytes:
        # Sort by the relative POSIX path so the order does not depend on the file system's listing order.
        paths = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
            paths.extend(
                Path(dirpath, f) for f in filenames if f.endswith(".py") and not f.startswith(_SKIP_FILE_PREFIXES)
            )
        paths.sort(key=lambda p: p.relative_to(self.root).as_posix())
        if not paths:
            raise FileNotFoundError(f"no .py files found under root={str(self.root)!r}")
        # Stop reading as soon as there is enough text: the walk is cheap, reading is the cost.
        parts, total, self.files = [], 0, []
        for p in paths:
            rel = p.relative_to(self.root).as_posix()
            # The separator names the next file, so the model sees where one file ends and another begins.
            part = f"\n# ==== {rel} ====\n".encode() + p.read_bytes()
            parts.append(part)
            self.files.append(rel)
            total += len(part)
            if total >= self.max_bytes:
                break
        return b"".join(parts)[: self.max_bytes]

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_data is not None:  # setup runs once per stage; the text only needs reading once
            return
        # bytearray, not bytes: torch.frombuffer wants a writable buffer. uint8 keeps 4 MiB at 4 MiB.
        data = torch.frombuffer(bytearray(self._read_text()), dtype=torch.uint8)
        n_val = int(len(data) * self.val_fraction)
        need = self.block_size + 1  # one example needs block_size inputs plus the next byte
        if n_val < need or len(data) - n_val < need:
            raise ValueError(
                f"too little text for block_size={self.block_size!r}: max_bytes={self.max_bytes!r} "
                f"(read {len(data)} bytes) with val_fraction={self.val_fraction!r} gives {len(data) - n_val} "
                f"train and {n_val} validation bytes; each split needs at least block_size + 1 = {need}"
            )
        self.train_data, self.val_data = data[: len(data) - n_val], data[len(data) - n_val :]

    def _starts(self, data: Tensor) -> Tensor:
        # Chunk i covers bytes [i*B, i*B + B] inclusive: consecutive chunks share one byte (the last
        # target of one is the first input of the next), so each byte is a target at most once (a tail
        # shorter than one chunk is left out).
        return torch.arange((len(data) - 1) // self.block_size) * self.block_size

    def train_dataset(self) -> _Chunks:
        self.setup()
        return _Chunks(self.train_data, self._starts(self.train_data), self.block_size)

    def val_dataset(self) -> _Chunks:
        self.setup()
        starts = self._starts(self.val_data)
        cap = self.max_val_batches * self.batch_size
        if len(starts) > cap:
            # Evenly spaced rather than the first `cap`: the held-out text runs through many files,
            # and the first few windows would all come from one of them.
            starts = starts[torch.linspace(0, len(starts) - 1, cap).round().long()]
        return _Chunks(self.val_data, starts, self.block_size)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
        return DataLoader(
            self.train_dataset(),
            batch_size=self.batch_size,
            shuffle=True,
            generator=generator,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_dataset(),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)  # one matmul for q, k and v
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # is_causal=True builds the mask inside the kernel: no (T, T) mask tensor of some fixed dtype
        # to mismatch the activations, and fused kernels can skip the masked half of the work.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(L.LightningModule):
    """A small nanoGPT-style causal language model.

    ``forward(idx)`` maps int64 tokens ``(B, T)`` with ``T <= block_size`` to logits ``(B, T, vocab_size)``.
    All tensors the forward creates are integer positions; everything floating comes from the parameters,
    so the model follows whatever dtype its parameters are stored in and whatever autocast decides.

    Cost: roughly ``12 * n_layer * n_embd**2`` parameters in the blocks plus ``(vocab_size + block_size) *
    n_embd`` in the embeddings (the output head shares the token embedding). The defaults give about
    3.2M parameters.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 256,
        dropout: float = 0.0,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                            ("n_head", n_head), ("n_embd", n_embd)):
            check_int(name, value, 1)
        if n_embd % n_head:
            raise ValueError(f"n_embd must be divisible by n_head={n_head!r}, got n_embd={n_embd!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.save_hyperparameters()
        self.block_size = block_size

        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        # Weight tying: the head reuses the token embedding (one fewer vocab x n_embd matrix to store,
        # update and keep in optimizer state).
        self.head.weight = self.tok_emb.weight

        # nanoGPT init: N(0, 0.02) everywhere, and the projections that write into the residual stream
        # scaled by 1/sqrt(2 * n_layer), since 2 * n_layer of them add up along the residual path.
        self.apply(self._init_weights)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

        # Validation metrics. They hold running sums across the epoch, so the epoch value is over all
        # validation tokens rather than an average of per-batch values.
        self.val_ppl = Perplexity()
        self.val_acc = MulticlassAccuracy(num_classes=vocab_size, average="micro")

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length must be <= block_size={self.block_size!r}, got {T!r}")
        # arange is int64 and indexes the embedding, so the added activations take the parameter dtype.
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @staticmethod
    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy, in nats. Under autocast ``cross_entropy`` runs in float32."""
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        loss = self.loss_fn(logits, y)
        # Every example has the same number of tokens, so weighting each batch's mean by its batch size
        # makes the epoch val_loss the mean over tokens, and val_ppl == exp(val_loss) up to rounding.
        # sync_dist averages over devices once, at the end of the epoch (the metrics sync themselves).
        self.log("val_loss", loss, prog_bar=True, batch_size=x.shape[0], sync_dist=True)
        # Perplexity rejects bfloat16 and softmaxes its input, so hand the metrics float32 logits
        # (B*T*V floats: 0.5M per default batch, small next to the activations). update() rather than
        # calling the metric: nobody reads a per-batch value, so don't pay to compute one.
        logits = logits.float()
        self.val_ppl.update(logits, y)
        self.val_acc.update(logits.view(-1, logits.size(-1)), y.view(-1))
        self.log("val_ppl", self.val_ppl, batch_size=x.shape[0])
        self.log("val_acc", self.val_acc, batch_size=x.shape[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # nanoGPT grouping: decay the matrices (linear weights, embeddings), not biases or LayerNorm
        # parameters. parameters() yields the tied embedding/head weight once.
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.hparams.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=tuple(self.hparams.betas))

    @torch.no_grad()
    def generate(
        self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None
    ) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``(B, T)``, cropping the context to block_size.

        Each new token reruns the whole context (no key/value cache): fine for a demo, quadratic in length.
        """
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.block_size :])[:, -1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)], dim=1)
        return idx


# ----------------------------------------------------------------------------------------------------
# Images: a small ResNet with BatchNorm on scikit-learn's handwritten digits.
# ----------------------------------------------------------------------------------------------------


def _shift_batch(images: Tensor, max_shift: int) -> Tensor:
    """Translate each image by its own random (dy, dx) in [-max_shift, max_shift], filling with zeros.

    One slice per distinct shift present (at most ``(2 * max_shift + 1) ** 2``), not one per image. The
    shifts draw from torch's global RNG, which ``lightning.seed_everything`` seeds (and, with
    ``workers=True``, seeds differently in every DataLoader worker)."""
    n, _, h, w = images.shape
    padded = F.pad(images, (max_shift,) * 4)
    offsets = torch.randint(0, 2 * max_shift + 1, (n, 2))
    out = torch.empty_like(images)
    keys = offsets[:, 0] * (2 * max_shift + 1) + offsets[:, 1]
    for key in keys.unique().tolist():
        rows = (keys == key).nonzero().squeeze(1)
        dy, dx = divmod(key, 2 * max_shift + 1)
        out[rows] = padded[rows, :, dy : dy + h, dx : dx + w]
    return out


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's handwritten digits (1,797 real 8x8 grey images, 10 classes), upsampled for a ResNet.

    ``sklearn.datasets.load_digits`` ships inside scikit-learn's wheel, so nothing is downloaded. The images
    are scaled from 0..16 to 0..1, upsampled once with bilinear interpolation to ``image_size`` (16 by default,
    so that a ResNet's three stages have 16x16, 8x8 and 4x4 feature maps to work on; the information is still
    that of 8x8 pixels; 32 gives CIFAR's size at 4x the compute), then standardised with the training split's mean and standard deviation.

    Args:
        batch_size: images per batch, training and validation.
        image_size: side of the upsampled images (>= 8; 8 keeps the originals).
        val_fraction: share of the images held out for validation (the default 0.2 holds out 359 of 1,797).
        augment: shift each training image by up to ``max_shift`` pixels in each direction (zero fill), drawn
            anew every batch. Validation images are never shifted.
        max_shift: largest shift in pixels of the upsampled image (the default 1 is half an original pixel at
            the default size).
        split_seed: seed of the fixed random permutation that splits train from validation; the split does not
            depend on the global RNG, so every run and every precision sees the same validation images.
        seed: if given, the training DataLoader shuffles with its own ``torch.Generator`` seeded with this;
            if ``None`` it draws from the global RNG (seeded by ``lightning.seed_everything``).
        num_workers: DataLoader worker processes. The whole set is one small in-memory tensor; 0 is fastest.

    Needs scikit-learn (``pip install scikit-learn``; it is in this package's ``dev`` extra). It is imported in
    ``setup``, so ``lightning_mp.demos`` imports without it.
    """

    num_classes = 10
    in_channels = 1
    num_images = 1797

    def __init__(
        self,
        batch_size: int = 256,
        image_size: int = 16,
        val_fraction: float = 0.2,
        augment: bool = True,
        max_shift: int = 1,
        split_seed: int = 0,
        seed: Optional[int] = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        check_int("batch_size", batch_size, 1)
        check_int("image_size", image_size, 8)
        check_int("max_shift", max_shift, 0)
        check_int("split_seed", split_seed, 0)
        check_int("num_workers", num_workers, 0)
        if seed is not None:
            check_int("seed", seed, 0)
        check_bool("augment", augment)
        check_number("val_fraction", val_fraction, 0.0, low_open=True, high=1.0)
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.image_size = image_size
        self.val_fraction = float(val_fraction)
        self.augment = augment
        self.max_shift = max_shift
        self.split_seed = split_seed
        self.seed = seed
        self.num_workers = num_workers
        self.train_images: Optional[Tensor] = None  # (N, 1, image_size, image_size) float32, standardised
        self.train_labels: Optional[Tensor] = None  # (N,) int64
        self.val_images: Optional[Tensor] = None
        self.val_labels: Optional[Tensor] = None

    @staticmethod
    def _load_digits() -> tuple[Tensor, Tensor]:
        try:
            from sklearn.datasets import load_digits
        except ImportError as err:
            raise ImportError(
                "DigitsDataModule needs scikit-learn for its data set (sklearn.datasets.load_digits, which ships "
                "inside the wheel, no download). HINT: pip install scikit-learn, or install this package with "
                "its dev extra."
            ) from err
        digits = load_digits()
        images = torch.from_numpy(digits.images).float().div_(16.0).unsqueeze(1)  # 0..16 -> 0..1
        return images, torch.from_numpy(digits.target).long()

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_images is not None:  # setup runs once per stage; the data only needs preparing once
            return
        images, labels = self._load_digits()
        if self.image_size != images.shape[-1]:
            images = F.interpolate(images, size=self.image_size, mode="bilinear", align_corners=False)
        perm = torch.randperm(len(images), generator=torch.Generator().manual_seed(self.split_seed))
        n_val = round(len(images) * self.val_fraction)
        val_idx, train_idx = perm[:n_val].sort().values, perm[n_val:].sort().values
        if n_val == 0 or len(train_idx) == 0:
            raise ValueError(f"val_fraction={self.val_fraction!r} leaves an empty split of {len(images)} images")
        # Statistics of the training images only, so nothing about the validation images leaks into training.
        mean, std = images[train_idx].mean(), images[train_idx].std()
        images = (images - mean) / std
        self.background = float(-mean / std)  # the value of a blank pixel after standardising
        self.train_images, self.train_labels = images[train_idx], labels[train_idx]
        self.val_images, self.val_labels = images[val_idx], labels[val_idx]

    def _collate_train(self, items: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        images = torch.stack([x for x, _ in items])
        labels = torch.stack([y for _, y in items])
        if self.augment and self.max_shift:
            # shift in pixel space (blank = 0) so that the zero fill is the background, not mid-grey
            images = _shift_batch(images - self.background, self.max_shift) + self.background
        return images, labels

    def train_dataloader(self) -> DataLoader:
        self.setup()
        generator = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
        return DataLoader(
            TensorDataset(self.train_images, self.train_labels),
            batch_size=self.batch_size,
            shuffle=True,
            generator=generator,
            collate_fn=self._collate_train,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(
            TensorDataset(self.val_images, self.val_labels),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )


class BasicBlock(nn.Module):
    """ResNet's basic block: conv3x3-BN-ReLU-conv3x3-BN plus the shortcut, then ReLU (He et al., 2016).

    The shortcut is the identity, or a strided 1x1 convolution with BN where the shape changes. ReLUs are in
    place, as in torchvision: BatchNorm's backward needs its input, not its output, so the output can be
    overwritten and one activation per ReLU is not kept."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x), inplace=True)


class ResNet(L.LightningModule):
    """A small CIFAR-style ResNet (He et al., 2016, section 4.2) for 1-channel images, with BatchNorm.

    A 3x3 stem, three stages of ``blocks_per_stage`` basic blocks at ``width``, ``2 * width`` and ``4 * width``
    channels (stride 1, 2, 2), global average pooling and one linear layer. The defaults (width 16, two blocks
    per stage: 13 convolutions plus two 1x1 shortcuts, ResNet-14, 175k parameters) reach about 98.5% validation
    accuracy on the digits at 16x16 in 60 steps of 512 images (``examples/train_resnet.py``). ``forward`` maps ``(B, 1, H, W)`` images
    to ``(B, num_classes)`` logits and follows the dtype of the parameters and what autocast decides.

    Trained with SGD (Nesterov momentum 0.9, weight decay on the convolution and linear weights only) and a
    one-cycle learning-rate schedule over ``trainer.estimated_stepping_batches``.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        width: int = 16,
        blocks_per_stage: int = 2,
        lr: float = 0.1,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        for name, value in (("num_classes", num_classes), ("in_channels", in_channels), ("width", width),
                            ("blocks_per_stage", blocks_per_stage)):
            check_int(name, value, 1)
        check_number("lr", lr, 0.0, low_open=True)
        self.save_hyperparameters()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        blocks: list[nn.Module] = []
        channels = width
        for stage, out_channels in enumerate((width, 2 * width, 4 * width)):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(channels, out_channels, stride))
                channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, images: Tensor) -> Tensor:
        x = self.blocks(self.stem(images))
        # The mean over the feature map; lightning_mp's FP32 policy lists mean, so the pooled features are FP32.
        return self.head(x.mean(dim=(2, 3)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, batch_size=len(labels), sync_dist=True)
        self.val_acc.update(logits.float(), labels)
        self.log("val_acc", self.val_acc, prog_bar=True, batch_size=len(labels))

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() > 1]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() <= 1]  # BN and biases
        optimizer = torch.optim.SGD(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            momentum=0.9,
            nesterov=True,
        )
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else 1000
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=int(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
