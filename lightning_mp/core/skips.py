"""What a run says when a step is skipped, when it stops, and what it refuses at set-up for the same reason: a step
that must be skippable (:class:`lightning_mp.core.MixedPrecisionCore` calls these)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch.optim import LBFGS, Optimizer

from lightning_mp.doctor.report import OverflowReport

log = logging.getLogger("lightning_mp.plugin")  # the name users filter on for the skip lines


def skip_line(step: int | None, scale: float, report: OverflowReport | None, late: bool = False) -> str:
    """The log line of a skipped step: its number, the scale after the backoff, and where it went non-finite
    (``late``: the optimizer skipped on the device and the locator found its gradients gone)."""
    where = f": {report}" if report is not None else ""
    if report is not None and not report.forward_checked:
        where += "; the forward checks are armed now and name the module at the next skipped step"
    if late:
        where += ("; the optimizer skipped it on the device and the host read the flag a step later, its gradients "
                  "gone: from now on the host reads the flag before each step, and the next skipped step is located")
    return f"step {step} skipped (loss scale {scale:g}){where}"


def defer_flags(core: Any) -> None:
    """Let fused optimizers skip on the device (:mod:`lightning_mp.numerics.deferred`), except where a skip must be
    read at once (the autopilot's decisions, the locator's forward checks from the first step). A skip read a step
    late is logged; with the locator on, the host reads every flag from then on, so the next skip is named."""
    core.step.deferral.enabled = core.autopilot is None and core.locate_overflows != "forward"
    core.step.on_late_skip = LateSkip(core)


class LateSkip:
    """``step.on_late_skip`` of a run (:func:`defer_flags`): the line of a skip read a step late, and the locator armed.

    An object rather than a closure: the plugin holds it for good, and a closure would not pickle (``ddp_spawn``,
    ``torch.save(trainer)``); its one reference is the run's core, which pickles with the plugin."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def __call__(self, number: int | None) -> None:
        core = self.core
        if getattr(core, "_rank_zero", True):
            log.warning(skip_line(number, core.scaler.scale, None, late=core.locator is not None))
        if core.locator is not None:
            core.locator.check_forward = True  # armed, as at a skip read at once
            core.step.deferral.enabled = False


class LocateOverflow:
    """``step.on_overflow`` of a run with the locator: a skipped step's first non-finite gradient named. An object, as
    :class:`LateSkip`, so a plugin pickled mid-run (a Fabric loop's ``torch.save``) still locates after loading."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def __call__(self, optimizer: Any) -> None:
        self.core.locator.locate_gradients(self.core.named_grads(optimizer))


def stop_error(err: FloatingPointError, report: OverflowReport) -> FloatingPointError:
    """The scaler's stop (step, scale, hint) with where the step first went non-finite."""
    hint = ""
    if not report.forward_checked:  # the run stops at the skip that armed the forward checks
        hint = (" HINT: to name the module, rerun with locate_overflows='forward': the forward checks from "
                "the first step (9-13% of a step) name it at the first skipped step.")
    return FloatingPointError(f"{err} Where it first went non-finite: {report}.{hint}")


def refuse_lbfgs(optimizers: Sequence[Optimizer], dynamic: bool, lean: bool) -> None:
    """LBFGS re-evaluates its closure inside ``step()``: a dynamic scale's skip and lean bf16's buckets need a step
    that can be skipped or split."""
    if (dynamic or lean) and any(isinstance(opt, LBFGS) for opt in optimizers):
        raise ValueError(
            "LBFGS re-evaluates its closure inside step(), so a step with an overflow cannot be skipped and "
            "buckets cannot step apart: loss_scale='dynamic' and master_weights='compensated' do not support it. "
            "HINT: use a static loss_scale=<number>, or precision='bf16' with master_weights=True."
        )


def not_resumed(modules: list[str]) -> str:
    """The warning for a checkpoint whose run moved modules to FP32 (``fp32_modules='auto'``), resumed without it."""
    return (f"The checkpoint's run moved {modules} to FP32 (fp32_modules='auto'); this plugin does not, so the "
            "resumed run computes differently. HINT: resume with fp32_modules='auto'.")
