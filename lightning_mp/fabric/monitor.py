"""The Trainer monitors' ``precision/...`` tags from a Fabric loop, logged at every ``optimizer.step()``.

The loss scale and the skip count are Python numbers the plugin holds on the host: logging them costs no device
work and no sync. The gradient range is counted by :mod:`lightning_mp.doctor.log2_histogram` (as in the Trainer's monitor) on
the sampled steps only, queued on the device before the step and read back after it (one host sync per sampled step).
"""

from __future__ import annotations

import warnings
from typing import Any

from torch.optim import Optimizer

from lightning_mp.fabric.plugin import MixedPrecisionPlugin
from lightning_mp.monitors.gradient_range import TAG_HISTOGRAM, queue_gradient_range, range_logs
from lightning_mp.doctor.log2_histogram import Pending, unpack, histogram_kwargs
from lightning_mp.validation import check_bool, check_int
from lightning_mp.monitors.base import format_metrics, fp8_decision_metrics, plugin_metrics, histogram_writers, no_histogram_message


class PrecisionMonitor:
    """Logs the loss scale, the skipped steps and the gradient range of a Fabric run to Fabric's loggers.

    Create it once the ``Fabric`` exists; from then on every ``optimizer.step()`` logs, with no call in the loop::

        fabric = Fabric(plugins=[MixedPrecisionPlugin("fp16")], loggers=TensorBoardLogger("logs"))
        PrecisionMonitor(fabric, grad_range_every_n_steps=50)

    The tags are those of :class:`lightning_mp.LossScaleMonitor` and :class:`lightning_mp.GradientRangeMonitor`,
    so a Fabric run's TensorBoard pages look like a Trainer run's. The x-axis is the optimizer step (0, 1, ...,
    skipped steps included: ``plugin.training_steps - 1`` after the step); log the loss at the same step to line
    the curves up.

    ===================================================  ===============================================================
    Key                                                  Logged value
    ===================================================  ===============================================================
    ``precision/loss_scale``                             the scale the step's backward used (``1.0`` when scaling is
                                                         off); an overflowing step shows the scale that overflowed
    ``precision/skipped_steps``                          optimizer steps skipped so far (running total, counting the
                                                         skipped step itself)
    ``precision/auto_fp32_modules``                      with ``fp32_modules="auto"``: modules moved to FP32 so far
    ``precision/auto_fp32_decisions``                    text (TensorBoard), one entry per decision with its evidence
    ``precision/auto_fp8_modules``                       with ``fp8_modules="auto"``: Linears kept in bf16
    ``precision/auto_fp8_decisions``                     text (TensorBoard), one entry per Linear kept in bf16
    ``precision/format``, ``precision/schedule``         the step's format in significand bits (24 fp32, 11 fp16, 8
                                                         bf16, 4 fp8) and one text entry per ``schedule`` switch
    ``precision/parity_drift``, ``.../parity_lost_fraction``  lean bf16's parity guard (see ``LossScaleMonitor``)
    ``precision/grad_log2_magnitude``                    histogram of log2|g| of the step's true FP32 gradients, one
                                                         bucket per octave; loggers with ``add_histogram_raw``
                                                         (TensorBoard) only
    ``precision/grad_log2_magnitude/<parameter name>``   the same per parameter, with ``per_param=True``
    ``precision/grad_underflow_fraction``                fraction of gradient elements with ``g != 0`` and
                                                         ``|g| * scale`` below FP16's smallest subnormal
    ``precision/grad_overflow_fraction``                 fraction with ``|g| * scale`` above FP16's max, inf or NaN
    ``precision/grad_zero_fraction``                     fraction of elements exactly zero
    ===================================================  ===============================================================

    The gradient fractions are measured against FP16 as in :class:`lightning_mp.GradientRangeMonitor` (in a bf16 or
    fp32 run at FP16's starting scale 2^16), over the parameters of the optimizer that steps, before a skipped step
    drops its gradients.

    Args:
        fabric: a ``Fabric`` whose precision plugin is :class:`lightning_mp.fabric.MixedPrecisionPlugin` and which
            has at least one logger.
        log_every_n_steps: log the scale and skip count every this many optimizer steps (at steps ``n-1, 2n-1,
            ...``, Lightning's convention).
        grad_range_every_n_steps: measure the gradient range every this many optimizer steps; ``None`` never.
        per_param: also log one histogram per parameter.
    """

    def __init__(
        self,
        fabric: Any,
        log_every_n_steps: int = 1,
        grad_range_every_n_steps: int | None = 50,
        per_param: bool = False,
    ) -> None:
        check_int("log_every_n_steps", log_every_n_steps, low=1)
        check_int("grad_range_every_n_steps", grad_range_every_n_steps, low=1, allow_none="never")
        check_bool("per_param", per_param)
        plugin = getattr(getattr(fabric, "strategy", None), "precision", None)
        if not isinstance(plugin, MixedPrecisionPlugin):
            raise ValueError(
                f"fabric={fabric!r}: PrecisionMonitor reads the loss scaler of "
                "lightning_mp.fabric.MixedPrecisionPlugin, "
                f"but this Fabric's precision plugin is {type(plugin).__name__}. HINT: "
                "`Fabric(plugins=[lightning_mp.fabric.MixedPrecisionPlugin('fp16')])` (instead of `precision=`)."
            )
        if not fabric.loggers:
            raise ValueError(
                f"fabric={fabric!r} has no logger, so PrecisionMonitor has nowhere to log. "
                "HINT: `Fabric(..., loggers=lightning.fabric.loggers.TensorBoardLogger(root_dir))`."
            )
        self.log_every_n_steps = log_every_n_steps
        self.grad_range_every_n_steps = grad_range_every_n_steps
        self.per_param = per_param
        self._fabric = fabric
        self._plugin = plugin
        self._pending: Pending | None = None
        self._warned = False
        self._logged_decisions = 0
        self._logged_fp8_decisions = 0
        self._seen_rung = (plugin.ladder.current, plugin.scaler is not None)  # the precision schedule's, last point
        plugin._listeners.append(self)

    def remove(self) -> None:
        """Stop logging."""
        if self in self._plugin._listeners:
            self._plugin._listeners.remove(self)

    # ------------------------------------------------------------------ called by the plugin
    def before_optimizer_step(self, optimizer: Optimizer) -> None:
        """Queue the gradient measurement; the gradients are unscaled and the step not yet taken or skipped."""
        every, step, sharded = self.grad_range_every_n_steps, self._plugin.training_steps, self._plugin.sharded
        # FSDP2: every rank holds a shard, so every rank counts its own and the counts are summed (an op on the
        # DTensors themselves would run collectives on rank 0 alone)
        if every is None or (step + 1) % every or not (self._fabric.is_global_zero or sharded):
            return
        pending = queue_gradient_range(self._plugin, optimizer, self.per_param)
        if self._fabric.is_global_zero:
            self._pending = pending

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        plugin = self._plugin
        step = plugin.training_steps - 1  # the step that just ended
        metrics: dict[str, float] = {}
        if (step + 1) % self.log_every_n_steps == 0:
            metrics["precision/loss_scale"] = float(plugin.last_step_scale)
            metrics["precision/skipped_steps"] = float(plugin.skipped_steps)
            auto, self._logged_decisions = plugin_metrics(plugin, self._fabric.loggers, self._logged_decisions, step)
            metrics.update(auto)
            fp8, self._logged_fp8_decisions = fp8_decision_metrics(plugin, self._fabric.loggers,
                                                                   self._logged_fp8_decisions, step)
            metrics.update(fp8)
            fmt, self._seen_rung = format_metrics(plugin, self._fabric.loggers, self._seen_rung, step)
            metrics.update(fmt)
        pending, self._pending = self._pending, None
        histograms: dict[str, list[int]] = {}
        if pending is not None:
            rows = len(pending.names) if self.per_param else 1
            r = unpack(pending.packed.tolist(), pending.numel, rows)  # the one host sync of a sampled step
            fractions, histograms = range_logs([pending], [r], self.per_param)
            metrics.update(fractions)
        if metrics:
            self._fabric.log_dict(metrics, step=step)
        if histograms:
            self._log_histograms(histograms, step)

    def _log_histograms(self, histograms: dict[str, list[int]], step: int) -> None:
        writers = histogram_writers(self._fabric.loggers)
        if not writers and not self._warned:
            self._warned = True
            message = no_histogram_message("PrecisionMonitor", f"the `{TAG_HISTOGRAM}` histograms",
                                           "`add_histogram_raw`", "the fraction scalars", self._fabric.loggers)
            warnings.warn(message, stacklevel=3)
        for writer in writers:
            for tag, counts in histograms.items():
                writer.add_histogram_raw(tag, global_step=step, **histogram_kwargs(counts))


__all__ = ["PrecisionMonitor"]
