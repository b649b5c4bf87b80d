"""What :class:`lightning_mp.OverflowLocator` says, and how it is read back from the checks kept on the device.

:class:`OverflowReport` names the module, the phase and the tensor where a step first went non-finite.
:func:`_first_report` turns the locator's device records (``[min, max]`` pairs, never read on a clean step) into that
report, reading them all in one transfer per device. A non-finite loss with no module output found non-finite is a
forward overflow too (``tensor="loss"``): the backward only carried it to the gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from lightning_mp.doctor.finite_checks import _amax, _non_finite, _to_host

PHASES = ("forward", "backward")

# One device check: (seq, module index, phase index, tensor, [min, max] on the device, the inputs' [min, max]s).
# An empty [min, max] list with input stats keeps a forward's input numbers for the "own code" case.
_Record = tuple[int, int, int, str, list[Tensor], list[Tensor] | None]


@dataclass(frozen=True)
class OverflowReport:
    """Where a step first went non-finite.

    Attributes:
        phase: ``"forward"`` (a module's output, or the loss) or ``"backward"`` (a gradient its backward produced).
        module: the module's qualified name in the model (``""`` is the model itself); ``None`` when no module is
            named (``tensor="loss"``).
        module_type: the module's class name (``None`` with ``module=None``).
        tensor: what went non-finite: ``"output"``, ``"input gradient"``, ``"gradient of <parameter>"``,
            ``"own code"``: a forward overflow in the module's own code between its submodules (the first
            submodule output that went non-finite had a non-finite input, made by this module's ``forward``), or
            ``"loss"``: the loss itself was non-finite, so the forward went non-finite before the backward began,
            and no checked module output was (see ``forward_checked``).
        value: ``"inf"``, ``"-inf"`` or ``"nan"``.
        input_amax: forward overflows: the largest magnitude at the module's floating inputs (finite: the overflow
            happened inside it). ``None`` for backward overflows and for modules without a floating input.
        forward_checked: whether module outputs were checked in that step. ``False`` only on a ``"loss"`` report of
            a step that ran with the forward checks off: some module or the loss code made the inf, which one is
            not known. ``True`` on a ``"loss"`` report: every module's output was finite, the loss code made it.
        reached: on a ``"loss"`` report with ``forward_checked=False``, the first non-finite gradient in backward
            order: where the inf reached the backward, not where it started. Else ``None``.
    """

    phase: str
    module: str | None
    module_type: str | None
    tensor: str
    value: str
    input_amax: float | None = None
    forward_checked: bool = True
    reached: OverflowReport | None = None

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase={self.phase!r} is not allowed: use one of {PHASES}.")

    @property
    def name(self) -> str:
        """The module's name, ``<model>`` for the model itself, ``<loss>`` when no module is named."""
        return "<loss>" if self.module is None else self.module or "<model>"

    def __str__(self) -> str:
        if self.tensor == "loss":
            return self._loss_text()
        head = f"{self.phase} overflow in `{self.name}` ({self.module_type})"
        if self.tensor == "own code":
            text = f"{head}: its own forward code, between its submodules, made a {self.value}"
        else:
            text = f"{head}: {self.tensor} went {self.value}"
        if self.input_amax is None:
            return text
        if math.isfinite(self.input_amax):
            return f"{text}; largest input magnitude {self.input_amax:.4g}"
        return f"{text}; its input was already non-finite"

    def _loss_text(self) -> str:
        if self.forward_checked:
            return (
                f"forward overflow in the loss: every module's output was finite, the loss went {self.value} (the "
                "loss function, or code outside the modules, made it)"
            )
        text = (
            f"forward overflow: the loss was already {self.value}, so the forward made it; no module output was "
            "checked in this step (the forward checks were off), so the module is not named"
        )
        if self.reached is None:
            return text
        r = self.reached
        return f"{text}; the backward carried it to `{r.name}` ({r.module_type}) first: {r.tensor} went {r.value}"


@dataclass(frozen=True)
class _Found:
    seq: int
    report: OverflowReport
    module: int = -1  # the module's index in the locator's lists


def _first_report(
    records: list[_Record],
    found: dict[int, _Found],
    names: list[str],
    types: list[str],
    parameters: Callable[[], _Found | None] | None = None,
    forward_rank: Callable[[int], tuple[int, int]] | None = None,
    loss: Callable[[], OverflowReport | None] | None = None,
) -> OverflowReport | None:
    """The first non-finite forward output among ``records`` and the CPU culprits ``found`` (phase index -> the
    first one, by sequence number), else ``loss()`` (a non-finite loss: the forward went non-finite, and the
    backward only carried it), else the first non-finite gradient, else ``None``. ``names`` and ``types`` are the
    watched modules' qualified names and class names, by module index.

    Gradients come from two places: input-gradient checks recorded during the backward (in ``records`` and
    ``found``, first by sequence number), and ``parameters()``, called only when no forward output was non-finite:
    the first non-finite parameter gradient in backward order. Of the two, the one whose module ran later in the
    forward (``forward_rank``) came first in the backward; the parameter gradient wins a tie (the same module's
    backward made both).

    Reads the device checks back in one transfer per device (a host sync).
    """
    flat = [t for rec in records for t in rec[4]]
    spans: list[tuple[int, int]] = []
    for rec in records:
        start = len(flat)
        flat.extend(rec[5] or ())
        spans.append((start, len(flat)))
    values = _to_host(flat)
    for phase in (0, 1):
        best = found.get(phase)
        offset = 0
        for pos, (seq, module, rec_phase, tensor, stats, inputs) in enumerate(records):
            vals = values[offset : offset + len(stats)]
            offset += len(stats)
            if rec_phase != phase or (best is not None and best.seq < seq):
                continue
            value = _non_finite(vals)
            if value is None:
                continue
            amax = _amax(values[spans[pos][0] : spans[pos][1]]) if inputs else None
            report = OverflowReport(PHASES[phase], names[module], types[module], tensor, value, amax)
            if phase == 0 and amax is not None and not math.isfinite(amax):
                report = _own_code_report(records, names, types, pos, value, values, spans) or report
            best = _Found(seq, report, module)
            break
        if phase == 0 and best is None and loss is not None:
            best_loss = loss()
            if best_loss is not None:
                return best_loss
        if phase == 1 and parameters is not None:
            param = parameters()
            if param is not None and (best is None or forward_rank(param.module) >= forward_rank(best.module)):
                best = param
        if best is not None:
            return best.report
    return None


def _own_code_report(
    records: list[_Record],
    names: list[str],
    types: list[str],
    pos: int,
    value: str,
    values: list[float],
    spans: list[tuple[int, int]],
) -> OverflowReport | None:
    """Device path of the 'own code' case: the enclosing module (by name) whose recorded input was finite."""
    index = records[pos][1]
    while names[index]:
        parent = names[index].rpartition(".")[0]
        if parent not in names:
            return None
        index = names.index(parent)
        later = next((p for p in range(pos + 1, len(records)) if records[p][1:3] == (index, 0)), None)
        if later is None:
            continue  # no record of that call (not run under autograd): look further out
        amax = _amax(values[spans[later][0] : spans[later][1]])
        if amax is None or math.isfinite(amax):
            return OverflowReport("forward", names[index], types[index], "own code", value, amax)
    return None
