"""What an FP8 cast does to one tensor, under a recipe's scaling: amax, scale, values flushed to zero, values
saturated, and the quantisation error. Pure ``@torch.no_grad()`` functions, no torchao, no hooks: the numerics of
the FP8 statistics monitor and of ``fp8_modules="auto"``.

The scaling of each recipe is torchao's (``Float8LinearConfig.from_recipe_name``, and torchao's MX training for
``mxfp8``; ``tests/test_fp8_statistics.py`` checks this table against torchao's configs). Each tensor is measured
as the operand of the GEMM it feeds first: the input and the weight in the output GEMM, the output gradient in the
input-gradient GEMM. Their scales are taken along that GEMM's reduction axis, the last dimension of all three
(``x [M, K]``, ``W [N, K]``, ``dy [M, N]``):

=====================  ==========================  ==========================  ==========================
recipe                 input                       weight                      grad_output
=====================  ==========================  ==========================  ==========================
``tensorwise``         e4m3, one scale             e4m3, one scale             e5m2, one scale
``rowwise``            e4m3, per row, 2^k scales   e4m3, per row, 2^k scales   e4m3, per row, 2^k scales
``rowwise_with_gw_hp`` as rowwise                  as rowwise                  as rowwise
``mxfp8``              e4m3, blocks of 32, 2^k     e4m3, blocks of 32, 2^k     e4m3, blocks of 32, 2^k
=====================  ==========================  ==========================  ==========================

A scale is ``max / amax`` of its row or block (torchao's ``amax_to_scale``: computed in float64, stored in float32,
``amax`` clamped at 1e-12), rounded down to a power of two where the recipe does (rowwise; MX's e8m0 scale with
RCEIL rounding is the same power of two). The FP8 value is ``(x * scale).clamp(-max, max).to(fp8) / scale``.

The statistics (``Stats``; a tensor's are computed on its device and packed, so a caller reads many in one
transfer):

* ``amax``: the largest ``|x|``.
* ``scale``: the smallest scale of the tensor (the row or block holding ``amax``; tensorwise: the one scale).
* ``flushed``: of the non-zero values, the fraction whose FP8 value is zero (``|x * scale|`` below half of the
  format's smallest subnormal, 2^-10 in e4m3, 2^-17 in e5m2).
* ``saturated``: of the non-zero values, the fraction with ``|x * scale|`` beyond the format's largest value before
  the clamp. With dynamic scaling (every recipe here: a fresh amax per call) this is 0 up to the float32 rounding
  of the scale; it is measured all the same, as torchao computes it, and would show a delayed or capped scale.
* ``sqnr_db``: the signal-to-quantisation-noise ratio ``10 log10(sum x^2 / sum (x - q(x))^2)`` in dB (``inf``
  when the cast is exact). It is the relative error in decibels (``-20 log10(||x - q|| / ||x||)``), scale-free
  and comparable across tensors and formats: a well-scaled tensor measures about 31 dB in e4m3 and 25 dB in e5m2
  (every value keeps 3 or 2 mantissa bits). It weighs values by their energy, so a tensor whose few outliers
  carry the energy scores high even when every other value flushes to zero: ``flushed`` is what sees that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

TENSORS = ("input", "weight", "grad_output")
STATS = ("amax", "scale", "flushed_fraction", "saturated_fraction", "sqnr_db")
EPS = 1e-12  # torchao's floor on amax before max / amax
MX_BLOCK = 32


@dataclass(frozen=True)
class Scaling:
    """How a recipe scales one operand: its FP8 format, per ``"tensor"``, ``"row"`` or ``"block"`` (of
    :data:`MX_BLOCK` along the last dimension), and whether scales are rounded down to powers of two."""

    dtype: torch.dtype
    granularity: str
    power_of_2: bool

    def __post_init__(self) -> None:
        if self.granularity not in ("tensor", "row", "block"):
            raise ValueError(f"granularity={self.granularity!r} is not allowed: use 'tensor', 'row' or 'block'.")


_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_ROW = Scaling(_E4M3, "row", True)
RECIPE_SCALING: dict[str, dict[str, Scaling]] = {
    "tensorwise": {"input": Scaling(_E4M3, "tensor", False), "weight": Scaling(_E4M3, "tensor", False),
                   "grad_output": Scaling(_E5M2, "tensor", False)},
    "rowwise": dict.fromkeys(TENSORS, _ROW),
    "rowwise_with_gw_hp": dict.fromkeys(TENSORS, _ROW),
    "mxfp8": dict.fromkeys(TENSORS, Scaling(_E4M3, "block", True)),
}


class Stats(NamedTuple):
    amax: float
    scale: float
    flushed_fraction: float
    saturated_fraction: float
    sqnr_db: float


@torch.no_grad()
def scales(x: Tensor, scaling: Scaling) -> Tensor:
    """The scale of every row or block of ``x`` (FP32, broadcastable against ``x`` viewed as ``[rows, blocks,
    width]``), as torchao computes it."""
    x = _blocks(x, scaling.granularity)
    amax = x.abs().amax() if scaling.granularity == "tensor" else x.abs().amax(dim=-1, keepdim=True)
    # torchao: float64 so that eager and compile agree, then float32
    scale = (torch.finfo(scaling.dtype).max / amax.double().clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if scaling.power_of_2 else scale


@torch.no_grad()
def quantize(x: Tensor, scaling: Scaling) -> Tensor:
    """``x`` through the FP8 cast and back (FP32, shaped as ``x``)."""
    blocks, scale = _blocks(x.float(), scaling.granularity), scales(x.float(), scaling)
    fmax = torch.finfo(scaling.dtype).max
    return ((blocks * scale).clamp(-fmax, fmax).to(scaling.dtype).float() / scale).reshape(x.shape)


@torch.no_grad()
def measure(x: Tensor, scaling: Scaling) -> Tensor:
    """:class:`Stats` of ``x`` as five FP32 numbers on its device (no host read: :func:`unpack` them, many at once)."""
    x = x.detach().float()
    blocks, scale = _blocks(x, scaling.granularity), scales(x, scaling)
    fmax = torch.finfo(scaling.dtype).max
    scaled = blocks * scale
    q = scaled.clamp(-fmax, fmax).to(scaling.dtype).float() / scale
    nonzero = blocks != 0
    count = nonzero.sum().clamp(min=1).float()
    flushed = (nonzero & (q == 0)).sum() / count
    # a scale of fmax / amax (tensorwise) maps amax onto fmax up to the FP32 rounding of the quotient and the
    # product, at most 1 FP32 ulp above fmax: that is the scale working, not saturation
    saturated = (scaled.abs() > fmax * (1 + torch.finfo(torch.float32).eps)).sum() / count
    signal, noise = blocks.square().sum(), (blocks - q).square().sum()
    sqnr = torch.where(noise > 0, 10 * torch.log10(signal / noise), torch.full_like(noise, math.inf))
    return torch.stack([blocks.abs().amax(), scale.amin(), flushed, saturated, sqnr])


def unpack(values: list[float]) -> Stats:
    return Stats(*values)


def _blocks(x: Tensor, granularity: str) -> Tensor:
    """``x`` as ``[rows, width]`` (tensor, row) or ``[rows, blocks, 32]`` (block); the last dimension is the
    GEMM's reduction axis."""
    x = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    if granularity != "block":
        return x
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"MX blocks of {MX_BLOCK}: the last dimension {x.shape[-1]} is not a multiple of {MX_BLOCK}.")
    return x.reshape(x.shape[0], -1, MX_BLOCK)
