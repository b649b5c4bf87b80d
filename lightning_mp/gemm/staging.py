"""Reusable FP32 buffers for the up-cast operands of emulated 16-bit GEMMs (:mod:`lightning_mp.gemm.emulation`)."""

from __future__ import annotations

import threading

import torch
from torch import Tensor


def _dense(x: Tensor) -> bool:
    """True when ``x``'s elements fill ``numel`` consecutive slots in some dimension order (contiguous,
    channels-last, a transpose): then a flat buffer viewed with ``x``'s strides holds exactly ``x``."""
    if x.is_contiguous():  # the common case, one C call
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.size()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _storage(x: Tensor) -> tuple[int, int]:
    """Which storage ``x`` lives in, and how many bytes it has now (0 once freed by ``resize_(0)``)."""
    storage = x.untyped_storage()
    return storage._cdata, storage.nbytes()


class _Staging:
    """The FP32 copies of emulated ops' 16-bit operands (CPU only): the last few remembered, large buffers reused.

    Remembered: a linear's backward upcasts its output gradient twice (``grad @ W`` and ``grad^T @ x``), and a
    tensor feeding several GEMMs is upcast once per GEMM. The last :attr:`MEMO` copies are kept with their 16-bit
    source; an operand over the same memory (the source itself or a dense view of it: a transpose, a reshape) at the
    same version counter, in the same storage, is served from the copy instead of upcast again. The storage check
    matters: holding the source keeps its storage alive, but FSDP2 frees a gathered parameter's memory with
    ``resize_(0)`` and the next layer's parameter may land at the same address, with its version counter preserved.
    The version counter moves with every in-place write through autograd's view of a tensor; writes that keep it
    (through ``.data``, or under torch's ``_unsafe_preserve_version_counter``) between two GEMMs of one forward or one
    backward are not seen, as with autograd's own saved tensors. On the transformers Llama 2x64 of
    ``benchmarks/zoo.py`` this skipped 2.7M of the step's element upcasts in fp16.

    Reused: glibc's ``malloc`` hands memory above its (adaptive) mmap threshold back to the kernel when it is freed,
    or trims it off the top of the heap, and the kernel zeroes every 4 KiB page of the next such allocation on first
    touch. Emulation makes two or three large FP32 copies per op where FP32 training makes none, and each one freed
    and allocated again paid those faults: on this ResNet's 512x16x16x16 activations, 1 thread, a convolution
    backward took 13.6 ms on tensors already in memory and 23.6 ms on three fresh copies of them. In a fresh process
    (as a real run is) reusing the copies took the demo ResNet's fp16 step from 201 to 139-148 ms median (FP32:
    110-124 ms; `AVX512` CPU, 2 threads). Copies of at least :attr:`MIN_BYTES` that leave the memo go to a pool,
    which keeps the :attr:`KEEP` largest.

    Cost: at most ``MEMO`` copies (and their sources) and ``KEEP`` pooled buffers, 4 bytes per element, between the
    ops of one forward or one backward; nothing between them (:meth:`clear`).
    """

    MIN_BYTES = 1 << 20
    KEEP = 4
    MEMO = 4

    def __init__(self) -> None:
        self._free: list[Tensor] = []
        # (first byte, elements, dtype) -> (16-bit source, its FP32 copy, the flat buffer under it if pooled, the
        # source's version, (its storage, the storage's bytes)); oldest first
        self._memo: dict[tuple[int, int, torch.dtype], tuple[Tensor, Tensor, Tensor | None, int, tuple[int, int]]] = {}
        self._retired: list[Tensor] = []  # pooled buffers that left the memo during the current op: pooled after it
        self._lock = threading.Lock()

    def __reduce__(self):  # a pickled plugin (ddp_spawn) or a deepcopy starts with no buffers and its own lock
        return (type(self), ())

    def take(self, x: Tensor) -> Tensor:
        """An FP32 copy of ``x`` with its sizes and strides: remembered, or a plain copy where ``x`` is not dense or is
        an inference tensor (those keep no version counter)."""
        if not x.is_cpu or x.is_inference() or not _dense(x):
            return x.to(torch.float32)
        # a dense tensor covers exactly [data_ptr, data_ptr + numel * itemsize): its first byte and length name it
        n, key, version = x.numel(), (x.data_ptr(), x.numel(), x.dtype), x._version
        with self._lock:
            hit = self._memo.pop(key, None)
            if hit is not None and hit[3] == version and _storage(x) == hit[4]:
                self._memo[key] = hit  # most recently used last
                copy = hit[1]
                return copy.as_strided(x.size(), x.stride(), copy.storage_offset())
            fits = [i for i, b in enumerate(self._free) if b.numel() >= n] if n * 4 >= self.MIN_BYTES else []
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
        if buf is None and n * 4 >= self.MIN_BYTES:
            buf = torch.empty(n, dtype=torch.float32, device=x.device)
        if buf is None:
            copy = x.to(torch.float32)  # a dense tensor keeps its strides: its bytes map onto the copy's one to one
        else:
            copy = buf.as_strided(x.size(), x.stride())  # dense and non-overlapping: exactly n elements from 0
            copy.copy_(x)
        with self._lock:
            self._memo[key] = (x, copy, buf, version, _storage(x))
            if len(self._memo) > self.MEMO:  # the oldest may be an operand of this op: reused only after it
                buf = self._memo.pop(next(iter(self._memo)))[2]
                self._retired += [buf] if buf is not None else []
        return copy

    def done(self, out) -> None:
        """After an op: a copy that an output of it lives in (a view of an operand) is the output's now; the buffers
        that left the memo during the op go to the pool, which keeps the largest (they serve every smaller operand)."""
        outs = out if isinstance(out, (tuple, list)) else (out,)
        # only an FP32 output can live in an FP32 copy (emulated ops round theirs to 16 bits, new tensors)
        used = {o.untyped_storage().data_ptr() for o in outs if isinstance(o, Tensor) and o.dtype == torch.float32}
        if not used and not self._retired:
            return
        with self._lock:
            if used:
                self._memo = {k: m for k, m in self._memo.items() if m[1].untyped_storage().data_ptr() not in used}
            retired = [b for b in self._retired if b.untyped_storage().data_ptr() not in used]
            self._free = sorted([*self._free, *retired], key=Tensor.numel)[-self.KEEP :]
            self._retired.clear()

    def clear(self) -> None:
        """Let the copies and buffers go (at the end of each forward and each backward): none stay between steps."""
        with self._lock:
            self._free.clear()
            self._memo.clear()
            self._retired.clear()
