"""Where the activations sit against FP16's range, and which modules would overflow it, in any run.

The gradient monitor covers the backward. This one covers the forward: on a sampled step it hooks every module's
output and counts log2|x| per octave (the same exact ``frexp`` buckets as ``precision/grad_log2_magnitude``), the
fraction of elements FP16 could not hold, and each module's largest magnitude. It needs no plugin, so one FP32 (or
bf16) run answers "would FP16 overflow in the forward, and where?" before any FP16 run is tried.

Cost: nothing on steps that are not sampled (no hooks are installed). On a sampled step, a few elementwise passes
over each distinct output tensor (a container that returns its last child's tensor is counted once), queued on the
device; everything comes back in one transfer at the end of that training step (one host sync per sampled step).
The measuring itself is :mod:`lightning_mp.doctor.activation_ranges`; this module is the Lightning callback around it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.doctor import ranges_plot
from lightning_mp.doctor.activation_ranges import ActivationRecorder, overflow_starts, Sample
from lightning_mp.doctor.log2_histogram import REFERENCE_FORMAT, histogram_kwargs, reference_scale
from lightning_mp.numerics.loss_scaler import DEFAULT_INIT_SCALE
from lightning_mp.monitors.base import _logger_step, _PrecisionMonitor, histogram_writers, no_histogram_message
from lightning_mp.validation import check_bool, check_int

TAG_HISTOGRAM = "precision/activation_log2_magnitude"
_TAG_OVERFLOW = "precision/activation_overflow_fraction"
_TAG_UNDERFLOW = "precision/activation_underflow_fraction"
_TAG_AMAX = "precision/activation_amax"
_TAG_IMAGE = "precision/ranges_vs_formats"


class ActivationRangeMonitor(_PrecisionMonitor):
    """Histogram of log2|activation|, the fractions FP16 could not hold, and the modules that would overflow it.

    Works in any run: with :class:`lightning_mp.MixedPrecisionPlugin` in any format, with Lightning's own precision
    settings, or in plain FP32 (where it tells whether FP16 *would* overflow in the forward). Activations are the
    floating tensors each module's ``forward`` returns (a tensor, or one level of tuple / list / dict), in the
    training forward of a sampled step.

    ==============================================  =================================================================
    Key                                             Logged value
    ==============================================  =================================================================
    ``precision/activation_log2_magnitude``         histogram of log2|x| over the nonzero finite elements of every
                                                    module output, one bucket per octave (``[k, k+1)`` holds
                                                    2^k <= |x| < 2^(k+1)); TensorBoard loggers only
    ``precision/activation_overflow_fraction``      fraction of output elements with |x| > 65504 (FP16's largest),
                                                    inf or NaN
    ``precision/activation_underflow_fraction``     fraction with 0 < |x| < 2^-24 (below FP16's smallest subnormal:
                                                    flushed to zero in FP16)
    ``precision/activation_amax/<module name>``     the module's largest |output| (``per_module=True``; the model
                                                    itself is ``<model>``)
    ``precision/ranges_vs_formats``                 an image (``log_image=True``, TensorBoard loggers, needs
                                                    matplotlib): the activation and gradient histograms on the log2
                                                    axis over the ranges of fp16, bf16, fp8 e4m3 and fp8 e5m2
                                                    (normal and subnormal parts), with the gradients also drawn
                                                    shifted by the loss scale
    ==============================================  =================================================================

    An output counts once however many modules return it (a ``Sequential`` returns its last child's tensor). The
    loss scale in the picture is the one the step used in an FP16 run of the plugin (or of Lightning's
    ``16-mixed``), and FP16's starting scale 2^16 otherwise ("where FP16 would put them").

    :attr:`fp16_overflow_modules` names the modules whose output went above 65504 **while their inputs were
    within FP16's range** (where an overflow starts, not every module downstream that inherits it), first
    offender first, over all sampled steps so far. The first time there is one, a warning names them with the
    remedy: keep those classes in FP32 (``fp32_modules``) or train in bf16.

    Args:
        every_n_steps: measure every this many optimizer steps (logger steps ``n-1, 2n-1, ...``), on the first
            micro-batch of that step. Steps in between cost nothing.
        per_module: also log ``precision/activation_amax/<module name>`` for every module.
        log_image: also log the ``precision/ranges_vs_formats`` picture on sampled steps (measures the step's
            gradients for it too).

    Raises:
        MisconfigurationException: at ``fit`` when the Trainer has no logger.
    """

    _requires_plugin = False

    def __init__(self, every_n_steps: int = 50, per_module: bool = False, log_image: bool = True) -> None:
        check_int("every_n_steps", every_n_steps, 1, why="measure every that many optimizer steps")
        check_bool("per_module", per_module)
        check_bool("log_image", log_image)
        super().__init__()
        self.every_n_steps = every_n_steps
        self.per_module = per_module
        self.log_image = log_image
        self._offenders: list[str] = []
        self._recorder: ActivationRecorder | None = None  # hooks on the model, on a sampled step's first micro-batch
        self._sample: Sample | None = None
        self._last_sampled: int | None = None
        self._warned_offenders = False
        self._warned_histogram = False
        self._warned_image = False

    @property
    def fp16_overflow_modules(self) -> list[str]:
        """Modules whose output exceeded FP16's largest value (65504) on a sampled step while their inputs did not,
        first offender first (a copy)."""
        return list(self._offenders)

    # ------------------------------------------------------------------ hooks of the Trainer
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._sample, self._last_sampled = None, None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = _logger_step(trainer)
        if self._sample is not None and self._sample.step != step:
            self._flush(trainer)  # a sampled step whose optimizer never stepped (training_step returned None)
        if not trainer.is_global_zero or (step + 1) % self.every_n_steps or step == self._last_sampled:
            return
        self._last_sampled = step
        self._sample = Sample(step)
        self._remove_hooks()
        self._recorder = ActivationRecorder(pl_module, self._sample)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        sample = self._sample
        if sample is None or not self.log_image:
            return
        if self._plugin is not None:
            grads = [g for _, g in self._plugin.named_grads(optimizer)]
        else:  # Lightning's own precision unscales before this hook too
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            sample.add_grads(grads)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._remove_hooks()  # only the first micro-batch of a sampled step is measured
        if self._sample is not None and (self._sample.grads is not None or not self.log_image):
            self._flush(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()
        if self._sample is not None:
            self._flush(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()
        self._sample = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None

    # ------------------------------------------------------------------ logging
    def _flush(self, trainer: pl.Trainer) -> None:
        sample, self._sample = self._sample, None
        if sample is None or sample.packed is None:
            return
        values = sample.read()  # the one host sync of a sampled step
        limit = REFERENCE_FORMAT.max
        new = [n for n in overflow_starts(values) if n not in self._offenders]
        self._offenders.extend(new)
        if self._offenders and not self._warned_offenders:
            self._warned_offenders = True
            classes = sorted({type(trainer.lightning_module.get_submodule(n)).__name__ for n in new if n != "<model>"})
            rank_zero_warn(
                f"`{type(self).__name__}`: at step {sample.step} the output of {', '.join(f'`{n}`' for n in new)} "
                f"went above FP16's largest value ({limit:g}) from inputs within its range: FP16 would overflow "
                "there in the forward pass. HINT: keep those modules in FP32 with "
                f"`MixedPrecisionPlugin('fp16', fp32_modules=DEFAULT_FP32_MODULES + ({', '.join(classes)},))`, "
                "or train in precision='bf16'."
            )

        acts, grads = values.acts, values.grads
        metrics = {_TAG_OVERFLOW: acts.overflow_fraction, _TAG_UNDERFLOW: acts.underflow_fraction}
        if self.per_module:
            metrics.update({f"{_TAG_AMAX}/{name}": value for name, value in zip(values.names, values.amax)})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=sample.step)

        writers = histogram_writers(trainer.loggers)
        if not writers:
            if not self._warned_histogram:
                self._warned_histogram = True
                what = f"the `{TAG_HISTOGRAM}` histogram and the `{_TAG_IMAGE}` image"
                rank_zero_warn(no_histogram_message(type(self).__name__, what, "`add_histogram_raw` / `add_image`",
                                                    "the scalars", trainer.loggers))
            return
        for writer in writers:
            writer.add_histogram_raw(TAG_HISTOGRAM, global_step=sample.step, **histogram_kwargs(acts.histogram))
        if self.log_image:
            self._log_image(trainer, writers, sample.step, acts.histogram, grads.histogram if grads else None)

    def _log_image(self, trainer: pl.Trainer, writers: list, step: int, acts: list[int], grads: list[int] | None):
        if not ranges_plot.plotting_available():
            if not self._warned_image:
                self._warned_image = True
                rank_zero_warn(
                    f"`{type(self).__name__}` draws `{_TAG_IMAGE}` with matplotlib, which is not installed: no image "
                    "is logged. HINT: `pip install lightning-mp[plot]` (or `pip install matplotlib`), or pass "
                    "`log_image=False` to silence this."
                )
            return
        scale, label = _picture_scale(trainer, self._plugin)
        image = ranges_plot.render_ranges_vs_formats(acts, grads, scale, step, scale_label=label)
        for writer in writers:
            if hasattr(writer, "add_image"):
                writer.add_image(_TAG_IMAGE, image, global_step=step, dataformats="HWC")


def _picture_scale(trainer: pl.Trainer, plugin: Any) -> tuple[float, str]:
    """The loss scale to draw: the step's own in an FP16 run (ours or Lightning's), FP16's starting scale else."""
    if plugin is not None:
        scale = reference_scale(plugin)
        own = plugin.format.dtype == REFERENCE_FORMAT.dtype
        return (float(plugin.last_step_scale) if own else scale), ("loss scale" if own else "FP16's starting scale")
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and hasattr(scaler, "get_scale") and scaler.is_enabled():
        return float(scaler.get_scale()), "loss scale"
    return DEFAULT_INIT_SCALE, "FP16's starting scale"


__all__ = ["ActivationRangeMonitor"]
