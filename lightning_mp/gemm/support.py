"""Are 16-bit GEMMs native here? Decided once per process and (device type, dtype): bf16 and fp16 differ on the
same CPU. :mod:`lightning_mp.gemm.emulation` emulates them where they are not.

=============================  ==========================================================================
device                         verdict
=============================  ==========================================================================
``cuda``                       native (every GPU that runs the format has 16-bit GEMM units)
``cpu``, oneDNN reports it     native: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` / ``_fp16_...``
``cpu``, oneDNN does not       a one-time probe (a few ms): one 128x128x128 GEMM timed in 16 bits and in
                               FP32; not native when the 16-bit one takes more than 2x the FP32 time
other devices                  native (not probed)
=============================  ==========================================================================

The probe covers CPUs the oneDNN check misjudges (ARM cores with fast fp16 NEON kernels in torch's own BLAS).
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from dataclasses import dataclass

import torch

# a 16-bit GEMM slower than this many FP32 GEMMs is "not native"; emulation costs about 1.1-1.3x FP32 on the
# probe's shape (the casts), so below 2x the native kernel is kept: it is the one the user asked for
_SLOW_FACTOR = 2.0
_PROBE_SIZE = 128
_PROBE_REPEATS = 5


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
    """Whether ``device_type`` computes ``dtype`` GEMMs natively, why we think so, and the probe's measurement."""

    device_type: str
    dtype: torch.dtype
    native: bool
    reason: str
    slowdown: float | None = None  # 16-bit / FP32 time of the probe GEMM, where it was probed


def _torch_reports_native(dtype: torch.dtype) -> bool:
    """oneDNN's own check for native 16-bit arithmetic on this CPU (False where it cannot tell)."""
    name = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    try:
        return name is not None and torch.backends.mkldnn.is_available() and bool(getattr(torch.ops.mkldnn, name)())
    except (AttributeError, RuntimeError):
        return False


@torch.inference_mode()
def _probe_slowdown(dtype: torch.dtype) -> float:
    """Time of one 128^3 GEMM in ``dtype`` over the same GEMM in FP32 on the CPU; best of a few, interleaved so a
    busy machine slows both alike. Costs about 1 ms where 16-bit is native, a few ms where it is not.

    Timed on one thread: it compares kernels, not thread pools. On an oversubscribed machine a multi-threaded FP32
    GEMM waits for a descheduled worker at its barrier (measured: 60-80 ms instead of 0.03 ms at load 7.8 on 2
    cores) while the scalar 16-bit fallback runs on one thread unharmed, and the ratio would come out inverted."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(_PROBE_SIZE, _PROBE_SIZE, generator=gen)
    b = torch.randn(_PROBE_SIZE, _PROBE_SIZE, generator=gen)
    a16, b16 = a.to(dtype), b.to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.mm(a, b), torch.mm(a16, b16)  # first calls pay one-time kernel selection
        best32 = best16 = math.inf
        for _ in range(_PROBE_REPEATS):
            t0 = time.perf_counter()
            torch.mm(a, b)
            t1 = time.perf_counter()
            torch.mm(a16, b16)
            t2 = time.perf_counter()
            best32, best16 = min(best32, t1 - t0), min(best16, t2 - t1)
    finally:
        torch.set_num_threads(threads)
    return best16 / max(best32, 1e-9)


@functools.lru_cache(maxsize=None)
def gemm_support(device_type: str, dtype: torch.dtype) -> GemmSupport:
    """Detect once per process whether 16-bit GEMMs of ``dtype`` are native on ``device_type`` (see the table in
    the module docstring). ``gemm_support.cache_clear()`` forgets the verdicts."""
    name = _dtype_name(dtype)
    if dtype not in (torch.bfloat16, torch.float16):
        return GemmSupport(device_type, dtype, True, f"{name} is not a 16-bit format")
    if device_type == "cuda":
        return GemmSupport(device_type, dtype, True, f"CUDA GPUs compute {name} GEMMs natively")
    if device_type != "cpu":
        return GemmSupport(device_type, dtype, True, f"{device_type!r} is not probed; assumed native")
    cpu = f"this CPU ({cpu_capability()})"
    if _torch_reports_native(dtype):
        return GemmSupport(device_type, dtype, True, f"oneDNN reports native {name} arithmetic on {cpu}")
    slowdown = _probe_slowdown(dtype)
    verdict = "native" if slowdown < _SLOW_FACTOR else "not native"
    return GemmSupport(
        device_type,
        dtype,
        slowdown < _SLOW_FACTOR,
        f"one {name} GEMM took {slowdown:.1f}x the FP32 time on {cpu}: {verdict} (oneDNN reports no native {name})",
        slowdown,
    )


_warned: set[tuple[str, torch.dtype]] = set()


def _warn_slow_once(support: GemmSupport) -> None:
    key = (support.device_type, support.dtype)
    if key in _warned:
        return
    _warned.add(key)
    name = _dtype_name(support.dtype)
    factor = f"{support.slowdown:.0f}x" if support.slowdown is not None else "several times"
    warnings.warn(
        f"gemm='native': {name} GEMMs are not native on {support.device_type} ({cpu_capability()}): one {name} GEMM "
        f"takes {factor} the FP32 time here, so this run's matrix products are that much slower than in FP32. "
        f"HINT: gemm='auto' (the default) computes them as FP32 GEMMs on the {name} values and rounds the results "
        f"to {name}: about FP32 speed, {name} memory, results within 1 {name} ulp of the native kernel.",
        UserWarning,
        stacklevel=3,
    )
