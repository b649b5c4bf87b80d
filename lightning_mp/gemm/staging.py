"""Reusable FP32 buffers for the up-cast operands of emulated 16-bit GEMMs (:mod:`lightning_mp.gemm.emulation`)."""

from __future__ import annotations

import threading

import torch
from torch import Tensor


def _dense(x: Tensor) -> bool:
    """True when ``x``'s elements fill ``numel`` consecutive slots in some dimension order (contiguous,
    channels-last, a transpose): then a flat buffer viewed with ``x``'s strides holds exactly ``x``."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.size()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class _Staging:
    """FP32 buffers reused for the up-cast operands of emulated ops (CPU only).

    Why: glibc's ``malloc`` hands memory above its (adaptive) mmap threshold back to the kernel when it is freed, or
    trims it off the top of the heap, and the kernel zeroes every 4 KiB page of the next such allocation on first
    touch. Emulation makes two or three large FP32 copies per op where FP32 training makes none, and each one freed
    and allocated again paid those faults: on this ResNet's 512x16x16x16 activations, 1 thread, a convolution
    backward took 13.6 ms on tensors already in memory and 23.6 ms on three fresh copies of them. In a fresh process
    (as a real run is) reusing the copies took the demo ResNet's fp16 step from 201 to 139-148 ms median (FP32:
    110-124 ms; `AVX512` CPU, 2 threads); a process whose heap earlier runs had grown showed no difference.

    Cost: at most :attr:`KEEP` flat buffers stay allocated between the ops of one forward or one backward, the
    largest operands seen (4 bytes per element; ~10 MiB more at the ResNet's peak), and none between steps;
    operands under :attr:`MIN_BYTES` (served from malloc's heap without faults) are copied as before. The FP32
    results of the ops are new tensors (no ``out=`` for convolutions) and still pay them.
    """

    MIN_BYTES = 1 << 20
    KEEP = 4

    def __init__(self) -> None:
        self._free: list[Tensor] = []
        self._lock = threading.Lock()

    def __reduce__(self):  # a pickled plugin (ddp_spawn) or a deepcopy starts with no buffers and its own lock
        return (type(self), ())

    def take(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """An FP32 copy of ``x`` with its sizes and strides, and the pooled buffer under it (None: not pooled)."""
        n = x.numel()
        if n * 4 < self.MIN_BYTES or x.device.type != "cpu" or not _dense(x):
            return x.to(torch.float32), None
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= n]
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
        if buf is None:
            buf = torch.empty(n, dtype=torch.float32, device=x.device)
        view = buf.as_strided(x.size(), x.stride())  # dense and non-overlapping: exactly n elements from 0
        view.copy_(x)
        return view, buf

    def clear(self) -> None:
        """Let the buffers go (at the end of each forward and each backward): none are held between steps."""
        with self._lock:
            self._free.clear()

    def give(self, bufs: list[Tensor], out) -> None:
        """Return ``bufs`` for reuse, except any an output of the op lives in (then it is the output's now)."""
        outs = out if isinstance(out, (tuple, list)) else (out,)
        used = {o.untyped_storage().data_ptr() for o in outs if isinstance(o, Tensor)}
        with self._lock:
            self._free.extend(b for b in bufs if b.untyped_storage().data_ptr() not in used)
            if len(self._free) > self.KEEP:  # keep the largest: a large buffer serves every smaller operand
                self._free = sorted(self._free, key=Tensor.numel)[-self.KEEP :]
