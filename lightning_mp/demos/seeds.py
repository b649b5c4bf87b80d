"""Comparing precisions over several seeds: a difference is claimed only when it is larger than the seed spread.

One training run per precision measures luck as much as precision: on the demo GPT with lr 1e-3 and no warmup,
FP32 and bf16 agree to 3 decimals for 9 steps and then one of them spikes, by an amount that depends on the seed.
``benchmarks/compare_precisions.py`` and ``examples/train_resnet.py`` therefore train every precision on the same
seeds and report, per precision, the mean and the min-max range over seeds; :func:`compare` calls a difference
*beyond the seed spread* only when the two ranges do not overlap (every seed of one precision ended better than
every seed of the other). With 3 seeds that is a demanding test, and meant to be: a difference it does not pass is
not shown to exist. The per-seed (paired) differences are reported beside it, since both precisions see the same
initialisation and the same batches on a given seed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Literal, Optional

Verdict = Literal["beyond", "within", "one seed", "no result"]

_VERDICT_TEXT: dict[str, str] = {
    "beyond": "beyond the seed spread (the min-max ranges do not overlap)",
    "within": "within seed spread: no difference claimed",
    "one seed": "one seed, no spread measured: no difference claimed (HINT: --seeds 3)",
    "no result": "no result for one of them",
}


def seed_list(values: list[int]) -> list[int]:
    """What ``--seeds`` means: one number N is seeds ``0..N-1``; two or more numbers are exactly those seeds."""
    if len(values) == 1:
        if values[0] < 1:
            raise ValueError(f"--seeds={values[0]!r} is not allowed: one number is a count of seeds, use N >= 1.")
        return list(range(values[0]))
    if not values or any(v < 0 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"--seeds={' '.join(map(str, values))!r} is not allowed: use distinct seeds >= 0.")
    return list(values)


@dataclass(frozen=True)
class SeedSpread:
    """One metric of one precision: its value per seed (seeds whose run failed are absent)."""

    values: dict[int, float] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> Optional[float]:
        return statistics.fmean(self.values.values()) if self.values else None

    @property
    def min(self) -> Optional[float]:
        return min(self.values.values()) if self.values else None

    @property
    def max(self) -> Optional[float]:
        return max(self.values.values()) if self.values else None

    def range_text(self, fmt: str) -> str:
        """``[min, max]``, or ``-`` without values."""
        return "-" if not self.values else f"[{self.min:{fmt}}, {self.max:{fmt}}]"


@dataclass(frozen=True)
class Comparison:
    """``name - baseline`` on one metric."""

    metric: str
    name: str
    baseline: str
    delta: Optional[float]  # difference of the means
    paired: dict[int, float]  # per seed both ran: name's value - baseline's value
    verdict: Verdict

    def line(self, fmt: str) -> str:
        """One Markdown list item, e.g. ``- val loss: bf16 - fp32 = +0.0123, within seed spread: ...``."""
        label = f"{self.metric}: {self.name} - {self.baseline}"
        if self.delta is None:
            return f"- {label}: {_VERDICT_TEXT['no result']}"
        paired = ", ".join(f"seed {s}: {v:+{fmt}}" for s, v in sorted(self.paired.items()))
        return f"- {label} = {self.delta:+{fmt}}, {_VERDICT_TEXT[self.verdict]}" + (f" ({paired})" if paired else "")


def compare(metric: str, name: str, a: SeedSpread, baseline: str, b: SeedSpread) -> Comparison:
    """``a`` (precision ``name``) against ``b`` (``baseline``): beyond the spread when their ranges are disjoint."""
    if not a.n or not b.n:
        return Comparison(metric, name, baseline, None, {}, "no result")
    paired = {s: v - b.values[s] for s, v in a.values.items() if s in b.values}
    if min(a.n, b.n) < 2:
        verdict: Verdict = "one seed"
    elif a.min > b.max or a.max < b.min:
        verdict = "beyond"
    else:
        verdict = "within"
    return Comparison(metric, name, baseline, a.mean - b.mean, paired, verdict)
