"""Emulated 16-bit GEMMs: FP32 speed for bf16/fp16 training on CPUs without 16-bit arithmetic.

A hardware 16-bit GEMM (tensor cores, AMX, AVX512-BF16) reads 16-bit operands, accumulates in FP32 and rounds
the result to 16 bits. On a CPU without such instructions torch runs 16-bit GEMMs through a scalar fallback,
5-100x slower than FP32 (measured: ``nn.Linear(256, 1024)`` on 2048 rows, fwd+bwd, on an ``AVX2`` CPU: FP32
107 ms, bf16 2047 ms). Computing the same product as an FP32 GEMM on the 16-bit values and rounding its result
to 16 bits keeps those numerics (99.99% of elements bit-identical to the bf16 kernel, the rest 1 ulp: the two
differ only in the order of the FP32 accumulation) and runs at FP32 speed. Convolutions are rounded once too, where
torch's fallback for them rounds inside (each image's weight gradient added into a 16-bit sum, the overlapping
windows of the input gradient summed in 16 bits): emulated ones are the closer to the exact result
(docs/benchmarks.md, "Emulated convolutions").

Where the upcast happens matters. :class:`EmulatedGemmMode` is a ``TorchDispatchMode``, so it sees aten ops
*below* autograd and below autocast: autograd records the 16-bit op on the 16-bit operands and saves them (the
saved activations stay 16-bit; upcasting before the op, ``F.linear(x.float(), ...)``, would make autograd save
FP32 copies and give back the memory 16 bits exist to save), autocast has already cast the operands down and
does not cast the FP32 call back down, and the backward's GEMMs (``mm``, ``bmm``, ``convolution_backward``, the
attention backward) pass through the same mode when it is active around ``backward()``. Inputs, outputs and
gradients all keep the 16-bit dtype; only the temporaries inside one op are FP32 (2 bytes read, 4 written per
operand element: the cost that keeps emulation above 1.0x FP32).

A run (:class:`GemmEmulation` after ``setup``) does the same with kernels at the ``ADInplaceOrView`` dispatch key, the
one below autograd (see ``_kernel``), registered for the GEMMs only, so no other aten op reaches Python (the mode
makes a Python call for every one); it uses the mode only under ``torch.inference_mode``, whose tensors skip that
key.

Whether to emulate is decided per (device type, dtype) and op family by :mod:`lightning_mp.gemm.support` (bf16 and
fp16 differ, and so do matrix products and a convolution's forward, input and weight gradient: :mod:`.ops`).

``torch.compile`` traces the kernels: Dynamo and AOTAutograd run them on fake and functional tensors, and the graph
they build holds the upcast, the FP32 GEMM and the rounding (see ``ops._emulate``), so compiled code computes what
eager emulation computes with no Python call per GEMM. Inductor may then fuse a rounding into the next op and keep
its FP32 value (its ``emulate_precision_casts`` is off by default), as it does for native 16-bit code. The compile
caches' key names the emulated format (:mod:`lightning_mp.compile_key`): native and emulated graphs never mix.

Not covered: in-place and ``out=`` variants (``addmm_``, ``torch.mm(..., out=)``) run natively; fused kernels
called from inside other handlers are not seen; the mode (inference mode only) is for eager execution.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mp.compile_key import count_part
from lightning_mp.gemm.ops import _BELOW, ALL_FAMILIES, EMULATED_OPS, FAMILIES, compute
from lightning_mp.gemm.staging import _Staging, _traced
from lightning_mp.gemm.support import GemmSupport, _dtype_name, _warn_slow_once, agreed, cpu_capability, gemm_support

GEMM_CHOICES = ("auto", "native", "emulated")

aten = torch.ops.aten

@functools.lru_cache(maxsize=None)
def _composite(func) -> bool:
    """Whether ``func`` is defined by other aten ops (CompositeImplicitAutograd), so it can be decomposed."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


class EmulatedGemmMode(TorchDispatchMode):
    """While active, the ops of :data:`EMULATED_OPS` on ``dtype`` operands compute in FP32 and round their results
    to ``dtype`` (those of ``families`` only: :mod:`lightning_mp.gemm.ops`); every other op runs as it is. Enter it
    around the forward *and* the backward.

    Every aten op under the mode makes one Python call (a set lookup and the re-call): a fixed few microseconds
    per op, whatever the tensor sizes. ``staging`` keeps the FP32 operand buffers for reuse across ops and
    steps (:class:`_Staging`); pass the same one to every mode of a run.
    """

    def __init__(self, dtype: torch.dtype, staging: _Staging | None = None, families: frozenset = ALL_FAMILIES) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dtype={dtype!r} is not allowed: use torch.bfloat16 or torch.float16.")
        super().__init__()
        self.dtype, self.families = dtype, families
        self.staging = staging if staging is not None else _Staging()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: A002 (torch's signature)
        kwargs = kwargs or {}
        # `types` holds the operands' tensor subclasses (none for plain tensors): one that computes its own GEMM
        # (torchao's FP8 tensors, reporting dtype bf16) gets the op as is, as from the kernels (`_kernel`)
        if func in EMULATED_OPS and any(isinstance(a, Tensor) and a.dtype == self.dtype for a in args) \
                and all(_traced(t) for t in types):
            return compute(func, self.dtype, self.families, args, kwargs, self.staging)
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


# ----------------------------------------------------------------------------------------------------------------
# The same as kernels at the ADInplaceOrView key, for a run's training steps: only the GEMMs pay a Python call.
# ----------------------------------------------------------------------------------------------------------------
# ADInplaceOrView sits below autograd and autocast and above the backends, and every tensor that is not an inference
# tensor carries it, requires_grad or not: a kernel there sees the op as the mode does (autograd has recorded the
# 16-bit op and saves the 16-bit operands; autocast has cast them down), and the FP32 call goes on below it to the
# backend. Unlike the mode, the other aten ops never reach Python: on the small transformers.GPT-2 of
# benchmarks/zoo.py a step makes about 600 aten calls and 60 GEMMs. Tensors made under torch.inference_mode lack the
# key, so under inference mode (Lightning's validate, test, predict) the mode runs instead.
class _Emulating(threading.local):
    """The thread's emulation while a run's context is entered: (dtype, staging, families), else None. Per thread, as
    the mode is: the CPU backward runs on the thread that calls ``backward()``. A thread that never set it reads None."""

    state: tuple[torch.dtype, _Staging, frozenset] | None = None


_EMULATING = _Emulating()
_KERNELS: list[Any] = [0, None]  # [holds, the torch.library.Library holding the kernels]
_KERNELS_LOCK = threading.RLock()  # re-entrant: a dropped run's finalizer may release its hold inside a registration


# Ops with no derivative in torch: their autograd kernel is torch's "not implemented" fallback, which calls the op
# below ADInplaceOrView, so their kernels sit at the Autograd key instead (the fused inference paths, and the
# flash attention's backward, which runs inside the backward with no graph to record).
_NO_DERIVATIVE = frozenset({aten._addmm_activation.default, aten._native_multi_head_attention.default,
                            aten._transformer_encoder_layer_fwd.default,
                            aten._scaled_dot_product_flash_attention_for_cpu_backward.default})


def _kernel(op: Any) -> Callable[..., Any]:
    no_derivative = op in _NO_DERIVATIVE  # decided once per kernel, not per call

    def kernel(*args: Any, **kwargs: Any) -> Any:
        state = _EMULATING.state
        if no_derivative and torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
            raise NotImplementedError(f"{op} has no derivative in torch, so it cannot run on tensors that require "
                                      "grad. HINT: call it under torch.no_grad().")
        if state is not None:
            dtype, emulate = state[0], False
            for a in args:  # a loop, not any(<generator>): this runs for every GEMM of the forward and the backward
                if isinstance(a, Tensor):
                    if type(a) is not Tensor and type(a) is not nn.Parameter and not _traced(type(a)):
                        emulate = False
                        break
                    emulate = emulate or a.dtype == dtype
            if emulate:  # (else: a subclass that computes its own GEMM, torchao's FP8 tensors, gets the op as is)
                return compute(op, dtype, state[2], args, kwargs, state[1], below=True)
        with _BELOW():  # on to the backend's kernel (and any dispatch mode under this key)
            return op(*args, **kwargs)

    return kernel


def _hold_kernels(delta: int) -> None:
    """One more (``+1``) or one less (``-1``) run or block holding the kernels (``0``: none); the first registers
    them, the last takes them out (a table update per op: about 0.3 ms in all)."""
    with _KERNELS_LOCK:
        _KERNELS[0] += delta
        if _KERNELS[0] == 1 and _KERNELS[1] is None:
            lib = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                # torch warns (once per process, to every user) that these replace its own kernels at those keys:
                # the replacement is the point, and _destroy() below restores torch's kernels
                warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
                for op in EMULATED_OPS:
                    overload = "" if op._overloadname == "default" else f".{op._overloadname}"
                    key = "Autograd" if op in _NO_DERIVATIVE else "ADInplaceOrView"
                    lib.impl(op._schema.name.split("::")[1] + overload, _kernel(op), key)
            _KERNELS[1] = lib
        elif _KERNELS[0] == 0 and _KERNELS[1] is not None:
            _KERNELS[1]._destroy()
            _KERNELS[1] = None


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
        self.emulated = False  # whether any op family is emulated
        self.families: frozenset = frozenset()  # the emulated op families (lightning_mp.gemm.ops)
        self._staging = _Staging()  # shared by every step's mode: its buffers outlive one op
        self._release: weakref.finalize | None = None  # this run's hold on the kernels (from setup to remove)

    def setup(self, device_type: str, dtype: torch.dtype, hold: bool = True, agree=None) -> str:
        """Decide for this run (detection is cached per process), warn once if 16-bit is slow and emulation is
        off, and return the one line to log. ``hold=False``: no kernels from setup to ``remove()`` (Fabric's, which
        has no end of fit: :meth:`hold` spans what it needs, and :meth:`context` registers them where nothing does).
        ``agree``: ``agree_on_max_`` (every rank calls setup), so that every rank decides on the same probe figures
        (:func:`lightning_mp.gemm.support.agreed`)."""
        self.dtype = dtype
        if dtype not in (torch.bfloat16, torch.float16):
            self.support, self.emulated, self.families = None, False, frozenset()
            return self.describe()
        self.support = agreed(gemm_support(device_type, dtype), agree)
        chosen = {"emulated": ALL_FAMILIES, "native": frozenset()}.get(self.gemm, self.support.slow)
        self.families = ALL_FAMILIES if chosen == ALL_FAMILIES else chosen  # the set itself: compute()'s fast path
        self.emulated = bool(self.families)
        if self.support.slow and self.gemm == "native":
            _warn_slow_once(self.support)
        if hold:
            self.hold()
        return self.describe()

    def hold(self) -> None:
        """Where emulated: the kernels registered until :meth:`remove` (idempotent)."""
        if self.emulated and self._release is None:
            _hold_kernels(+1)
            self._release = weakref.finalize(self, _hold_kernels, -1)  # also if the run is dropped without remove

    def remove(self) -> None:
        """The end of the run or of a :meth:`hold`: the kernels go with the last hold (idempotent)."""
        if self._release is not None:
            self._release()  # a finalizer runs once
            self._release = None

    def __getstate__(self) -> dict[str, Any]:  # a copy (ddp_spawn's pickle, deepcopy) holds nothing until its setup
        return {**self.__dict__, "_release": None}

    def context(self) -> contextlib.AbstractContextManager:
        """Emulation where it is in force, else a no-op (native runs pay nothing): the kernels (the run's, or
        registered for the block where the run holds none), the mode under ``torch.inference_mode``."""
        return self._emulating() if self.emulated else contextlib.nullcontext()

    @contextlib.contextmanager
    def _emulating(self) -> Iterator[None]:
        before, inference, name = _EMULATING.state, torch.is_inference_mode_enabled(), _dtype_name(self.dtype)
        block = int(self._release is None and not inference)  # 1: no hold for the run, so one for this block
        _hold_kernels(block)  # registers the kernels where nothing holds them (a table update per op, about 0.3 ms)
        if self.families != ALL_FAMILIES:  # a graph with some families native is another graph
            name += ":" + "+".join(f for f in FAMILIES if f in self.families)
        count_part("gemm_emulated", name, +1)  # compile caches keep these graphs apart (lightning_mp.compile_key)
        try:
            if inference:
                with EmulatedGemmMode(self.dtype, self._staging, self.families):
                    yield
            else:
                _EMULATING.state = (self.dtype, self._staging, self.families)
                yield
        finally:
            _EMULATING.state = before
            count_part("gemm_emulated", name, -1)
            _hold_kernels(-block)
            self._staging.clear()  # reused within one forward or one backward, released between them

    def describe(self) -> str:
        """One line: which GEMMs are in force and why."""
        if self.dtype is None:
            return f"16-bit GEMMs: gemm={self.gemm!r}, decided at setup"
        if self.support is None:
            return f"16-bit GEMMs: not used ({_dtype_name(self.dtype)} run)"
        name, why = _dtype_name(self.dtype), self.support.reason
        how = f"emulated (FP32 GEMMs on {name} operands, results rounded to {name})"
        if self.families != ALL_FAMILIES:
            native, emulated = ([f for f in FAMILIES if (f in self.families) == e] for e in (False, True))
            how = f"native {name} kernels" + (f" for {', '.join(native)}; {how} for {', '.join(emulated)}"
                                               if emulated else "")
        if self.gemm != "auto" and self.families != self.support.slow:
            return f"16-bit GEMMs: {how}, forced by gemm={self.gemm!r} ({why})"
        return f"16-bit GEMMs: {how}; gemm={self.gemm!r}: {why}"

    def __repr__(self) -> str:
        return f"GemmEmulation(gemm={self.gemm!r})"


__all__ = ["EMULATED_OPS", "GEMM_CHOICES", "EmulatedGemmMode", "GemmEmulation", "GemmSupport", "cpu_capability",
           "gemm_support"]
