"""What the precision plugins show callbacks and users: the scale, the skips, the FP32 gradients and values,
and a Markdown summary. Read-only views, mixed into :class:`lightning_mp.MixedPrecisionPlugin` (and so into the
Fabric plugin); the state itself belongs to the plugin's pieces (``scaler``, ``_step``, ``_masters``...), which the
plugin's ``__init__`` and set-up create."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mp.overflow_report import OverflowReport
from lightning_mp.step import MixedPrecisionStep


class PluginState:
    @property
    def loss_scale(self) -> float:
        """The scale the next backward uses (1.0 when scaling is off)."""
        return self.scaler.scale

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because their gradients held inf or NaN."""
        return self.scaler.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent training step was skipped."""
        return self.scaler.last_step_skipped

    @property
    def last_step_scale(self) -> float:
        """The scale the most recent training step's backward used (before that step's update)."""
        return self.scaler.last_step_scale

    @property
    def optimizer_steps(self) -> int:
        """Training steps the scaler has seen (applied and skipped); moves once per step, several optimizers or not."""
        return self.scaler.steps

    @property
    def last_overflow(self) -> OverflowReport | None:
        """Where the most recent skipped step went non-finite (``None`` before any skip, with
        ``locate_overflows=False``, or when no watched module's output or gradient was non-finite)."""
        return self._last_overflow

    @property
    def step(self) -> MixedPrecisionStep:
        """The step object: ``plugin.step.unscale_(optimizer)`` returns the overflow flag of this training step."""
        return self._step

    @property
    def dtype(self) -> torch.dtype:
        return self.format.dtype

    def named_grads(self, optimizer: Optimizer | None = None) -> Iterator[tuple[str, Tensor]]:
        """(parameter name, FP32 gradient the optimizer reads), for one optimizer's parameters or all of them.

        In ``on_before_optimizer_step(optimizer)`` the gradients of that optimizer are unscaled (true values); with
        several optimizers, another optimizer's gradients may still be scaled until its own step.
        """
        module = self._lightning_module or self._module
        if module is None:
            return
        allowed = None if optimizer is None else {id(p) for g in optimizer.param_groups for p in g["params"]}
        for name, p in module.named_parameters():
            if p.grad is not None and (allowed is None or id(p) in allowed):
                yield name, p.grad

    def named_fp32_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """(name, value) of every parameter: the FP32 masters (the Parameters themselves hold them at every
        moment; kept for code written against earlier versions, ``module.named_parameters()`` is the same)."""
        module = self._lightning_module or self._module
        if module is None:
            return
        for name, p in module.named_parameters():
            yield name, p.detach()

    def describe(self) -> str:
        """A Markdown summary of this plugin's settings and its FP32 policy."""
        s = self.scaler
        lines = [
            f"precision: {self.format.name} (compute dtype {self.format.dtype}); master weights: "
            f"{'FP32 parameters, 16-bit copies read by the forward' if self.master_weights else 'no (autocast only)'}",
            f"loss scale: {s.mode!r}, current {s.scale:g}",
        ]
        if s.dynamic:
            lines.append(
                f"  growth x{s.growth_factor:g} every {s.growth_interval} clean steps, backoff x{s.backoff_factor:g}, "
                f"hysteresis {s.hysteresis}, range [{s.min_scale:g}, {s.max_scale:g}]"
            )
        guard = "on (one host sync per step)" if self.check_finite or s.enabled else "off (no sync, no extra pass)"
        lines.append(f"non-finite guard: {guard}; stop after {s.max_consecutive_skips} skipped steps in a row")
        if self.format.is_16bit:
            lines.append(self.gemm.describe())
        return "\n".join(lines) + "\n\n" + self.policy.describe()
