"""The picture ``precision/ranges_vs_formats``: where activations and gradients sit on the log2 axis, against the
ranges of the 16-bit and 8-bit formats.

Every number format covers a band of exponents: normal numbers from the smallest normal up to the largest value
(full precision), and below them subnormals down to the smallest subnormal (precision thinning one bit per
octave). The picture stacks those bands (fp16, bf16, fp8 e4m3, fp8 e5m2; limits from ``torch.finfo``) under the
octave histograms of a step's activations and gradients, with the gradients drawn twice: their true values, and
shifted right by log2(loss scale), where the 16-bit backward actually holds them.

Rendering needs matplotlib (the ``plot`` extra, ``pip install lightning-mp[plot]``); :func:`plotting_available`
says whether it is there. Figures are drawn off-screen (the Agg canvas), never through pyplot's global state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from lightning_mp.doctor.log2_histogram import LOG2_LOW


@dataclass(frozen=True)
class FormatBand:
    """A format's range on the log2|x| axis (exponents of powers of two)."""

    name: str
    smallest_subnormal: float  # log2 of the smallest positive value
    smallest_normal: float  # log2 of the smallest normal value
    max: float  # log2 of the largest finite value

    @classmethod
    def of(cls, name: str, dtype: torch.dtype) -> FormatBand:
        info = torch.finfo(dtype)
        subnormal = info.smallest_normal * info.eps
        return cls(name, math.log2(subnormal), math.log2(info.smallest_normal), math.log2(info.max))


# the formats drawn, top to bottom: the 16-bit training formats, then the two FP8 formats of FP8 training
# (e4m3 for weights and activations, e5m2 for gradients)
FORMAT_DTYPES: tuple[tuple[str, torch.dtype], ...] = (
    ("fp16", torch.float16),
    ("bf16", torch.bfloat16),
    ("fp8 e4m3", torch.float8_e4m3fn),
    ("fp8 e5m2", torch.float8_e5m2),
)


def format_bands() -> list[FormatBand]:
    return [FormatBand.of(name, dtype) for name, dtype in FORMAT_DTYPES]


@lru_cache(maxsize=1)
def plotting_available() -> bool:
    """Whether matplotlib can be imported (checked once)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def render_ranges_vs_formats(
    activations: Sequence[int],
    gradients: Sequence[int] | None,
    scale: float,
    step: int,
    scale_label: str = "loss scale",
) -> np.ndarray:
    """Draw the picture; returns an RGB image as a ``(height, width, 3)`` uint8 array.

    Args:
        activations: octave bucket counts of |activation| (``NUM_BUCKETS`` long, bucket ``i`` = ``[2^(LOG2_LOW+i),
            2^(LOG2_LOW+i+1))``, as :mod:`lightning_mp.monitors.gradient_range` counts them).
        gradients: the same for the true (unscaled) gradients, or ``None`` when none were measured.
        scale: the loss scale whose shift is drawn (1 draws no shift).
        step: the training step, for the title.
        scale_label: how the scale is named in the legend (e.g. "FP16's starting scale" in a bf16 run).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shift = math.log2(scale) if scale > 0 else 0.0
    series = [("activations", activations, 0.0, "#1f77b4", "-")]
    if gradients is not None and sum(gradients):
        series.append(("gradients (true values)", gradients, 0.0, "#d62728", "-"))
        if shift:
            series.append((f"gradients x {scale_label} 2^{shift:g}", gradients, shift, "#d62728", "--"))
    filled = [LOG2_LOW + i + s for _, counts, s, _, _ in series for i, c in enumerate(counts) if c]
    lo = min(filled + [-26.0]) - 3
    hi = max(filled + [17.0]) + 3

    fig = Figure(figsize=(10, 5.6), dpi=100)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2], "hspace": 0.08})
    for label, counts, s, color, style in series:
        total = sum(counts)
        if not total:
            continue
        edges = [LOG2_LOW + i + s for i in range(len(counts) + 1)]
        fractions = [c / total for c in counts]
        top.stairs(fractions, edges, label=label, color=color, linestyle=style, linewidth=1.8,
                   fill=style == "-", alpha=0.35 if style == "-" else 1.0)
        if style == "-":
            top.stairs(fractions, edges, color=color, linewidth=1.2)
    if shift and gradients is not None and sum(gradients):
        peak = LOG2_LOW + max(range(len(gradients)), key=gradients.__getitem__) + 0.5
        top.annotate("", xy=(peak + shift, 0.5), xytext=(peak, 0.5), xycoords=("data", "axes fraction"),
                     arrowprops=dict(arrowstyle="->", color="#d62728", lw=1.5))
        top.text(peak + shift / 2, 0.53, f"x {scale:g} (+{shift:g} octaves)", transform=top.get_xaxis_transform(),
                 ha="center", color="#d62728", fontsize=9)
    top.set_yscale("log")
    top.set_ylim(1e-7, 1.5)
    top.set_ylabel("fraction of elements per octave")
    top.set_title(f"step {step}: where activations and gradients sit, against the number formats")
    top.legend(loc="upper left", fontsize=9)
    top.grid(axis="x", alpha=0.3)

    bands = format_bands()
    for row, band in enumerate(bands):
        y = len(bands) - 1 - row
        bottom.barh(y, band.smallest_normal - band.smallest_subnormal, left=band.smallest_subnormal, height=0.6,
                    color="#7f7f7f", alpha=0.35, hatch="///", edgecolor="#555555", linewidth=0.5)
        bottom.barh(y, band.max - band.smallest_normal, left=band.smallest_normal, height=0.6, color="#2ca02c",
                    alpha=0.7)
        text = (
            f"{band.name}: normal 2^{band.smallest_normal:g} .. {2**band.max:.6g}, "
            f"subnormal down to 2^{band.smallest_subnormal:g}"
        )
        bottom.text(lo + 0.5, y + 0.34, text, fontsize=8, va="bottom")
    fp16 = bands[0]
    for x in (fp16.smallest_subnormal, fp16.smallest_normal, fp16.max):
        for ax in (top, bottom):
            ax.axvline(x, color="#555555", linestyle=":", linewidth=0.9)
    bottom.set_yticks(range(len(bands)), [b.name for b in reversed(bands)])
    bottom.set_ylim(-0.5, len(bands) - 0.1)
    bottom.set_xlim(lo, hi)
    bottom.set_xlabel("log2 |x|   (green: normal range; hatched: subnormals; dotted: fp16's limits)")
    bottom.grid(axis="x", alpha=0.3)
    fig.subplots_adjust(left=0.09, right=0.98, top=0.94, bottom=0.1)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


__all__ = ["FORMAT_DTYPES", "FormatBand", "format_bands", "plotting_available", "render_ranges_vs_formats"]
