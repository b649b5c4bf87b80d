"""Every rank takes the autopilot's decisions together (``fp32_modules="auto"`` under DDP or FSDP2, one node or many).

What one rank measures while calibrating, or what its overflow locator names on a skipped step, is only a
*proposal*: that rank's batch put the module past the threshold. At the end of each calibration step and of each
skipped step every rank all-reduces (MAX) one table, a row per module of the model (``named_modules`` order, the same
on every rank), and every rank moves the modules any rank proposed (the union), at the same step, with the same
decision text. Without it one rank would rebuild its gradient buffer (the moved module's parameters keep no 16-bit
copy) and the next gradient all-reduce would not match the others' (gloo aborts with "Received data size doesn't
match expected size", NCCL hangs); under FSDP2 the ranks would compute the module in different precisions, and the
checkpoint, which holds rank 0's list, would drop the other ranks' decisions on resume.

A row is float32, zeros where this rank proposes nothing; the MAX keeps, per column, the largest over the ranks:

======================  ===========================================================================================
column                  what a proposing rank writes
======================  ===========================================================================================
calibration output      the output ``amax`` it measured while calibrating (>= the threshold; non-finite as inf)
calibration input       its inputs' ``amax``
located code            a located forward overflow: ``1 + 2 * (3 * tensor + value) + has input amax``, one number,
                        so the reduced row holds one rank's report kind whole
located input           the report's input ``amax``
world - rank            the lowest proposing rank (``world - MAX``)
rank + 1                the highest proposing rank
======================  ===========================================================================================

float32 holds each ``amax`` exactly (they are float32 or 16-bit values) and each rank below 2^24.

Cost: one all-reduce of 24 bytes per module (12 KB for a 500-module model) at the end of each calibration step and of
each skipped step, and one host read of its result (a device sync on CUDA, where calibration syncs on every module
already); nothing on a clean step after calibration. In one process there is no collective and no copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightning_mp.doctor.report import OverflowReport
from lightning_mp.numerics.distributed import agree_on_decisions, rank, world_size

COLUMNS = ("calibration output", "calibration input", "located code", "located input", "world - rank", "rank + 1")
_CAL_OUT, _CAL_IN, _LOC_CODE, _LOC_IN, _FIRST, _LAST = range(len(COLUMNS))
LOCATED_TENSORS = ("output", "own code")  # the forward reports that name a module to move
_VALUES = ("inf", "-inf", "nan")


@dataclass(frozen=True)
class Agreed:
    """One module the ranks agreed to move: the largest values its proposing ranks measured, and which ranks.

    ``output_amax`` and ``input_amax`` are a calibration's (``output_amax`` is ``None`` for a located overflow, which
    ``located`` then describes); ``first_rank`` and ``last_rank`` are the lowest and highest proposing ranks."""

    index: int
    output_amax: float | None
    input_amax: float | None
    located: OverflowReport | None
    first_rank: int
    last_rank: int

    def where(self) -> str:
        """Which ranks measured it, for the decision's text (``""`` in one process)."""
        world = world_size()
        if world == 1:
            return ""
        if self.first_rank == self.last_rank:
            return f" (rank {self.first_rank} of {world})"
        return f" (ranks {self.first_rank} to {self.last_rank} of {world}: the largest values measured)"


class Proposals:
    """This rank's proposals in the step in progress, and the one collective that agrees on them."""

    def __init__(self) -> None:
        self._rows: dict[int, list[float]] = {}  # module index -> this rank's row

    def measured(self, index: int, output_amax: float, input_amax: float) -> None:
        """Calibration measured module ``index``'s output past the threshold."""
        self._propose(index, {_CAL_OUT: output_amax, _CAL_IN: input_amax})

    def located(self, index: int, report: OverflowReport) -> bool:
        """The locator named module ``index`` (``report``); False for a report that moves no module."""
        if report.phase != "forward" or report.tensor not in LOCATED_TENSORS:
            return False
        value = _VALUES.index(report.value) if report.value in _VALUES else 0
        code = 1 + 2 * (3 * LOCATED_TENSORS.index(report.tensor) + value) + (report.input_amax is not None)
        self._propose(index, {_LOC_CODE: code, _LOC_IN: report.input_amax or 0.0})
        return True

    def clear(self) -> None:
        self._rows.clear()

    def agree(self, names: list[str], types: list[str], device: torch.device) -> list[Agreed]:
        """Every rank at once: the modules any rank proposed since the last call, in module order. ``names`` and
        ``types``: each row's module name and class name (the same on every rank)."""
        table = torch.zeros(len(names), len(COLUMNS))
        for index, row in self._rows.items():
            table[index] = torch.tensor(row)
        self._rows.clear()
        table = agree_on_decisions(table, device)  # every rank at once, on the model's device
        agreed = []
        for index in ((table[:, _CAL_OUT] > 0) | (table[:, _LOC_CODE] > 0)).nonzero().flatten().tolist():
            row = table[index].tolist()
            located = None
            if row[_CAL_OUT] == 0:
                code = int(row[_LOC_CODE]) - 1
                tensor, value = LOCATED_TENSORS[code // 6], _VALUES[(code % 6) // 2]
                input_amax = row[_LOC_IN] if code % 2 else None
                located = OverflowReport("forward", names[index], types[index], tensor, value, input_amax)
            agreed.append(Agreed(
                index, row[_CAL_OUT] or None, row[_CAL_IN] if row[_CAL_OUT] else None, located,
                world_size() - int(row[_FIRST]), int(row[_LAST]) - 1,
            ))  # fmt: skip
        return agreed

    def _propose(self, index: int, values: dict[int, float]) -> None:
        row = self._rows.setdefault(index, [0.0] * len(COLUMNS))
        me = rank()
        for column, value in {**values, _FIRST: world_size() - me, _LAST: me + 1}.items():
            row[column] = max(row[column], math.inf if math.isnan(value) else value)  # MAX, as the ranks' reduce
