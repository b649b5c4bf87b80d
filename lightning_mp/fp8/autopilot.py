"""The FP8 autopilot (``fp8_modules="auto"``): the Linears whose operands FP8 cannot hold stay in bf16, decided
from measurements of this model rather than from their names or sizes.

The candidates are what ``fp8_modules`` would choose without ``"auto"`` (``"auto"`` alone: the default rule's
Linears; a list holding ``"auto"``: the list's). For the first ``calibration_steps`` training steps (the plugin's
knob, shared with ``fp32_modules="auto"``) they compute in **bf16**, and :class:`~lightning_mp.fp8.probe.Fp8Probe`
measures what the recipe's FP8 casts would do to each one's input, weight and output gradient
(:mod:`lightning_mp.fp8.statistics`). Calibrating in bf16, not in FP8, keeps a Linear that FP8 would damage from
damaging the first steps (and the optimizer's moments) before it is found. At the end of calibration a candidate
stays in bf16 when, at any calibration step, one of its three tensors

* flushes more than :data:`FLUSH_LIMIT` (1%) of its non-zero values to zero, or
* has a quantisation SQNR below :data:`SQNR_LIMIT_DB` (20 dB);

every other candidate computes in FP8 from the next forward on.

Why both, and why these limits: a tensor FP8 holds well keeps 3 (e4m3) or 2 (e5m2) mantissa bits on every value,
31 dB and 25 dB of SQNR on a Gaussian, and flushes nothing (a Gaussian row of 4096 values flushes about 1e-5 of
them in e4m3). SQNR is the error a tensor's energy sees: a range so wide that the large values themselves lose
bits (a rowwise scale shared by rows of very different size, e5m2's 2 bits on heavy tails) shows below 20 dB,
5 dB under e5m2's own floor. But SQNR is blind to an *outlier feature*: when a few features are 10^5 times the
rest, they carry the energy and keep their bits, the SQNR stays near 31 dB, and every other value of each row
falls below e4m3's smallest subnormal (2^-9 of the scale) and flushes to zero. The flushed fraction weighs every
value alike and catches it; 1% is a hundred times what a healthy tensor flushes, and far below what an outlier
feature does (most of the row).

Every rank takes the same decisions: at the end of calibration the ranks all-reduce (MAX) one table, per candidate
and tensor its worst flushed fraction and negated SQNR (6 floats per Linear), so a Linear any rank measured past a
limit stays in bf16 everywhere (:func:`~lightning_mp.numerics.distributed.agree_on_decisions`, the collective of
``fp32_modules="auto"`` too). The decisions, with their evidence, are logged, kept in :attr:`decisions`, shown by
``describe()``, logged to TensorBoard as text by the monitors (``precision/auto_fp8_decisions``), saved in the
plugin's checkpoint state and re-applied on resume (no recalibration).

Cost, while calibrating only: the probe's casts of each candidate's three tensors in FP32 and one host read per
step; none afterwards.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_mp.fp8.probe import Fp8Probe
from lightning_mp.fp8.statistics import RECIPE_SCALING, TENSORS, Stats
from lightning_mp.numerics.distributed import agree_on_decisions, rank

log = logging.getLogger("lightning_mp.plugin")  # the name users filter on, as fp32_modules='auto''s lines

FLUSH_LIMIT = 0.01
SQNR_LIMIT_DB = 20.0
_FORMAT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


@dataclass(frozen=True)
class Fp8Decision:
    """One candidate kept in bf16: its qualified name, the training step calibration ended at, the evidence."""

    module: str
    step: int | None
    evidence: str

    def __str__(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        return f"`{self.module}` kept in bf16{at}: {self.evidence}"


class Fp8Autopilot:
    """Calibrates a run's FP8 candidates and keeps in bf16 those FP8 hurts (see the module docstring)."""

    def __init__(self, recipe: str, calibration_steps: int) -> None:
        self.recipe = recipe
        self.calibration_steps = calibration_steps
        self.decisions: list[Fp8Decision] = []
        self._kept: set[str] = set()  # names kept in bf16 (decided, or restored from a checkpoint)
        self._steps = 0
        self._candidates: list[tuple[str, nn.Module]] = []
        self._probe: Fp8Probe | None = None
        self._worst: dict[str, list[float]] = {}  # module -> per tensor (flushed, -sqnr), the worst so far

    @property
    def calibrating(self) -> bool:
        return self._steps < self.calibration_steps

    @property
    def kept(self) -> list[str]:
        """Candidates kept in bf16, in module order."""
        return [name for name, _ in self._candidates if name in self._kept] if self._candidates else sorted(self._kept)

    def holds(self, name: str) -> bool:
        """Whether candidate ``name`` computes in bf16 now (calibrating, or kept)."""
        return self.calibrating or name in self._kept

    def attach(self, candidates: list[tuple[str, nn.Module]], dtype: torch.dtype) -> None:
        self.remove()
        self._candidates = list(candidates)
        self._probe = Fp8Probe(candidates, self.recipe, dtype)
        if self.calibrating and candidates:
            self._probe.arm()

    def remove(self) -> None:
        if self._probe is not None:
            self._probe.disarm()

    def end_step(self) -> bool:
        """One training step done (every rank calls it). Returns whether calibration ended with it: the decisions
        are taken (the caller then puts the other candidates in FP8)."""
        if not self.calibrating:
            return False
        if self._probe is not None:
            for name, stats in self._probe.collect().items():
                worst = self._worst.setdefault(name, [0.0, -math.inf] * len(TENSORS))
                for tensor, s in stats.items():
                    i = 2 * TENSORS.index(tensor)
                    worst[i], worst[i + 1] = max(worst[i], s.flushed_fraction), max(worst[i + 1], -s.sqnr_db)
        self._steps += 1
        if self.calibrating:
            if self._probe is not None and self._candidates:
                self._probe.arm()
            return False
        self._decide()
        return True

    def _decide(self) -> None:
        names = [name for name, _ in self._candidates]
        table = torch.tensor([self._worst.get(n, [0.0, -math.inf] * len(TENSORS)) for n in names]).reshape(
            len(names), 2 * len(TENSORS))
        table = agree_on_decisions(table, _device(self._candidates))  # every rank at once (-inf: nothing measured)
        for name, row in zip(names, table.tolist()):
            flushed, sqnr = row[0::2], [-v for v in row[1::2]]
            if max(flushed) <= FLUSH_LIMIT and min(sqnr) >= SQNR_LIMIT_DB:
                continue
            decision = Fp8Decision(name, self._steps - 1, self._evidence(flushed, sqnr))
            self.decisions.append(decision)
            self._kept.add(name)
            if rank() == 0:
                log.warning(f"fp8_modules='auto': {decision}")
        self._worst.clear()

    def _evidence(self, flushed: list[float], sqnr: list[float]) -> str:
        worst = max(range(len(TENSORS)), key=lambda i: flushed[i])
        fmt = _FORMAT.get(RECIPE_SCALING[self.recipe][TENSORS[worst]].dtype, "FP8")
        sqnrs = ", ".join(f"{t} {v:.1f} dB" for t, v in zip(TENSORS, sqnr))
        return (f"while calibrating ({self.calibration_steps} steps, recipe {self.recipe!r}) its {TENSORS[worst]} "
                f"flushed {flushed[worst]:.1%} of its non-zero values to zero in {fmt} (limit {FLUSH_LIMIT:.0%}); "
                f"SQNR {sqnrs} (limit {SQNR_LIMIT_DB:g} dB)")

    def describe(self) -> str:
        if self.calibrating:
            return (f"fp8_modules='auto': calibrating ({self._steps} of {self.calibration_steps} steps); the "
                    f"{len(self._candidates)} candidates compute in bf16 until then")
        kept = "".join(f"\n  - {d}" for d in self.decisions) or " none"
        return f"fp8_modules='auto' (calibrated over {self.calibration_steps} steps); kept in bf16:{kept}"

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        return {"kept": sorted(self._kept), "calibrated_steps": self._steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps = int(state.get("calibrated_steps", self.calibration_steps))
        known = {d.module for d in self.decisions}
        restored = [n for n in state.get("kept", []) if n not in known]
        self.decisions += [Fp8Decision(n, None, "decided by the run this checkpoint comes from") for n in restored]
        self._kept = set(state.get("kept", []))
        self._worst.clear()
        if not self.calibrating:
            self.remove()


def _device(candidates: list[tuple[str, nn.Module]]) -> torch.device:
    """The model's device, where the ranks' table is reduced (NCCL reduces device tensors only)."""
    first = next((p for _, m in candidates for p in m.parameters()), None)
    return first.device if first is not None else torch.device("cpu")
