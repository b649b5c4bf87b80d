"""The optimizer-step half of the precision plugin: unscale and check, the hooks, skip or step, the scale update
once per training step; clipping on true gradients; optimizers that re-evaluate their closure (LBFGS).

Mixed into :class:`lightning_mp.MixedPrecisionPlugin`, whose ``__init__`` and set-up create what these hooks use:
``_step`` (:class:`lightning_mp.step.MixedPrecisionStep`), ``_locator``, ``_fold``/``_stepped`` (master
weights) and ``_lightning_module``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

log = logging.getLogger("lightning_mp.plugin")  # the name users filter on for the skip lines


class StepHooks:
    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            return self._closure_optimizer_step(optimizer, model, closure, **kwargs)
        closure_result = closure()
        self._fold()  # a bare loss.backward() that bypassed post_backward
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: Lightning's convention for "skip this batch", not an overflow
            self._after_closure(model, optimizer)
            return None
        self._step.unscale_(optimizer)
        self._after_closure(model, optimizer)  # hooks and clipping: true FP32 gradients
        output = self._step.step(optimizer, **kwargs)
        self._stepped(optimizer)
        if model.automatic_optimization:
            self._end_training_step()
        return output

    def _end_training_step(self) -> None:
        """Move the scale once; on a skipped step, say where it overflowed (the locator's one read-back)."""
        report = None
        if self._step.in_progress and self._step.skipping:
            report = self._locator.report() if self._locator is not None else None
            self._last_overflow = report or self._last_overflow
            if self._locator is not None:
                self._locator.check_forward = True  # bf16/fp32 arm their forward checks at the first skip
            if _rank_zero():
                where = f": {report}" if report is not None else ""
                log.warning(f"step {self._global_step()} skipped (loss scale {self.loss_scale:g}){where}")
        try:
            self._step.end_training_step(self._global_step())
        except FloatingPointError as err:
            if report is None:
                raise
            raise FloatingPointError(f"{err} Where it first went non-finite: {report}.") from err
        finally:
            if self._locator is not None:
                self._locator.begin_step()

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Unscale first, on every path (automatic, manual ``self.clip_gradients``, several optimizers)."""
        if clip_val <= 0:
            return
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer: the step keys the raw one
        self._fold()
        if self._step.unscale_(optimizer) or self._step.skipping:
            return  # the step is skipped: clipping inf/NaN gradients would only compute NaN norms
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def _global_step(self) -> int | None:
        trainer = getattr(self._lightning_module, "_trainer", None)
        return trainer.global_step if trainer is not None else None

    def _closure_optimizer_step(
        self, optimizer: Optimizer, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Optimizers that evaluate the closure several times per step (LBFGS): every evaluation runs on fresh
        16-bit copies of the current FP32 parameters and leaves unscaled FP32 gradients; a non-finite one stops
        the run (the step cannot be skipped halfway through a line search)."""

        def evaluate() -> Any:
            result = closure()
            self._fold()
            self._step.forget(optimizer)
            if self._step.unscale_(optimizer):
                raise FloatingPointError(
                    f"Non-finite gradients at step {self._global_step()} with loss scale {self.loss_scale:g} "
                    "inside an LBFGS step, which cannot be skipped. HINT: lower the learning rate or the static "
                    "loss_scale."
                )
            self._after_closure(model, optimizer)
            return result

        output = optimizer.step(closure=evaluate, **kwargs)
        self._stepped(optimizer)
        self._end_training_step()  # never a skip here (a non-finite evaluation raised); resets the locator
        return output


def _rank_zero() -> bool:
    return getattr(rank_zero_only, "rank", 0) == 0
