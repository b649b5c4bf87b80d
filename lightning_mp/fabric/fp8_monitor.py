"""The FP8 statistics (``fp8/<module>/<tensor>/<stat>``) from a Fabric loop, as
:class:`lightning_mp.Fp8StatisticsMonitor` logs them from a Trainer; the measuring is
:class:`lightning_mp.fp8.probe.Fp8Probe`. One host sync per sampled step, none on the others."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_mp.fabric.plugin import MixedPrecisionPlugin
from lightning_mp.fp8.probe import Fp8Probe, flat
from lightning_mp.fp8.recipes import DIM_MULTIPLE, check_fp8_recipe
from lightning_mp.validation import check_int


class Fp8StatisticsMonitor:
    """Logs, every ``every_n_steps`` optimizer steps, what FP8 does to each Linear's input, weight and output
    gradient: the tags and their meaning are :class:`lightning_mp.Fp8StatisticsMonitor`'s. In an ``"fp8"`` run it
    measures the Linears computing in FP8 under the run's recipe; otherwise (a what-if) every Linear of ``model``
    FP8 could take, under ``recipe`` (default ``"rowwise"``)::

        fabric = Fabric(plugins=[MixedPrecisionPlugin("bf16")], loggers=TensorBoardLogger("logs"))
        model, optimizer = fabric.setup(model, optimizer)
        Fp8StatisticsMonitor(fabric, model, every_n_steps=50)

    The x-axis is the optimizer step, as :class:`lightning_mp.fabric.PrecisionMonitor`'s. In an fp8 run the FP8
    Linears are known from the first forward on, so with ``every_n_steps=1`` step 0 measures every Linear FP8 could
    take and logs those that computed in FP8.
    """

    def __init__(self, fabric: Any, model: nn.Module, every_n_steps: int = 50, recipe: str | None = None) -> None:
        check_int("every_n_steps", every_n_steps, 1, why="measure every that many optimizer steps")
        plugin = getattr(getattr(fabric, "strategy", None), "precision", None)
        if not isinstance(plugin, MixedPrecisionPlugin):
            raise ValueError(
                f"fabric={fabric!r}: Fp8StatisticsMonitor is told of each optimizer step by "
                f"lightning_mp.fabric.MixedPrecisionPlugin, and this Fabric's precision plugin is "
                f"{type(plugin).__name__}. HINT: `Fabric(plugins=[lightning_mp.fabric.MixedPrecisionPlugin('bf16')])`."
            )
        if not fabric.loggers:
            raise ValueError(f"fabric={fabric!r} has no logger, so Fp8StatisticsMonitor has nowhere to log. HINT: "
                             "`Fabric(..., loggers=lightning.fabric.loggers.TensorBoardLogger(root_dir))`.")
        fp8 = plugin.core.fp8
        if recipe is not None:
            check_fp8_recipe(recipe)
            if fp8.enabled and recipe != fp8.settings.recipe:
                raise ValueError(f"recipe={recipe!r}: this run computes FP8 with {fp8.settings.recipe!r}. HINT: "
                                 "recipe=None measures the run's own; a what-if needs a bf16 or fp32 run.")
        self.every_n_steps = every_n_steps
        self.recipe = fp8.settings.recipe if fp8.enabled else (recipe or "rowwise")
        self._fabric, self._plugin = fabric, plugin
        multiple = DIM_MULTIPLE.get(self.recipe, 16)
        model = getattr(model, "_original_module", model)  # Fabric's wrapper: names as the plugin's
        eligible = [(n, m) for n, m in model.named_modules()
                    if isinstance(m, nn.Linear) and not (m.in_features % multiple or m.out_features % multiple)]
        dtype = torch.bfloat16 if plugin.dtype == torch.bfloat16 else None
        self._probe = Fp8Probe(eligible, self.recipe, dtype)
        self._step: int | None = None
        plugin._listeners.append(self)
        self._arm(plugin.training_steps)

    def remove(self) -> None:
        """Stop measuring."""
        self._probe.disarm()
        if self in self._plugin._listeners:
            self._plugin._listeners.remove(self)

    def _arm(self, step: int) -> None:
        fp8 = self._plugin.core.fp8
        if fp8.emulated is not None:  # set up: the Linears computing in FP8 are known
            self._probe.linears = list(fp8.chosen)
        if (step + 1) % self.every_n_steps == 0 and self._probe.linears:
            self._step = step
            self._probe.arm()

    # ------------------------------------------------------------------ called by the plugin
    def before_optimizer_step(self, optimizer: Optimizer) -> None:
        if not self._probe.armed:
            return
        stats = self._probe.collect()  # one host read for the step's statistics
        fp8 = self._plugin.core.fp8
        if fp8.enabled:
            names = {n for n, _ in fp8.chosen}
            stats = {n: s for n, s in stats.items() if n in names}
        if stats and self._fabric.is_global_zero:
            self._fabric.log_dict(flat(stats), step=self._step)

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        self._arm(self._plugin.training_steps)


__all__ = ["Fp8StatisticsMonitor"]
