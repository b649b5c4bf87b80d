"""Are 16-bit GEMMs fast here? Decided once per process, per (device type, dtype) and per op family
(:mod:`lightning_mp.gemm.ops`): bf16 and fp16 differ on the same CPU, and so do a matrix product and a convolution's
weight gradient. :mod:`lightning_mp.gemm.emulation` emulates the families that are slow.

=============================  ==========================================================================
device                         verdict
=============================  ==========================================================================
``cuda``                       native (every GPU that runs the format has 16-bit GEMM units)
``cpu``                        a one-time probe per format: each family's op timed in 16 bits and in FP32;
                               a family is slow (emulated under ``gemm="auto"``) where its 16-bit op takes
                               at least 2x the FP32 time
other devices                  native (not probed)
=============================  ==========================================================================

Supported is not fast, so oneDNN's own check (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``) is quoted, not
obeyed. On an Intel Xeon with AVX512-FP16 (AMX-BF16, no AMX-FP16) it reports fp16 as supported, and the matrix
products and the convolution's forward and input gradient run at 0.9-1.6x FP32, but oneDNN has no fp16 kernel for
the weight gradient and runs its reference one (``ref:any``): 30-80x FP32 on the probe's convolution, 234x on a
64x32x16x16 one (1 thread, torch 2.13.0). avx512fp16 has no dot-product instructions (torch PR 99496's review,
torch issue 146508). The probe also covers CPUs the check misjudges the other way (ARM cores with fast fp16 NEON
kernels in torch's own BLAS). Its cost, once per process and format, in CPU time (1 thread): 6-10 ms where every
family is fast (mostly oneDNN building its kernels on first use), about 20 ms for that Xeon's fp16, 25-32 ms on a CPU
with no 16-bit arithmetic (``AVX2``); a loaded machine stretches the wall time (3-4x at load 10 on 2 cores)."""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_mp.gemm.ops import ALL_FAMILIES, FAMILIES

aten = torch.ops.aten
# a 16-bit op slower than this many FP32 ops is "slow"; emulation costs about 1.1-1.3x FP32 on the probe's shapes
# (the casts), so below 2x the native kernel is kept: it is the one the user asked for. The kernels seen so far sit
# far from the line: 0.3-1.6x where native, 16-400x where a fallback runs.
_SLOW_FACTOR = 2.0
_PROBE_REPEATS = 5
_CLEARLY_SLOW = 3 * _SLOW_FACTOR  # a family this far above the line (in CPU time) is not timed again
_CONV = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)  # stride, padding, dilation, transposed, output padding, groups


def cpu_capability() -> str:
    """torch's name for this CPU's vector unit (``AVX2``, ``AVX512``, ``DEFAULT`` on ARM...): quote it beside
    every CPU timing, because 16-bit speed depends on it."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "unknown"


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True)
class GemmSupport:
    """Whether ``device_type`` computes ``dtype`` GEMMs natively, why we think so, and the probe's measurement.

    ``native``: every op family is fast; ``slow``: the families that are not (all of them where ``native`` is False
    and none is named); ``slowdowns``: each probed family's 16-bit / FP32 time; ``slowdown``: the largest of them."""

    device_type: str
    dtype: torch.dtype
    native: bool
    reason: str
    slowdown: float | None = None
    slow: frozenset = frozenset()
    slowdowns: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.native and not self.slow:
            object.__setattr__(self, "slow", ALL_FAMILIES)


def _torch_reports_native(dtype: torch.dtype) -> bool:
    """oneDNN's own check for native 16-bit arithmetic on this CPU (False where it cannot tell)."""
    name = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    try:
        return name is not None and torch.backends.mkldnn.is_available() and bool(getattr(torch.ops.mkldnn, name)())
    except (AttributeError, RuntimeError):
        return False


def _family_calls(dtype: torch.dtype) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """Per family, the FP32 call and the ``dtype`` call of the op a Linear or a Conv2d runs, on the same values.

    Sizes: large enough that a native kernel's fixed costs do not hide its speed (fp16 on the Xeon above: 1.9x FP32
    at 128^3, 1.2x at 192^3) and a fallback's ratio shows (``AVX2``, a bf16 input gradient: 1.6x on 4x16x8x8, 4.1x
    on 8x32x8x8), small enough that a fallback costs a few ms. The weight gradient's is 8x32x4x4: oneDNN's reference
    kernel is slow at every size and costs the most (81x FP32 there, 5.7 ms; 713x on 8x32x8x8, 70 ms); ``AVX2``'s
    fallback shows 13.5x there, 2.9x on 4x16x8x8."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(192, 192, generator=gen), torch.randn(192, 192, generator=gen)
    x, w, g = (torch.randn(shape, generator=gen) for shape in ((8, 32, 8, 8), (32, 32, 3, 3), (8, 32, 8, 8)))
    fp32 = (a, b, x, w, g, x[..., :4, :4], g[..., :4, :4])

    def calls(t: tuple[torch.Tensor, ...]) -> dict[str, Callable[[], object]]:
        return {
            "matmul": lambda: torch.mm(t[0], t[1]),
            "conv forward": lambda: aten.convolution(t[2], t[3], None, *_CONV),
            "conv input grad": lambda: aten.convolution_backward(t[4], t[2], t[3], None, *_CONV, [True, False, False]),
            "conv weight grad": lambda: aten.convolution_backward(t[6], t[5], t[3], None, *_CONV, [False, True, False]),
        }

    full, half = calls(tuple(t.contiguous() for t in fp32)), calls(tuple(t.to(dtype).contiguous() for t in fp32))
    return {family: (full[family], half[family]) for family in FAMILIES}


@torch.inference_mode()
@torch.autocast("cpu", enabled=False)  # a caller's autocast would make the FP32 timings 16-bit ones
def _probe(dtype: torch.dtype) -> dict[str, float]:
    """Each op family's time in ``dtype`` over its time in FP32 on the CPU: the best of a few, interleaved so a busy
    machine slows both alike; a family clearly slow is not timed again (a fallback is what costs). Inference
    tensors skip the emulation kernels of a run in progress.

    CPU time of this thread, on one thread: it compares kernels, not thread pools or the scheduler. On an
    oversubscribed machine a multi-threaded FP32 GEMM waits for a descheduled worker at its barrier (measured:
    60-80 ms instead of 0.03 ms at load 7.8 on 2 cores) while the scalar 16-bit fallback runs on one thread
    unharmed, and the ratio would come out inverted; wall time would also count the time other processes ran."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ratios = {}
    try:
        for family, (call32, call16) in _family_calls(dtype).items():
            call32(), call16()  # first calls pay one-time kernel selection
            best32 = best16 = math.inf
            for repeat in range(_PROBE_REPEATS):
                t0 = time.thread_time()
                call32()
                t1 = time.thread_time()
                call16()
                t2 = time.thread_time()
                best32, best16 = min(best32, t1 - t0), min(best16, t2 - t1)
                if best16 > _CLEARLY_SLOW * best32:  # CPU time: no other process's time in it
                    break
            ratios[family] = best16 / max(best32, 1e-7)
    finally:
        torch.set_num_threads(threads)
    return ratios


def _verdict(device_type: str, dtype: torch.dtype, slowdowns: dict[str, float]) -> GemmSupport:
    """The support the probe's figures give: slow where a family took at least ``_SLOW_FACTOR`` x FP32."""
    name = _dtype_name(dtype)
    slow = frozenset(f for f in FAMILIES if slowdowns[f] >= _SLOW_FACTOR)
    figures = ", ".join(f"{f} {slowdowns[f]:.1f}x" for f in FAMILIES)
    onednn = "reports" if _torch_reports_native(dtype) else "reports no"
    reason = (f"{name}/FP32 time on this CPU ({cpu_capability()}): {figures}; slow from {_SLOW_FACTOR:g}x "
              f"(oneDNN {onednn} native {name})")
    return GemmSupport(device_type, dtype, not slow, reason, max(slowdowns.values()), ALL_FAMILIES if
                       slow == ALL_FAMILIES else slow, tuple((f, slowdowns[f]) for f in FAMILIES))


@functools.lru_cache(maxsize=None)
def gemm_support(device_type: str, dtype: torch.dtype) -> GemmSupport:
    """Detect once per process whether 16-bit GEMMs of ``dtype`` are fast on ``device_type``, per op family (see the
    table in the module docstring). ``gemm_support.cache_clear()`` forgets the verdicts."""
    name = _dtype_name(dtype)
    if dtype not in (torch.bfloat16, torch.float16):
        return GemmSupport(device_type, dtype, True, f"{name} is not a 16-bit format")
    if device_type == "cuda":
        return GemmSupport(device_type, dtype, True, f"CUDA GPUs compute {name} GEMMs natively")
    if device_type != "cpu":
        return GemmSupport(device_type, dtype, True, f"{device_type!r} is not probed; assumed native")
    return _verdict(device_type, dtype, _probe(dtype))


def agreed(support: GemmSupport, agree: Callable[[torch.Tensor], torch.Tensor] | None) -> GemmSupport:
    """The verdict every rank takes: ``agree`` (``agree_on_max_``, an all-reduce with MAX) gives each family the
    largest slowdown any rank measured, so a family slow on one rank is emulated on all, with the same text. Each
    rank's probe could otherwise land on either side of the line when its timing is disturbed, and the ranks would
    round the family's results differently. Cost: one all-reduce of 4 floats at setup; none where not probed
    (CUDA: the same verdict everywhere by construction) or ``agree`` is None (one process)."""
    if agree is None or not support.slowdowns:
        return support
    figures = agree(torch.tensor([r for _, r in support.slowdowns], dtype=torch.float64))
    together = dict(zip((f for f, _ in support.slowdowns), figures.tolist()))
    return support if together == dict(support.slowdowns) else _verdict(support.device_type, support.dtype, together)


_warned: set[tuple[str, torch.dtype]] = set()


def _warn_slow_once(support: GemmSupport) -> None:
    key = (support.device_type, support.dtype)
    if key in _warned:
        return
    _warned.add(key)
    name = _dtype_name(support.dtype)
    factors = dict(support.slowdowns)
    slow = ", ".join(f"{f} {factors[f]:.0f}x" if f in factors else f for f in FAMILIES if f in support.slow)
    warnings.warn(
        f"gemm='native': {name} kernels are slow on {support.device_type} ({cpu_capability()}) for {slow} the FP32 "
        f"time, so this run's ops of those kinds are that much slower than in FP32. HINT: gemm='auto' (the default) "
        f"computes them as FP32 ops on the {name} values and rounds the results to {name}: about FP32 speed, {name} "
        f"memory, results within 1 {name} ulp of the native kernel.",
        UserWarning,
        stacklevel=3,
    )
