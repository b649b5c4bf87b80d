"""A small, real workload for trying precisions: byte-level language modelling on Python's own source.

Two pieces:

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
from typing import Optional, Union

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

# Directories skipped while walking. site-packages/dist-packages are third-party installs, not the stdlib,
# and would make the text depend on what happens to be installed. encodings/ (~1.5 MB) is mostly generated
# codec tables and pydoc_data/ is one huge docstring: with a cut at the end of the sorted stream,
# encodings/cp*.py would otherwise *be* the validation set at the default size, and a table is not Python.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"})
# _sysconfigdata_*.py is written by the build and holds this machine's compiler flags and paths.
_SKIP_FILE_PREFIXES = ("_sysconfigdata_",)


def _check_int(name: str, value: object, minimum: int) -> None:
    # bool is a subclass of int; ``block_size=True`` is a mistake, not the number 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


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
        _check_int("block_size", block_size, 1)
        _check_int("batch_size", batch_size, 1)
        _check_int("max_bytes", max_bytes, 1)
        _check_int("num_workers", num_workers, 0)
        _check_int("max_val_batches", max_val_batches, 1)
        if seed is not None:
            _check_int("seed", seed, 0)
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be a number strictly between 0 and 1, got {val_fraction!r}")
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
            _check_int(name, value, 1)
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
