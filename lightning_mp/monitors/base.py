"""What the precision monitors share: find the plugin and a logger at ``fit`` setup, count the training steps the
scaler has seen, name Lightning's logging step, and find the loggers that take histograms."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_mp.core.ladder import label
from lightning_mp.lightning.plugin import MixedPrecisionPlugin


class _PrecisionMonitor(Callback):
    """Find the plugin and a logger at ``fit`` setup, and track which training steps the scaler has already seen
    (``plugin.training_steps`` moves once per training step that stepped).

    Subclasses that also work without the plugin (reading only the model) set ``_requires_plugin = False``; their
    ``_plugin`` is then ``None`` in a run without it.
    """

    _requires_plugin = True

    def __init__(self) -> None:
        self._plugin: MixedPrecisionPlugin | None = None
        self._seen_steps = 0
        self._logged_decisions = 0
        self._logged_fp8_decisions = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        name = type(self).__name__
        if not trainer.loggers:
            raise MisconfigurationException(
                f"Cannot use `{name}` callback with a `Trainer` that has no logger. "
                "HINT: pass `logger=TensorBoardLogger(save_dir)` (or any Lightning logger) to the Trainer."
            )
        plugin = trainer.precision_plugin
        if not isinstance(plugin, MixedPrecisionPlugin):
            if not self._requires_plugin:
                self._plugin = None
                return
            raise MisconfigurationException(
                f"`{name}` reads the loss scaler of `lightning_mp.MixedPrecisionPlugin`, but this Trainer's precision "
                f"plugin is {type(plugin).__name__} (precision={trainer.precision!r}). HINT: add it to the Trainer: "
                f"`Trainer(plugins=[MixedPrecisionPlugin('fp16')], callbacks=[{name}()])` (use it instead of the "
                "`precision=` argument)."
            )
        self._plugin = plugin

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after a checkpoint restore, so a resumed run does not log the restored count as a new step
        self._seen_steps = self._plugin.training_steps if self._plugin is not None else 0


def _logger_step(trainer: pl.Trainer) -> int:
    """The step Lightning's loggers use for this batch: batches that stepped an optimizer so far, counted once per
    batch whatever the number of optimizers. Lightning has no public name for it; LearningRateMonitor reads the
    same counter. During the batch's hooks it still holds this batch's index (it moves after ``on_train_batch_end``)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


TAG_AUTO_COUNT = "precision/auto_fp32_modules"  # scalar: modules the autopilot moved to FP32 so far
TAG_AUTO_TEXT = "precision/auto_fp32_decisions"  # text: one entry per decision, with its evidence


TAG_PARITY_DRIFT = "precision/parity_drift"  # lean bf16's relative drift from its FP32 shadows
TAG_PARITY_LOST = "precision/parity_lost_fraction"  # the fraction of the shadows' updates the lean values lost


def plugin_metrics(plugin: Any, loggers: Iterable[Any], logged: int, step: int) -> tuple[dict[str, float], int]:
    """The parity guard's last measurement, and with ``fp32_modules="auto"`` the count as a metric and each decision
    not logged yet (``logged`` of them were) as a text entry for the loggers that take text (TensorBoard). Returns the
    metrics and the new count of logged decisions."""
    metrics = {}
    if plugin.parity is not None:
        metrics = {TAG_PARITY_DRIFT: plugin.parity[0], TAG_PARITY_LOST: plugin.parity[1]}
    autopilot = plugin.core.autopilot
    if autopilot is None:
        return metrics, logged
    decisions = autopilot.decisions
    for writer in (getattr(lg, "experiment", None) for lg in loggers):
        if hasattr(writer, "add_text"):
            for decision in decisions[logged:]:
                writer.add_text(TAG_AUTO_TEXT, str(decision), step)
    return {**metrics, TAG_AUTO_COUNT: float(len(decisions))}, len(decisions)


TAG_FORMAT = "precision/format"  # scalar: significand bits of the step's format (24 fp32, 11 fp16, 8 bf16, 4 fp8)
TAG_SCHEDULE_TEXT = "precision/schedule"  # text: one entry per switch of a precision schedule


def format_metrics(plugin: Any, loggers: Iterable[Any], seen: tuple[int, bool], step: int
                   ) -> tuple[dict[str, float], tuple[int, bool]]:
    """The step's format as a scalar and, where a precision schedule moved to another rung since the last point
    (``seen``: its rung, and whether it scaled the loss), a text entry saying what changed (TensorBoard). Returns the
    metrics and what this point saw."""
    ladder = plugin.ladder
    now = (ladder.current, plugin.scaler is not None)
    if now[0] != seen[0]:
        # every rung begun since the last point (several where the logging interval spans several switches), each
        # named by the step it began at (the schedule's step; the point's own step comes later past an interval)
        rungs = range(seen[0] + 1, now[0] + 1) if now[0] > seen[0] else [now[0]]
        for rung in rungs:
            begun = ladder.starts[rung - 1] if rung and ladder.starts else step
            text = f"step {begun}: " + (f"{label(plugin.core)} ({ladder.describe(rung)})" if rung == now[0]
                                        else ladder.describe(rung))
            if rung == now[0] and seen[1] and not now[1]:
                text += "; the loss scale retires (1.0 from now on)"
            for writer in (getattr(lg, "experiment", None) for lg in loggers):
                if hasattr(writer, "add_text"):
                    writer.add_text(TAG_SCHEDULE_TEXT, text, step)
    return {TAG_FORMAT: float(plugin.format.significand_bits)}, now


TAG_AUTO_FP8_COUNT = "precision/auto_fp8_modules"  # scalar: Linears fp8_modules='auto' keeps in bf16
TAG_AUTO_FP8_TEXT = "precision/auto_fp8_decisions"  # text: one entry per Linear kept in bf16, with its evidence


def fp8_decision_metrics(plugin: Any, loggers: Iterable[Any], logged: int, step: int) -> tuple[dict[str, float], int]:
    """With ``fp8_modules="auto"``, once calibration ended: the count of Linears kept in bf16 as a metric, and each
    decision not logged yet (``logged`` of them were) as a text entry (TensorBoard). Returns the metrics and the new
    count of logged decisions."""
    autopilot = getattr(plugin.core.fp8, "autopilot", None)
    if autopilot is None or autopilot.calibrating:
        return {}, logged
    decisions = autopilot.decisions
    for writer in (getattr(lg, "experiment", None) for lg in loggers):
        if hasattr(writer, "add_text"):
            for decision in decisions[logged:]:
                writer.add_text(TAG_AUTO_FP8_TEXT, str(decision), step)
    return {TAG_AUTO_FP8_COUNT: float(len(decisions))}, len(decisions)


def histogram_writers(loggers: Iterable[Any]) -> list[Any]:
    """The loggers' experiments that take raw histograms (TensorBoard's ``SummaryWriter``)."""
    experiments = (getattr(lg, "experiment", None) for lg in loggers)
    return [w for w in experiments if hasattr(w, "add_histogram_raw")]


def no_histogram_message(owner: str, logs: str, needs: str, still: str, loggers: Iterable[Any]) -> str:
    """The one warning a monitor gives when no logger takes what it draws; ``still`` is what is logged anyway."""
    names = ", ".join(type(lg).__name__ for lg in loggers)
    return (
        f"`{owner}` logs {logs} only to loggers whose experiment has {needs} (TensorBoardLogger); with {names} "
        f"only {still} are logged."
    )
