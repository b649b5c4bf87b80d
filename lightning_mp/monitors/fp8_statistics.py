"""What FP8 does to each Linear's operands, per GEMM, in an fp8 run or (what-if) in a bf16 or fp32 run.

The measuring is :mod:`lightning_mp.fp8.statistics` (the numbers) and :class:`lightning_mp.fp8.probe.Fp8Probe` (the
hooks); this module is the Lightning callback around them. Cost: nothing on steps that are not sampled (no hooks).
On a sampled step, each measured Linear's input, weight and output gradient go through the recipe's cast once more
in FP32 (an amax, a scale, a rounding and three sums per tensor), queued on the device and read back in one
transfer before the optimizer step (one host sync per sampled step). docs/fp8.md states what it measured here.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.fp8.probe import Fp8Probe, flat
from lightning_mp.fp8.recipes import DIM_MULTIPLE, check_fp8_recipe
from lightning_mp.monitors.base import _logger_step, _PrecisionMonitor
from lightning_mp.validation import check_int


class Fp8StatisticsMonitor(_PrecisionMonitor):
    """Per FP8 Linear and per operand: amax, scale, the fractions FP8 flushes to zero and saturates, and the SQNR.

    In an ``"fp8"`` run of :class:`lightning_mp.MixedPrecisionPlugin` it measures the Linears that compute in FP8,
    under the run's recipe. In any other run (bf16, fp32, Lightning's own precisions) it is a **what-if**: it measures
    every ``nn.Linear`` FP8 could take (both dimensions multiples of 16, 32 for ``mxfp8``) under ``recipe``, so one
    bf16 run shows which layers FP8 would hurt before switching. Each tensor is measured as torchao casts it for the
    GEMM it feeds first (input and weight: the output GEMM; output gradient: the input-gradient GEMM), with the
    recipe's format and scaling (``docs/fp8.md``).

    ==============================================  =================================================================
    Key                                             Logged value
    ==============================================  =================================================================
    ``fp8/<module>/<tensor>/amax``                  the largest \\|x\\| (``<tensor>``: ``input``, ``weight``,
                                                    ``grad_output``; ``<module>``: the Linear's qualified name)
    ``fp8/<module>/<tensor>/scale``                 the smallest scale (that of the row or block holding amax;
                                                    tensorwise: the one scale): ``fp8 max / amax``, a power of two
                                                    for rowwise and mxfp8
    ``fp8/<module>/<tensor>/flushed_fraction``      of the non-zero values, the fraction FP8 rounds to zero
    ``fp8/<module>/<tensor>/saturated_fraction``    of the non-zero values, the fraction with \\|x * scale\\| beyond
                                                    the format's max (0 with torchao's dynamic scales)
    ``fp8/<module>/<tensor>/sqnr_db``               10 log10(sum x^2 / sum (x - fp8(x))^2); about 31 dB for a
                                                    well-scaled tensor in e4m3, 25 dB in e5m2
    ==============================================  =================================================================

    With ``fp8_modules="auto"`` the autopilot's decisions are logged as ``precision/auto_fp8_decisions`` (text) and
    ``precision/auto_fp8_modules`` (the count kept in bf16) by :class:`lightning_mp.LossScaleMonitor`.

    Args:
        every_n_steps: measure every this many optimizer steps (logger steps ``n-1, 2n-1, ...``), on the first
            micro-batch of that step. Steps in between cost nothing.
        recipe: the recipe a what-if measures (default ``"rowwise"``, the plugin's default); in an fp8 run it must
            be ``None`` or the run's own.

    Raises:
        MisconfigurationException: at ``fit`` when the Trainer has no logger.
        ValueError: for a ``recipe`` that is not one, or not the fp8 run's.
    """

    _requires_plugin = False

    def __init__(self, every_n_steps: int = 50, recipe: str | None = None) -> None:
        check_int("every_n_steps", every_n_steps, 1, why="measure every that many optimizer steps")
        if recipe is not None:
            check_fp8_recipe(recipe)
        super().__init__()
        self.every_n_steps = every_n_steps
        self.recipe = recipe
        self._probe: Fp8Probe | None = None
        self._step: int | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._probe = self._build(trainer, pl_module) if trainer.is_global_zero else None

    def _build(self, trainer: pl.Trainer, model: nn.Module) -> Fp8Probe | None:
        fp8 = self._plugin.core.fp8 if self._plugin is not None else None
        if fp8 is not None and fp8.enabled:
            if self.recipe not in (None, fp8.settings.recipe):
                raise ValueError(f"recipe={self.recipe!r}: this run computes FP8 with {fp8.settings.recipe!r}; "
                                 "HINT: recipe=None measures the run's own, a what-if needs a bf16 or fp32 run.")
            linears, recipe, dtype = fp8.chosen, fp8.settings.recipe, self._plugin.dtype
        else:
            recipe = self.recipe or "rowwise"
            multiple = DIM_MULTIPLE.get(recipe, 16)
            linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)
                       and not m.in_features % multiple and not m.out_features % multiple]
            # the operands an FP8 run would cast: bf16 ones (an fp32 run's what-if: its FP32 ones)
            bf16 = self._plugin.dtype == torch.bfloat16 if self._plugin is not None else "bf16" in str(trainer.precision)
            dtype = torch.bfloat16 if bf16 else None
        if not linears:
            rank_zero_warn(f"`{type(self).__name__}` found no Linear to measure (FP8 takes dimensions that are "
                           "multiples of 16, 32 for mxfp8).")
            return None
        return Fp8Probe(linears, recipe, dtype)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        probe = self._probe
        if probe is None or probe.armed:
            return
        if self._plugin is not None and self._plugin.core.fp8.enabled:
            probe.linears = list(self._plugin.core.fp8.chosen)  # fp8_modules='auto' puts Linears in FP8 later
        step = _logger_step(trainer)
        if (step + 1) % self.every_n_steps == 0 and step != self._step and probe.linears:
            self._step = step
            probe.arm()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Optimizer) -> None:
        if self._probe is None or not self._probe.armed:
            return
        metrics = flat(self._probe.collect())  # one host read for every statistic of the step
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=self._step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._probe is not None:
            self._probe.disarm()


__all__ = ["Fp8StatisticsMonitor"]
