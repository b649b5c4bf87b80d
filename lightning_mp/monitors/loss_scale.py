"""Log the loss scale and the running count of skipped steps to every logger, one point per optimizer step.

Everything logged here is a Python number the plugin holds on the host (the scale and the skip counter live there,
see :mod:`lightning_mp.numerics.loss_scaler`), so this callback adds no device work. With a fused optimizer the
step's flag stays on the device and the host holds those numbers one step late: at a logging step the callback reads
the flag's copy (:mod:`lightning_mp.numerics.deferred`), and on the other steps nothing.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

# the shared base lives in monitor_base; these names stay importable from here
from lightning_mp.monitors.base import (  # noqa: F401
    _logger_step,
    _PrecisionMonitor,
    format_metrics,
    fp8_decision_metrics,
    plugin_metrics,
)
from lightning_mp.validation import check_int


class LossScaleMonitor(_PrecisionMonitor):
    """Logs the loss scale each training step used and how many steps were skipped so far.

    One point per training step that ran an optimizer step: under gradient accumulation only the micro-batch
    that steps logs, and with manual optimization several optimizers stepping in one ``training_step`` still
    make one point (the plugin moves its scale once per training step). Points are logged at Lightning's logger
    step (the x-axis ``self.log`` uses), so they line up with the loss curve.

    ================================  =====================================================================
    Key                               Logged value
    ================================  =====================================================================
    ``precision/loss_scale``          the scale the step's backward used (float; ``1.0`` when scaling is off).
                                      A step that overflows shows the scale that overflowed; the backed-off
                                      scale appears on the next step.
    ``precision/skipped_steps``       optimizer steps skipped so far because their gradients held inf/NaN
                                      (running total; it counts up on the skipped step itself)
    ``precision/auto_fp32_modules``   with ``fp32_modules="auto"``: module instances moved to FP32 so far
    ``precision/auto_fp32_decisions`` text (loggers with ``add_text``: TensorBoard), one entry per decision:
                                      the module, the step and the evidence, at the first point after it
    ``precision/auto_fp8_modules``    with ``fp8_modules="auto"``, after calibration: Linears kept in bf16
    ``precision/auto_fp8_decisions``  text (TensorBoard), one entry per Linear kept in bf16, with its evidence
    ``precision/format``              the step's format as the significand bits it multiplies in: 24 fp32,
                                      11 fp16, 8 bf16, 4 fp8 (e4m3); it moves where a ``schedule`` switches
    ``precision/schedule``            text (TensorBoard), one entry per switch of the precision schedule: the
                                      step, the new setting, and whether the loss scale retired
    ``precision/parity_drift``        with ``master_weights="compensated"`` and ``parity_guard``: relative drift
                                      of the lean parameters from their FP32 shadows after the step
    ``precision/parity_lost_fraction`` the fraction of the shadows' updates the lean values lost
    ================================  =====================================================================

    Args:
        logging_interval: log every this many steps (at steps ``n-1, 2n-1, ...``, Lightning's convention).
            ``None`` (default) follows the Trainer's ``log_every_n_steps``, so ``log_every_n_steps=0`` turns it
            off as it does ``self.log``.

    Raises:
        MisconfigurationException: at ``fit`` when the Trainer has no logger, or its precision plugin is not
            :class:`lightning_mp.MixedPrecisionPlugin`.

    Example::

        Trainer(
            plugins=[MixedPrecisionPlugin("fp16")], callbacks=[LossScaleMonitor()], logger=TensorBoardLogger("logs")
        )
    """

    def __init__(self, logging_interval: int | None = None) -> None:
        check_int(
            "logging_interval", logging_interval, 1, why="log every that many optimizer steps",
            allow_none="follow the Trainer's log_every_n_steps",
        )
        super().__init__()
        self.logging_interval = logging_interval
        self._seen_rung = (0, False)  # the precision schedule's rung at the last point, and whether it scaled

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self._plugin is not None:  # a resumed run starts in its checkpoint's rung: no switch to report
            self._seen_rung = (self._plugin.ladder.current, self._plugin.scaler is not None)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        plugin = self._plugin
        if plugin is None or plugin.optimizer_steps == self._seen_steps:
            return  # no optimizer step in this batch (an accumulating micro-batch, or a skipped training_step)
        self._seen_steps = plugin.optimizer_steps
        step = _logger_step(trainer)
        interval = self.logging_interval if self.logging_interval is not None else trainer.log_every_n_steps
        if not interval or (step + 1) % interval:
            return
        metrics = {
            "precision/loss_scale": float(plugin.last_step_scale),
            "precision/skipped_steps": float(plugin.skipped_steps),
        }
        auto, self._logged_decisions = plugin_metrics(plugin, trainer.loggers, self._logged_decisions, step)
        metrics.update(auto)
        fmt, self._seen_rung = format_metrics(plugin, trainer.loggers, self._seen_rung, step)
        metrics.update(fmt)
        fp8, self._logged_fp8_decisions = fp8_decision_metrics(plugin, trainer.loggers, self._logged_fp8_decisions, step)
        metrics.update(fp8)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


__all__ = ["LossScaleMonitor"]
