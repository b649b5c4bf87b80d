"""Precision names, their aliases, and the facts of each number format.

One table maps every accepted spelling to a canonical name; everything else in the package asks this
module, so an alias can never mean two things. Format limits come from ``torch.finfo``, not retyped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# canonical name -> (compute dtype, Lightning's own precision string, loss scaling by default)
_FORMATS = {
    "fp32": (torch.float32, "32-true", None),
    "fp16": (torch.float16, "16-mixed", "dynamic"),
    "bf16": (torch.bfloat16, "bf16-mixed", None),
    # bf16 with the chosen Linears' GEMMs in FP8 through torchao (lightning_mp.fp8): the copies and autocast are bf16
    "fp8": (torch.bfloat16, "bf16-mixed", None),
}

# the 16-bit compute formats, as dtypes
HALF_DTYPES: tuple[torch.dtype, ...] = tuple(dict.fromkeys(d for d, _, _ in _FORMATS.values() if d != torch.float32))

# every accepted spelling -> canonical name
PRECISION_ALIASES: dict[str, str] = {
    "fp32": "fp32",
    "32": "fp32",
    "32-true": "fp32",
    "fp16": "fp16",
    "16": "fp16",
    "16-mixed": "fp16",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "fp8": "fp8",
}


# spellings users bring from Lightning or torch, answered with what to write instead
_HINTS = {
    "bf16-true": " HINT: 'bf16-true' keeps the weights themselves in bf16 (updates below a bf16 ulp are lost); "
    "write 'bf16' for bf16 compute on FP32 masters, or pass precision='bf16-true' to the Trainer without this plugin.",
    "16-true": " HINT: '16-true' keeps the weights themselves in fp16; write 'fp16' for fp16 compute on FP32 masters "
    "with dynamic loss scaling.",
    "bfloat16": " HINT: write 'bf16'.",
    "float16": " HINT: write 'fp16'.",
    "half": " HINT: write 'fp16'.",
    "float32": " HINT: write 'fp32'.",
    "64": " HINT: float64 parameters train as they are under 'bf16' or 'fp16'; for float64 compute use no plugin.",
    "transformer-engine": " HINT: FP8 through Transformer Engine is Lightning's own "
    "`TransformerEnginePrecision`; this plugin's FP8 is 'fp8' (torchao's float8 training).",
    "transformer-engine-float16": " HINT: FP8 through Transformer Engine is Lightning's own "
    "`TransformerEnginePrecision`; this plugin's FP8 is 'fp8' (torchao's float8 training).",
    "float8": " HINT: write 'fp8'.",
}


@dataclass(frozen=True)
class Format:
    """A compute format and the limits that matter for mixed precision."""

    name: str
    dtype: torch.dtype
    lightning_precision: str
    default_loss_scale: str | None

    @property
    def is_16bit(self) -> bool:
        return self.dtype != torch.float32

    @property
    def max(self) -> float:
        """Largest finite value (65504 for fp16; about 3.4e38 for bf16 and fp32)."""
        return torch.finfo(self.dtype).max

    @property
    def smallest_normal(self) -> float:
        """Smallest normal value (2^-14 for fp16, 2^-126 for bf16 and fp32)."""
        return torch.finfo(self.dtype).smallest_normal

    @property
    def smallest_subnormal(self) -> float:
        """Smallest positive value at all: 2^-24 for fp16, 2^-133 for bf16, 2^-149 for fp32."""
        return torch.finfo(self.dtype).smallest_normal * torch.finfo(self.dtype).eps

    @property
    def significand_bits(self) -> int:
        """Significand bits (the implicit one included) of the narrowest format the forward multiplies in: 24 fp32,
        11 fp16, 8 bf16, 4 fp8 (e4m3, the forward's). LossScaleMonitor's ``precision/format``."""
        dtype = torch.float8_e4m3fn if self.name == "fp8" else self.dtype
        return round(1 - math.log2(torch.finfo(dtype).eps))

    @property
    def eps(self) -> float:
        """Spacing at 1.0: 2^-10 for fp16, 2^-7 for bf16 (half an eps is the rounding bound)."""
        return torch.finfo(self.dtype).eps


def resolve_precision(precision: object) -> Format:
    """Return the :class:`Format` for any accepted spelling, or raise a ``ValueError`` listing them."""
    key = str(precision).strip().lower() if isinstance(precision, (str, int)) else None
    if key not in PRECISION_ALIASES or isinstance(precision, bool):
        allowed = ", ".join(repr(k) for k in PRECISION_ALIASES)
        hint = _HINTS.get(key or "", "")
        raise ValueError(f"precision={precision!r} is not supported. Allowed: {allowed}.{hint}")
    name = PRECISION_ALIASES[key]
    dtype, lightning_precision, default_loss_scale = _FORMATS[name]
    return Format(name, dtype, lightning_precision, default_loss_scale)


def check_device_supports(fmt: Format, device_type: str) -> None:
    """Fail at setup, not mid-run, when the device cannot compute in the requested format."""
    if not fmt.is_16bit:
        return
    if not torch.amp.is_autocast_available(device_type):
        raise RuntimeError(
            f"precision={fmt.name!r} needs autocast on the {device_type!r} device, which this torch build does not "
            "support. HINT: use precision='fp32', or run on 'cpu' or 'cuda'."
        )
    if device_type == "cuda" and fmt.dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise RuntimeError(
            f"precision='bf16' was requested but {torch.cuda.get_device_name()} has no bfloat16 support. "
            "HINT: use precision='fp16' (with dynamic loss scaling) on this GPU."
        )


def by_device_and_dtype(tensors) -> dict:
    """Positions of ``tensors`` grouped by (device, dtype): the groups one fused ``torch._foreach_*`` call takes."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def upcast(t):
    """A 16-bit floating tensor as FP32 (``.float()``: differentiable, the backward casts the gradient back), any
    other tensor as it is."""
    return t.float() if t.dtype in HALF_DTYPES else t
