"""Reusable FP32 buffers for the up-cast operands of emulated 16-bit GEMMs (:mod:`lightning_mp.gemm.emulation`)."""

from __future__ import annotations

import functools
import threading

import torch
from torch import Tensor


def _dense(x: Tensor) -> bool:
    """True when ``x``'s elements fill ``numel`` consecutive slots in some dimension order (contiguous,
    channels-last, a transpose): then a flat buffer viewed with ``x``'s strides holds exactly ``x``."""
    if x.is_contiguous():  # the common case, one C call
        return True
    stride, size = x.stride(), x.size()
    if len(stride) == 2:  # a weight's .t() in a linear's GEMM: its transpose is contiguous
        return stride[0] == 1 and stride[1] == size[0]
    expected = 1
    for stride_, size_ in sorted((st, sz) for st, sz in zip(stride, size) if sz != 1):
        if stride_ != expected:
            return False
        expected *= size_
    return True


def _storage(x: Tensor) -> tuple[int, int]:
    """Which storage ``x`` lives in, and how many bytes it has now (0 once freed by ``resize_(0)``). Asked on a hit
    only, of the operand and of the source it was copied from: a miss (most takes) pays no storage object."""
    storage = x.untyped_storage()
    return storage._cdata, storage.nbytes()


class _PerThread(threading.local):
    """A thread's remembered copies, its pooled buffers and the buffers to pool after the current op. Per thread, so
    that ``take`` needs no lock (it runs for every 16-bit operand of every emulated op): the forward, the backward and
    checkpointing's recomputation of CPU tensors run on the thread that called them."""

    def __init__(self) -> None:
        # (first byte, elements, dtype) -> (16-bit source, its FP32 copy, the flat buffer under it if pooled, the
        # source's version); oldest first
        self.memo: dict[tuple[int, int, torch.dtype], tuple[Tensor, Tensor, Tensor | None, int]] = {}
        self.free: list[Tensor] = []
        self.retired: list[Tensor] = []


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
    backward are not seen, as with autograd's own saved tensors. Only operands of at least :attr:`MEMO_MIN` elements
    are remembered: below that an upcast costs about what remembering it does (~2 us of Python a take, against 2.8 us
    to upcast 32k elements on one `AVX512` core) and few come back (the Llama 2x64 of ``benchmarks/zoo.py``, fp16:
    10 hits in 92 such takes; the demo GPT and the encoder: none in 38 and 34). Its larger operands: 5 hits in 14.

    Reused: glibc's ``malloc`` hands memory above its (adaptive) mmap threshold back to the kernel when it is freed,
    or trims it off the top of the heap, and the kernel zeroes every 4 KiB page of the next such allocation on first
    touch. Emulation makes two or three large FP32 copies per op where FP32 training makes none, and each one freed
    and allocated again paid those faults: on this ResNet's 512x16x16x16 activations, 1 thread, a convolution
    backward took 13.6 ms on tensors already in memory and 23.6 ms on three fresh copies of them. In a fresh process
    (as a real run is) reusing the copies took the demo ResNet's fp16 step from 201 to 139-148 ms median (FP32:
    110-124 ms; `AVX512` CPU, 2 threads). Copies of at least :attr:`MIN_BYTES` that leave the memo go to a pool,
    which keeps the :attr:`KEEP` largest.

    Cost: at most ``MEMO`` copies (and their sources) and ``KEEP`` pooled buffers, 4 bytes per element, between the
    ops of one forward or one backward; nothing between them (:meth:`clear`). Kept per thread (:class:`_PerThread`):
    a ``take`` runs for every 16-bit operand of every emulated op, ~110 a step on the zoo's Llama in fp16, and a lock
    there cost a sixth of its Python.
    """

    MIN_BYTES = 1 << 20
    MEMO_MIN = 1 << 17  # elements
    KEEP = 4
    MEMO = 4

    def __init__(self) -> None:
        self._state = _PerThread()

    @property
    def _memo(self) -> dict:
        return self._state.memo

    @property
    def _free(self) -> list[Tensor]:
        return self._state.free

    def __reduce__(self):  # a pickled plugin (ddp_spawn) or a deepcopy starts with no buffers
        return (type(self), ())

    def take(self, x: Tensor) -> Tensor:
        """An FP32 copy of ``x`` with its sizes and strides: remembered, or a plain copy where ``x`` is not dense or is
        an inference tensor (those keep no version counter)."""
        if x.numel() < self.MEMO_MIN or not x.is_cpu or x.is_inference() or not (x.is_contiguous() or _dense(x)):
            return x.to(torch.float32)
        # a dense tensor covers exactly [data_ptr, data_ptr + numel * itemsize): its first byte and length name it
        memo = self._state.memo
        key = (x.data_ptr(), x.numel(), x.dtype)
        hit = memo.pop(key, None)
        if hit is not None and hit[3] == x._version and _storage(x) == _storage(hit[0]):
            memo[key] = hit  # most recently used last
            copy = hit[1]
            return copy.as_strided(x.size(), x.stride(), copy.storage_offset())
        return self._copy(x, key)

    def _copy(self, x: Tensor, key: tuple[int, int, torch.dtype]) -> Tensor:
        state, n = self._state, key[1]
        buf = None
        if n * 4 >= self.MIN_BYTES:
            fits = [i for i, b in enumerate(state.free) if b.numel() >= n]
            buf = state.free.pop(min(fits, key=lambda i: state.free[i].numel())) if fits else None
            buf = torch.empty(n, dtype=torch.float32, device=x.device) if buf is None else buf
        if buf is None:
            copy = x.to(torch.float32)  # a dense tensor keeps its strides: its bytes map onto the copy's one to one
        else:
            copy = buf.as_strided(x.size(), x.stride())  # dense and non-overlapping: exactly n elements from 0
            copy.copy_(x)
        memo = state.memo
        memo[key] = (x, copy, buf, x._version)
        if len(memo) > self.MEMO:  # the oldest may be an operand of this op: reused only after it
            old = memo.pop(next(iter(memo)))[2]
            if old is not None:
                state.retired.append(old)
        return copy

    def done(self, out) -> None:
        """After an op: a copy that an output of it lives in (a view of an operand) is the output's now; the buffers
        that left the memo during the op go to the pool, which keeps the largest (they serve every smaller operand)."""
        state = self._state
        if isinstance(out, Tensor) and out.dtype != torch.float32 and not state.retired:
            return  # the common case: one 16-bit result (emulated ops round theirs to 16 bits, new tensors)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        # only an FP32 output can live in an FP32 copy
        used = {o.untyped_storage().data_ptr() for o in outs if isinstance(o, Tensor) and o.dtype == torch.float32}
        if used:
            state.memo = {k: m for k, m in state.memo.items() if m[1].untyped_storage().data_ptr() not in used}
        if state.retired:
            retired = [b for b in state.retired if b.untyped_storage().data_ptr() not in used]
            state.free = sorted([*state.free, *retired], key=Tensor.numel)[-self.KEEP :]
            state.retired.clear()

    def clear(self) -> None:
        """Let this thread's copies and buffers go (at the end of each forward and each backward): none stay between
        steps."""
        state = self._state
        state.free.clear()
        state.memo.clear()
        state.retired.clear()


@functools.lru_cache(maxsize=None)
def _traced(cls: type) -> bool:
    """Whether emulation upcasts operands of this subclass with ``.to``: ``torch.compile``'s fake and functional
    tensors and ``DTensor`` (see ``emulation._emulate``). Any other subclass reaching the kernel (torchao's float8 training
    tensors, whose reported dtype is bf16) has a ``__torch_dispatch__`` that decides how its GEMM computes: it gets
    the op as it is, and its own inner GEMMs on plain tensors come back here."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    known: tuple[type, ...] = (FakeTensor, FunctionalTensor)
    try:
        from torch.distributed.tensor import DTensor

        known += (DTensor,)
    except ImportError:  # a torch built without distributed
        pass
    return issubclass(cls, known)


def _upcast(x: Tensor) -> Tensor:
    return x.to(torch.float32)
