"""Count tensors' elements per octave of log2|x|, and the fractions FP16 could not hold at a loss scale.

The numbers behind the gradient and activation range monitors and the Fabric monitor; they take any list of
tensors, no Trainer needed.

Cost: the tensors are concatenated into one flat buffer (in chunks of at most ``_CHUNK_NUMEL`` elements, so the
extra memory stays bounded on big models) and counted with a handful of elementwise ops, an exact exponent
extraction (``torch.frexp``) and one ``index_add_`` into fixed buckets, all queued on the tensors' device. The
counts stay there, packed in one tensor, until the caller reads them back (one transfer). ``index_add_`` rather than
``torch.bincount`` because CUDA's bincount reads the largest index back to the host to size its output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_mp.formats import HALF_DTYPES, resolve_precision
from lightning_mp.numerics.loss_scaler import DEFAULT_INIT_SCALE

# Buckets: one per octave, bucket k holds |g| in [2^k, 2^(k+1)), i.e. log2|g| in [k, k+1), for every k an FP32
# number can have: from -149 (FP32's smallest subnormal 2^-149; BF16's is 2^-133) to 127 (FP32's max is just under
# 2^128). No finite nonzero FP32 gradient falls outside, so nothing is clamped into an edge bucket (only FP64
# gradients could be, and are). The width costs nothing to look at: TensorBoard drops the empty buckets at both
# ends, and only the span between the lowest and highest non-empty bucket is written.
# Landmarks: FP16 subnormal floor -24, FP16 normal floor -14, FP16 max (65504) in bucket 15, BF16 floor -133.
LOG2_LOW = -149
LOG2_HIGH = 127
NUM_BUCKETS = LOG2_HIGH - LOG2_LOW + 1

# The fractions are always measured against FP16: it is the 16-bit format whose range runs out. A bf16 or fp32 run
# reports what FP16 would do at the scale it starts with, so one FP32 run tells whether FP16 would underflow.
REFERENCE_FORMAT = resolve_precision("fp16")

_CHUNK_NUMEL = 2**23  # elements per flat buffer: ~8M, about 150 MB of temporaries with the masks and indices
_WIDTH = NUM_BUCKETS + 1  # one extra column per row collects zero, inf and NaN elements; dropped on the host


@dataclass(frozen=True)
class GradientRange:
    """Counts over a set of gradients (host-side numbers).

    ``counts`` holds one row of ``NUM_BUCKETS`` bucket counts per tensor (``per_tensor=True``) or a single row;
    bucket ``i`` holds the nonzero finite elements with ``LOG2_LOW + i <= log2|g| < LOG2_LOW + i + 1``.
    """

    numel: int
    zeros: int
    underflow: int
    overflow: int
    counts: list[list[int]]

    @property
    def histogram(self) -> list[int]:
        """Bucket counts over all tensors."""
        return [sum(col) for col in zip(*self.counts)] if self.counts else [0] * NUM_BUCKETS

    @property
    def zero_fraction(self) -> float:
        return self.zeros / self.numel if self.numel else 0.0

    @property
    def underflow_fraction(self) -> float:
        return self.underflow / self.numel if self.numel else 0.0

    @property
    def overflow_fraction(self) -> float:
        return self.overflow / self.numel if self.numel else 0.0


def reference_scale(plugin: Any) -> float:  # a lightning_mp plugin (loss_scale, format)
    """The loss scale the fractions are measured at: the scale this step used in an FP16 run, and FP16's default
    starting scale (``DEFAULT_INIT_SCALE`` = 2^16) in a bf16 or fp32 run."""
    if plugin.format.dtype == REFERENCE_FORMAT.dtype:
        return float(plugin.loss_scale)
    return DEFAULT_INIT_SCALE


def gradient_range(grads: Sequence[Tensor], scale: float, per_tensor: bool = False) -> GradientRange:
    """Measure ``grads`` (true, unscaled values) against FP16 at ``scale``; one host sync."""
    packed = measure_on_device(grads, scale, per_tensor)
    return unpack(packed.tolist(), sum(g.numel() for g in grads), len(grads) if per_tensor else 1)


@torch.no_grad()
def measure_on_device(grads: Sequence[Tensor], scale: float, per_tensor: bool) -> Tensor:
    """Queue the counting on the gradients' device and return it packed in one float64 tensor, without a sync:
    ``[zeros, underflow, not_overflow, row0 bucket counts..., row1...]`` (counts up to 2^53 are exact in float64).

    An element of ``g`` becomes ``g * scale`` in the 16-bit backward. It underflows when that is below FP16's
    smallest subnormal (nonzero ``g`` only) and overflows when it is above FP16's max or non-finite; both
    thresholds are divided by the scale once on the host instead of multiplying every element (exact for the
    power-of-two scales a dynamic scaler uses).
    """
    under_at = REFERENCE_FORMAT.smallest_subnormal / scale
    over_at = REFERENCE_FORMAT.max / scale
    rows = len(grads) if per_tensor else 1
    acc: dict[torch.device, tuple[Tensor, Tensor]] = {}
    for first_row, chunk in _chunks(grads):
        device = chunk[0].device
        if device not in acc:
            acc[device] = (
                torch.zeros(3, dtype=torch.int64, device=device),
                torch.zeros(rows * _WIDTH, dtype=torch.int64, device=device),
            )
        totals, hist = acc[device]
        # a copy either way: cat copies, and a single tensor must not be modified in place
        flat = torch.cat([g.reshape(-1) for g in chunk]).abs_() if len(chunk) > 1 else chunk[0].reshape(-1).abs()
        if flat.dtype in HALF_DTYPES:
            flat = flat.float()
        positive = flat > 0  # NaN compares false everywhere, so it is neither zero nor positive
        totals += torch.stack(
            [
                (flat == 0).sum(),
                (positive & (flat < under_at)).sum(),
                (flat <= over_at).sum(),  # inf and NaN fail this: overflow = numel - this, on the host
            ]
        )
        # frexp: |g| = m * 2^e with m in [0.5, 1), so floor(log2|g|) = e - 1 exactly, subnormals included
        # (float32 log2 rounds 2^k * (1 - 2^-24) up to exactly k for |k| >= 3: one bucket too high)
        exponent = torch.frexp(flat)[1].to(torch.int64)
        bucket = (exponent - (1 + LOG2_LOW)).clamp_(0, NUM_BUCKETS - 1)
        index = torch.where(positive & flat.isfinite(), bucket, NUM_BUCKETS)
        if per_tensor:
            start = 0
            for row, g in enumerate(chunk, start=first_row):
                if row:
                    index.narrow(0, start, g.numel()).add_(row * _WIDTH)
                start += g.numel()
        hist.index_add_(0, index, torch.ones((), dtype=torch.int64, device=device).expand(index.numel()))
    if not acc:
        return torch.zeros(3 + rows * NUM_BUCKETS, dtype=torch.float64)
    packed = []
    for totals, hist in acc.values():
        packed.append(torch.cat([totals, hist.view(rows, _WIDTH)[:, :NUM_BUCKETS].reshape(-1)]))
    out_device = next(iter(acc))
    return torch.stack([p.to(out_device) for p in packed]).sum(0).to(torch.float64)


def _chunks(grads: Sequence[Tensor]) -> list[tuple[int, list[Tensor]]]:
    """Consecutive gradients on one device, up to ``_CHUNK_NUMEL`` elements a chunk (a bigger one alone)."""
    out: list[tuple[int, list[Tensor]]] = []
    current: list[Tensor] = []
    first = size = 0
    for i, g in enumerate(grads):
        if current and (size + g.numel() > _CHUNK_NUMEL or g.device != current[0].device):
            out.append((first, current))
            current, size = [], 0
        if not current:
            first = i
        current.append(g)
        size += g.numel()
    if current:
        out.append((first, current))
    return out


def unpack(values: Sequence[float], numel: int, rows: int) -> GradientRange:
    zeros, underflow, not_overflow = (int(v) for v in values[:3])
    flat = [int(v) for v in values[3 : 3 + rows * NUM_BUCKETS]]
    counts = [flat[r * NUM_BUCKETS : (r + 1) * NUM_BUCKETS] for r in range(rows)]
    return GradientRange(numel, zeros, underflow, numel - not_overflow, counts)


def histogram_kwargs(counts: Sequence[int]) -> dict[str, Any]:
    """Arguments for ``SummaryWriter.add_histogram_raw`` over log2|g|, keeping buckets from the lowest to the highest
    non-empty one. ``min``/``max`` are that span's outer edges (TensorBoard draws the outermost buckets from min and
    max, so every drawn edge is an exact integer log2). ``sum``/``sum_squares`` use bucket midpoints: only the bucket
    of each value is known."""
    filled = [i for i, c in enumerate(counts) if c]
    if not filled:
        return dict(min=0.0, max=0.0, num=0, sum=0.0, sum_squares=0.0, bucket_limits=[], bucket_counts=[])
    lo, hi = filled[0], filled[-1]
    kept = [float(c) for c in counts[lo : hi + 1]]
    mids = [LOG2_LOW + i + 0.5 for i in range(lo, hi + 1)]
    return dict(
        min=float(LOG2_LOW + lo),
        max=float(LOG2_LOW + hi + 1),
        num=int(sum(kept)),
        sum=sum(c * m for c, m in zip(kept, mids)),
        sum_squares=sum(c * m * m for c, m in zip(kept, mids)),
        bucket_limits=[float(LOG2_LOW + i + 1) for i in range(lo, hi + 1)],
        bucket_counts=kept,
    )


@dataclass
class Pending:
    """A measurement of named tensors (``measure_on_device``'s packed counts) that the host has not read yet."""

    names: list[str]
    numel: int
    packed: Tensor  # on the device, not yet read back
