"""Byte-level text from Python's own standard library: a corpus every install ships (no download,
no tokenizer: every byte is a token)."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Optional, Union

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_mp.validation import check_int, check_number

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
