"""Where the gradients sit on the exponent axis, and how much of them FP16 would lose.

The picture that decides whether FP16 training works is the distribution of log2|g|: FP16 represents magnitudes
from 2^-24 (smallest subnormal; 2^-14 is the smallest normal, below it precision thins out bit by bit) up to
65504 (just under 2^16). The loss scale shifts the whole distribution right by log2(scale) octaves. This monitor
logs that distribution as a TensorBoard histogram with one bucket per octave, plus the fractions of gradient
elements that would fall off either end of FP16 at the current scale.

Cost, on a sampled step only (nothing at all on the others): the counting of :mod:`lightning_mp.doctor.log2_histogram`
(a few elementwise ops over the gradients in bounded chunks, queued on their device), read back to the host in
one transfer at the end of the training step: one host sync per logged step.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

# the numerics live in log2_histogram; the public names (and measure_on_device, which tests patch here) stay
# importable from this module
from lightning_mp.doctor.log2_histogram import (
    LOG2_HIGH,
    LOG2_LOW,
    NUM_BUCKETS,
    REFERENCE_FORMAT,
    GradientRange,
    measure_on_device,
    Pending,
    unpack,
    gradient_range,
    histogram_kwargs,
    reference_scale,
)
from lightning_mp.monitors.base import _logger_step, _PrecisionMonitor, histogram_writers, no_histogram_message
from lightning_mp.numerics.sharding import local
from lightning_mp.validation import check_bool, check_int

TAG_HISTOGRAM = "precision/grad_log2_magnitude"


class GradientRangeMonitor(_PrecisionMonitor):
    """Histogram of log2|gradient| and the fractions FP16 would flush to zero or overflow, every few steps.

    Measured in ``on_before_optimizer_step``, where the plugin has unscaled the gradients (true FP32 values the
    optimizer reads), and logged at the end of the training step at Lightning's logger step, so one point per
    training step even when several optimizers step in it (each optimizer's own parameters are measured; an
    optimizer that steps twice in one training step counts once, its last step).

    ===================================================  ===============================================================
    Key                                                  Logged value
    ===================================================  ===============================================================
    ``precision/grad_log2_magnitude``                    histogram of log2|g| over all nonzero finite gradient elements,
                                                         one bucket per octave with integer edges (``[k, k+1)`` holds
                                                         2^k <= |g| < 2^(k+1)); TensorBoard loggers only
    ``precision/grad_log2_magnitude/<parameter name>``   the same per parameter, with ``per_param=True``
    ``precision/grad_underflow_fraction``                fraction of all gradient elements with ``g != 0`` and
                                                         ``|g| * scale`` below FP16's smallest subnormal (2^-24)
    ``precision/grad_overflow_fraction``                 fraction with ``|g| * scale`` above FP16's max (65504), inf or
                                                         NaN (an overflow step shows up here, not in the histogram)
    ``precision/grad_zero_fraction``                     fraction of elements exactly zero
    ===================================================  ===============================================================

    ``scale`` is the loss scale the step used in an FP16 run. In a **bf16 or fp32 run the fractions are still
    measured against FP16, at FP16's starting scale 2^16** (:data:`lightning_mp.numerics.loss_scaler.DEFAULT_INIT_SCALE`):
    they answer "would FP16 with the default loss scale lose these gradients?". In an FP16 run the gradients have
    already been through FP16, so those that underflowed are already zero (``grad_zero_fraction``) and the
    underflow fraction only counts gradients of parameters kept in FP32; there the fractions are most useful
    read against a bf16/fp32 run of the same model.

    Args:
        every_n_steps: measure every this many optimizer steps (at logger steps ``n-1, 2n-1, ...``, Lightning's
            ``log_every_n_steps`` convention). Steps in between cost nothing.
        per_param: also log one histogram per parameter (one more small kernel per parameter, and one more
            histogram per parameter in the event file).

    Raises:
        MisconfigurationException: at ``fit`` when the Trainer has no logger, or its precision plugin is not
            :class:`lightning_mp.MixedPrecisionPlugin`.

    With loggers that cannot take histograms (no ``experiment.add_histogram_raw``, e.g. CSV), the fractions are still
    logged and a warning says so once. Only global rank 0 measures: after DDP's all-reduce every rank holds the same
    gradients.
    """

    def __init__(self, every_n_steps: int = 50, per_param: bool = False) -> None:
        check_int("every_n_steps", every_n_steps, 1, why="measure every that many optimizer steps")
        check_bool("per_param", per_param)
        self.every_n_steps = every_n_steps
        self.per_param = per_param
        super().__init__()
        self._pending: dict[int, Pending] = {}
        self._pending_step: int | None = None
        self._warned = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._pending.clear()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        plugin = self._plugin
        # FSDP2: every rank holds a shard, so every rank counts its own and the counts are summed
        if plugin is None or not (trainer.is_global_zero or plugin.sharded):
            return
        step = _logger_step(trainer)
        if (step + 1) % self.every_n_steps:
            return
        # only this optimizer's parameters: with several optimizers, the others' gradients may still be scaled
        pending = queue_gradient_range(plugin, optimizer, self.per_param)
        if pending is not None:
            self._pending_step = step
            self._pending[id(optimizer)] = pending

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        plugin = self._plugin
        if plugin is None or plugin.training_steps == self._seen_steps:
            self._pending.clear()  # no optimizer step happened (training_step returned None): nothing to report
            return
        self._seen_steps = plugin.training_steps
        if not self._pending:
            return
        pending, self._pending = list(self._pending.values()), {}
        device = pending[0].packed.device
        values = torch.cat([p.packed.to(device) for p in pending]).tolist()  # the one host sync of a logged step
        ranges, offset = [], 0
        for p in pending:
            rows = len(p.names) if self.per_param else 1
            size = 3 + rows * NUM_BUCKETS
            ranges.append(unpack(values[offset : offset + size], p.numel, rows))
            offset += size
        self._log(trainer, self._pending_step, pending, ranges)

    def _log(self, trainer: pl.Trainer, step: int, pending: list[Pending], ranges: list[GradientRange]) -> None:
        metrics, histograms = range_logs(pending, ranges, self.per_param)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

        writers = histogram_writers(trainer.loggers)
        if not writers:
            if not self._warned:
                self._warned = True
                rank_zero_warn(no_histogram_message(type(self).__name__, f"the `{TAG_HISTOGRAM}` histograms",
                                                    "`add_histogram_raw`", "the fraction scalars", trainer.loggers))
            return
        for writer in writers:
            for tag, counts in histograms.items():
                writer.add_histogram_raw(tag, global_step=step, **histogram_kwargs(counts))


def queue_gradient_range(plugin: Any, optimizer: Optimizer, per_param: bool) -> Pending | None:
    """Count this optimizer's true FP32 gradients on their device, to read back after the step (``None``: it has
    none). Sharded (FSDP2): each rank counts its shards and the counts are summed over the ranks (one all-reduce), so
    every rank must call it. Both front ends' monitors measure through here."""
    named = list(plugin.named_grads(optimizer))
    if not named:
        return None
    packed = measure_on_device([local(g) for _, g in named], reference_scale(plugin), per_param)
    if plugin.sharded:
        torch.distributed.all_reduce(packed)  # counts of the whole model, not of this rank's shard
    # a DTensor's numel is the full parameter's
    return Pending(names=[n for n, _ in named], numel=sum(g.numel() for _, g in named), packed=packed)


def range_logs(pending: list[Pending], ranges: list[GradientRange],
               per_param: bool) -> tuple[dict[str, float], dict[str, list[int]]]:
    """The fraction scalars and the histograms (tag -> bucket counts) of one step's measurements (one per optimizer
    that stepped), summed over them."""
    numel = max(sum(r.numel for r in ranges), 1)  # no elements: fractions of 0
    metrics = {
        "precision/grad_underflow_fraction": sum(r.underflow for r in ranges) / numel,
        "precision/grad_overflow_fraction": sum(r.overflow for r in ranges) / numel,
        "precision/grad_zero_fraction": sum(r.zeros for r in ranges) / numel,
    }
    histograms = {TAG_HISTOGRAM: [sum(col) for col in zip(*(r.histogram for r in ranges))]}
    if per_param:
        for p, r in zip(pending, ranges):
            for name, row in zip(p.names, r.counts):
                tag = f"{TAG_HISTOGRAM}/{name}"
                previous = histograms.get(tag)
                histograms[tag] = row if previous is None else [a + b for a, b in zip(previous, row)]
    return metrics, histograms


__all__ = [
    "GradientRangeMonitor",
    # from log2_histogram
    "LOG2_HIGH",
    "LOG2_LOW",
    "NUM_BUCKETS",
    "REFERENCE_FORMAT",
    "GradientRange",
    "gradient_range",
    "histogram_kwargs",
    "reference_scale",
]
