"""How the overflow locator reads a tensor for inf/NaN and its largest magnitude: which tensors, in which mode, at
what cost.

The locator's hooks and its look at the gradients of a skipped step (:func:`_first_non_finite`) use all of it; the
activation range monitor walks module outputs with :func:`_tensors`.
Nothing here keeps state: each function takes tensors (or numbers already read back) and returns numbers, so they
are testable on their own.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from lightning_mp.formats import by_device_and_dtype


# autocast (and the FP32 op policy's kernels at its keys) would upcast a 16-bit tensor before a check reads it: a
# copy per check (CUDA autocast runs ``sum`` in FP32)
_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutocastCUDA
)


@contextlib.contextmanager
def _bare() -> Iterator[None]:
    """No autocast (nor the FP32 policy at its keys), no torch-function mode and no Python dispatch mode (GEMM
    emulation) for the checks: they would only add a Python call per op, or upcast."""
    with torch._C.DisableTorchFunction(), torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
        if torch._C._len_torch_dispatch_stack():
            with _disable_current_modes():
                yield
        else:
            yield


def _tensors(output: Any) -> Iterator[Tensor]:
    """The tensors of a module's output: a tensor, or one level of tuple / list / dict (what modules return)."""
    if isinstance(output, Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        yield from (o for o in output if isinstance(o, Tensor))
    elif isinstance(output, dict):
        yield from (o for o in output.values() if isinstance(o, Tensor))


def _real_dense(t: Tensor) -> Tensor:
    """What to check of a gradient: a sparse one's values, a complex one as real pairs (as GradScaler does)."""
    if t.is_sparse:
        t = t._values()
    return torch.view_as_real(t) if t.is_complex() else t


def _cpu_non_finite(t: Tensor) -> str | None:
    """'nan' / 'inf' / '-inf' if the CPU tensor ``t`` holds one, else None: one read of ``t``, no temporary.

    inf and NaN propagate through a sum (inf + -inf is NaN), so a finite sum proves every element finite; a sum
    accumulates in FP32 and, for bf16 and FP32, has FP32's range, so a finite tensor's sum overflows only near
    3.4e38 and a non-finite sum is confirmed element by element with ``aminmax`` before it counts. FP16's sum would
    round to FP16 and pass 65504 where no element does, and asking for an FP32 sum makes torch copy the tensor to
    FP32 first (a new buffer, fresh pages: 13 ms per step of the demo ResNet at batch 512), so FP16 is read with
    ``aminmax`` directly (about twice a sum's time, no copy).
    """
    t = t.detach()
    if t.numel() == 0:
        return None
    if t.dtype != torch.float16 and math.isfinite(t.sum().item()):
        return None
    return _non_finite([float(v) for v in torch.aminmax(t)])


def _first_non_finite(tensors: list[Tensor]) -> tuple[int, str] | None:
    """(position, 'nan' / 'inf' / '-inf') of the first of ``tensors`` that holds an inf/NaN, else ``None``.

    One fused ``_foreach_norm(2)`` per (device, dtype) group, read back in one transfer per device (a host sync: for
    skipped steps only). 16-bit tensors take the norm in FP32 (``dtype=``), so a finite FP16 tensor's norm never
    passes 65504. A non-finite norm is confirmed with an ``aminmax`` of that tensor (a finite FP32 tensor's 2-norm
    overflows from elements near 1.8e19), which also gives the sign of an inf. On the CPU the 2-norm is the fast
    one: the inf-norm there is a per-tensor fallback 40x slower (4.4 ms for 1.7M FP32 elements, one AVX512 core).
    """
    groups = by_device_and_dtype(tensors)
    norms: list[Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for (_, dtype), idx in groups.items():
        kwargs = {"dtype": torch.float32} if dtype in (torch.float16, torch.bfloat16) else {}
        for i, norm in zip(idx, torch._foreach_norm([tensors[i].detach() for i in idx], 2, **kwargs)):
            norms[i] = norm
    for i, norm in enumerate(_to_host(norms)):
        if not math.isfinite(norm):
            value = _non_finite([float(v) for v in torch.aminmax(tensors[i].detach())])
            if value is not None:
                return i, value
    return None


def _host_amax(t: Tensor) -> float:
    lo, hi = (float(v) for v in torch.aminmax(t.detach())) if t.numel() else (0.0, 0.0)
    return _amax([lo, hi])


def _to_host(tensors: list[Tensor]) -> list[float]:
    """0-dim tensors as Python floats: one stack and one transfer per device and dtype."""
    groups = by_device_and_dtype(tensors)
    out = [0.0] * len(tensors)
    for idx in groups.values():
        for i, v in zip(idx, torch.stack([tensors[i] for i in idx]).double().cpu().tolist()):
            out[i] = v
    return out


def _amax(values: list[float]) -> float | None:
    """Largest magnitude among mins and maxes (inf when one is NaN), ``None`` for no values."""
    return max((math.inf if math.isnan(v) else abs(v)) for v in values) if values else None


def _non_finite(values: list[float]) -> str | None:
    """'nan', 'inf' or '-inf' if any of these mins/maxes is non-finite (NaN first: it says most), else None."""
    if any(math.isnan(v) for v in values):
        return "nan"
    if any(v == math.inf for v in values):
        return "inf"
    if any(v == -math.inf for v in values):
        return "-inf"
    return None
