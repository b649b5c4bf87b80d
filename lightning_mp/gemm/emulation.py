"""Emulated 16-bit GEMMs: FP32 speed for bf16/fp16 training on CPUs without 16-bit arithmetic.

A hardware 16-bit GEMM (tensor cores, AMX, AVX512-BF16) reads 16-bit operands, accumulates in FP32 and rounds
the result to 16 bits. On a CPU without such instructions torch runs 16-bit GEMMs through a scalar fallback,
5-100x slower than FP32 (measured: ``nn.Linear(256, 1024)`` on 2048 rows, fwd+bwd, on an ``AVX2`` CPU: FP32
107 ms, bf16 2047 ms). Computing the same product as an FP32 GEMM on the 16-bit values and rounding its result
to 16 bits keeps those numerics (99.99% of elements bit-identical to the bf16 kernel, the rest 1 ulp: the two
differ only in the order of the FP32 accumulation) and runs at FP32 speed.

Where the upcast happens matters. :class:`EmulatedGemmMode` is a ``TorchDispatchMode``, so it sees aten ops
*below* autograd and below autocast: autograd records the 16-bit op on the 16-bit operands and saves them (the
saved activations stay 16-bit; upcasting before the op, ``F.linear(x.float(), ...)``, would make autograd save
FP32 copies and give back the memory 16 bits exist to save), autocast has already cast the operands down and
does not cast the FP32 call back down, and the backward's GEMMs (``mm``, ``bmm``, ``convolution_backward``, the
attention backward) pass through the same mode when it is active around ``backward()``. Inputs, outputs and
gradients all keep the 16-bit dtype; only the temporaries inside one op are FP32 (2 bytes read, 4 written per
operand element: the cost, with Python dispatch of every aten op, that keeps emulation above 1.0x FP32).

Whether to emulate is decided per (device type, dtype): bf16 and fp16 differ on the same CPU.
The verdict per (device type, dtype) comes from :mod:`lightning_mp.gemm.support`.

Not covered: in-place and ``out=`` variants (``addmm_``, ``torch.mm(..., out=)``) run natively; fused kernels
called from inside other handlers are not seen; the mode is for eager execution, not ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mp.gemm.support import GemmSupport, _dtype_name, _warn_slow_once, cpu_capability, gemm_support

GEMM_CHOICES = ("auto", "native", "emulated")

aten = torch.ops.aten

# Every aten GEMM a transformer or a convnet runs on the CPU, forward and backward (checked with a logging
# dispatch mode on Linear, matmul of 1-4 dims, einsum, Conv1d/2d/ConvTranspose2d, SDPA with and without mask
# and dropout, nn.MultiheadAttention, TransformerEncoderLayer in train and eval, LSTM/GRU): linear, matmul and
# einsum decompose into mm/addmm/bmm/mv/dot before they reach the dispatcher.
EMULATED_OPS: frozenset = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten._addmm_activation.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.addbmm.default,
        aten.mv.default,
        aten.addmv.default,
        aten.dot.default,
        aten.vdot.default,
        aten.convolution.default,
        aten.convolution_backward.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        # fused inference kernels (nn.MultiheadAttention / TransformerEncoderLayer fast path in eval): their
        # inner GEMMs run inside the kernel, out of the mode's sight, so the whole kernel runs in FP32
        aten._native_multi_head_attention.default,
        aten._transformer_encoder_layer_fwd.default,
    }
)

# outputs that the native 16-bit kernel returns in FP32 already: they stay FP32 (the flash kernel's logsumexp)
_FP32_OUTPUTS = {aten._scaled_dot_product_flash_attention_for_cpu.default: (1,)}


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
    largest operands seen (4 bytes per element; ~10 MiB more at the ResNet's peak), and none between steps; operands under :attr:`MIN_BYTES` (served from malloc's heap
    without faults) are copied as before. The FP32 results of the ops are new tensors (no ``out=`` for
    convolutions) and still pay them.
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


@functools.lru_cache(maxsize=None)
def _composite(func) -> bool:
    """Whether ``func`` is defined by other aten ops (CompositeImplicitAutograd), so it can be decomposed."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


def _emulate(func, dtype: torch.dtype, args: tuple, kwargs: dict, staging: _Staging):
    """``func`` in FP32 on the ``dtype`` operands, its results rounded (nearest-even) back to ``dtype``."""
    bufs: list[Tensor] = []

    def up(x):
        if not (isinstance(x, Tensor) and x.dtype == dtype):
            return x
        x32, buf = staging.take(x)
        if buf is not None:
            bufs.append(buf)
        return x32

    out = func(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})
    if isinstance(out, Tensor):
        result = out.to(dtype)
    else:
        keep = _FP32_OUTPUTS.get(func, ())
        result = type(out)(
            o.to(dtype) if isinstance(o, Tensor) and o.dtype == torch.float32 and i not in keep else o
            for i, o in enumerate(out)
        )
    if bufs:
        staging.give(bufs, result)
    return result


class EmulatedGemmMode(TorchDispatchMode):
    """While active, the ops of :data:`EMULATED_OPS` on ``dtype`` operands compute in FP32 and round their results
    to ``dtype``; every other op runs as it is. Enter it around the forward *and* the backward.

    Every aten op under the mode makes one Python call (a set lookup and the re-call): a fixed few microseconds
    per op, whatever the tensor sizes. ``staging`` keeps the FP32 operand buffers for reuse across ops and
    steps (:class:`_Staging`); pass the same one to every mode of a run.
    """

    def __init__(self, dtype: torch.dtype, staging: _Staging | None = None) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dtype={dtype!r} is not allowed: use torch.bfloat16 or torch.float16.")
        super().__init__()
        self.dtype = dtype
        self.staging = staging if staging is not None else _Staging()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: A002 (torch's signature)
        kwargs = kwargs or {}
        if func in EMULATED_OPS and any(isinstance(a, Tensor) and a.dtype == self.dtype for a in args):
            return _emulate(func, self.dtype, args, kwargs, self.staging)
        if _composite(func):
            # Under torch.inference_mode (Lightning's validate/test/predict) composite ops such as conv2d and linear
            # reach the mode whole instead of as the convolution / addmm they are made of; run their decomposition
            # with the mode active so those come back here (without this, an fp16 validation on this ResNet ran
            # its convolutions in torch's scalar fallback: 0.56 s instead of 0.02 s)
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


class GemmEmulation:
    """The ``gemm=`` knob and its verdict for one run: ``"auto"`` emulates where 16-bit GEMMs are not native,
    ``"native"`` always uses torch's 16-bit kernels (warning once where they are slow), ``"emulated"`` always
    computes them in FP32 (e.g. to compare both paths on a machine that has both)."""

    def __init__(self, gemm: str = "auto") -> None:
        if not isinstance(gemm, str) or gemm not in GEMM_CHOICES:
            allowed = ", ".join(repr(c) for c in GEMM_CHOICES)
            raise ValueError(
                f"gemm={gemm!r} is not allowed. Allowed: {allowed} ('auto' emulates 16-bit GEMMs in FP32 only where "
                "the device has no native 16-bit arithmetic)."
            )
        self.gemm = gemm
        self.dtype: torch.dtype | None = None
        self.support: GemmSupport | None = None
        self.emulated = False
        self._staging = _Staging()  # shared by every step's mode: its buffers outlive one op

    def setup(self, device_type: str, dtype: torch.dtype) -> str:
        """Decide for this run (detection is cached per process), warn once if 16-bit is slow and emulation is
        off, and return the one line to log."""
        self.dtype = dtype
        if dtype not in (torch.bfloat16, torch.float16):
            self.support, self.emulated = None, False
            return self.describe()
        self.support = gemm_support(device_type, dtype)
        self.emulated = self.gemm == "emulated" or (self.gemm == "auto" and not self.support.native)
        if not self.support.native and not self.emulated:
            _warn_slow_once(self.support)
        return self.describe()

    def context(self) -> contextlib.AbstractContextManager:
        """The mode where emulation is in force, else a no-op (native runs pay nothing)."""
        return self._emulating() if self.emulated else contextlib.nullcontext()

    @contextlib.contextmanager
    def _emulating(self) -> Iterator[None]:
        try:
            with EmulatedGemmMode(self.dtype, self._staging):
                yield
        finally:
            self._staging.clear()  # reused within one forward or one backward, released between them

    def describe(self) -> str:
        """One line: which GEMMs are in force and why."""
        if self.dtype is None:
            return f"16-bit GEMMs: gemm={self.gemm!r}, decided at setup"
        if self.support is None:
            return f"16-bit GEMMs: not used ({_dtype_name(self.dtype)} run)"
        name, why = _dtype_name(self.dtype), self.support.reason
        if self.emulated:
            how = f"emulated (FP32 GEMMs on {name} operands, results rounded to {name})"
        else:
            how = f"native {name} kernels"
        if self.gemm != "auto" and self.emulated == self.support.native:
            return f"16-bit GEMMs: {how}, forced by gemm={self.gemm!r} ({why})"
        return f"16-bit GEMMs: {how}; gemm={self.gemm!r}: {why}"

    def __repr__(self) -> str:
        return f"GemmEmulation(gemm={self.gemm!r})"


__all__ = ["EMULATED_OPS", "GEMM_CHOICES", "EmulatedGemmMode", "GemmEmulation", "GemmSupport", "cpu_capability",
           "gemm_support"]
