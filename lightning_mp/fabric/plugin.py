"""The Fabric front end: Fabric's ``Precision`` hooks mapped onto :class:`lightning_mp.core.MixedPrecisionCore`.

Where each piece runs in one iteration of a Fabric loop::

    fabric.setup(model, opt)  convert_module: the model's FP32 parameters are the masters          (core.convert)
    model(x)                  convert_input: floating inputs cast to the 16-bit format (as Fabric's MixedPrecision)
                              forward_context, which Fabric's module wrapper enters around forward:
                                the device set-up on the first forward                           (core.connect)
                                copies refreshed where their masters changed                      (core.begin)
                                autocast + GEMM emulation, the FP32 policy's kernels switched on
                                floating outputs come back as FP32 (as from Fabric's own MixedPrecision),
                                so a loss computed in the loop, outside autocast, is an FP32 loss
    fabric.backward(loss)     loss * scale, the backward (kernels again: checkpoint recomputation follows them),
                              post_backward: the copies' 16-bit grads folded into FP32 .grad     (core.fold)
    fabric.clip_gradients     unscale + inf/NaN check, one host sync; clipping sees the true FP32 gradients
    optimizer.step()          (DDP: FP32 gradients averaged) skip or step, one scale update (core.end_training_step)

The model's Parameters hold their FP32 masters at every moment, so the optimizer (and its state),
``model.state_dict()``, ``fabric.save``/``fabric.load`` (also right after a forward whose loss is never
back-propagated), clipping and anything the loop reads see exact FP32 weights. The first forward after an
``optimizer.step()`` refreshes every trainable copy (a write through ``.data`` after the step is seen); other
forwards refresh the copies whose masters changed, so two forwards through one model in one graph (a GAN's
discriminator on real and fake data) share their copies. A graph built before an ``optimizer.step()`` and
back-propagated after it (the generator's ``fake = G(z)`` across the discriminator's step) keeps the copies it was
built with: the refresh puts the new values in other tensors (:mod:`lightning_mp.numerics.copies`), as Fabric's own
mixed precision casts fresh ones at every forward.

Several ranks (DDP, FSDP2): the set-up waits for what the strategy made of the model (:mod:`.first_call`).

Fabric has no ``connect`` and no end of fit: the one-time set-up that needs the device runs on the first forward,
which also registers the FP32 policy's kernels for the plugin's life, switched on from a forward to the end of its
backward (the emulated GEMMs' kernels held over the same span). What that costs where: :mod:`.kernels`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.core import CoreViews, MixedPrecisionCore
from lightning_mp.core.skips import refuse_lbfgs
from lightning_mp.fabric.first_call import FirstForward
from lightning_mp.fabric.forward import ForwardContext, cast_inputs
from lightning_mp.fabric.kernels import KernelHold
from lightning_mp.formats import upcast
from lightning_mp.numerics.checkpoint_compat import is_gradscaler_state, take_gradscaler_state


class MixedPrecisionPlugin(CoreViews, FabricPrecision):
    """Mixed precision with FP32 master weights, dynamic loss scaling and an FP32 op policy, for Fabric.

    ``Fabric(plugins=[MixedPrecisionPlugin("bf16")])``. The arguments, their defaults and the read-only state
    (``loss_scale``, ``skipped_steps``, ``last_step_skipped``, ``last_step_scale``, ``training_steps``,
    ``last_overflow``, ``step``, ``named_grads()``, ``describe()``) are those of
    :class:`lightning_mp.MixedPrecisionPlugin`; the numerics are the same objects. What differs in a Fabric loop:

    * The scale moves once per ``optimizer.step()`` (Fabric has no training step around several optimizers, so a
      loop with two optimizers moves it twice per iteration, as Fabric's own ``MixedPrecision`` does), and
      :attr:`training_steps` counts those calls, skipped ones included.
    * ``fabric.clip_gradients`` on a step that will be skipped clips nothing and returns a norm of 0.
    * ``skip_scheduler_on_overflow`` applies to the schedulers passed to :meth:`guard_schedulers` (a Fabric
      scheduler is stepped by the loop, and the plugin never sees it otherwise).
    * The plugin's state is saved only when the loop puts it in the checkpoint:
      ``fabric.save(path, {"model": model, "optimizer": opt, "precision": plugin})`` and the same dict for
      ``fabric.load``. A checkpoint of Fabric's own ``MixedPrecision("16-mixed")`` (its GradScaler state) is taken
      over too.
    * ``optimizer.step(closure)`` (LBFGS, SAM): the closure is evaluated first and decides skip-or-step; the
      optimizer's later calls evaluate it again, each unscaled and checked (a non-finite one raises: the parameters
      have moved). LBFGS with a dynamic scale is refused, as by the Trainer plugin.
    * Floating inputs are cast to the 16-bit format (``convert_input``), as Fabric's own ``MixedPrecision`` does.
    * Several ranks: ``"ddp"``, ``"ddp_spawn"`` (FP32 gradients averaged once per step, none inside
      ``fabric.no_backward_sync``) and ``ModelParallelStrategy`` with ``fully_shard`` (pass
      ``mp_policy=plugin.fsdp_mp_policy()``); Fabric's ``FSDPStrategy`` (FSDP1) takes only its own precision.
    """

    def _set_up_front_end(self) -> None:
        if any(isinstance(when, float) for when in self._ladder.whens):
            self._ladder.resolve(None)  # a fraction of the run: refused now (Fabric has no run length), not at a step
        self._first_forward = FirstForward(self.core)  # the set-up at the first forward (several ranks: conversion)
        self._listeners: list[Any] = []  # PrecisionMonitor objects, told about every optimizer step
        self._force_refresh = True  # the next forward refreshes every trainable copy (set by optimizer steps)
        self._kernels = KernelHold(self.core.policy, self.core.gemm)  # the FP32 policy's and emulated GEMMs' kernels
        # Fabric never calls teardown: the copies' hooks and buffers, and the kernels, go with the plugin
        weakref.finalize(self, MixedPrecisionCore.teardown, self.core)
        weakref.finalize(self, KernelHold.release, self._kernels)

    def __repr__(self) -> str:  # Lightning's "invalid plugin" error names it: say it is the Fabric one
        return f"lightning_mp.fabric.MixedPrecisionPlugin({self.core.format.name!r})"

    # ------------------------------------------------------------------ set-up
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return self._first_forward.convert(module)

    def guard_schedulers(self, *schedulers: Any) -> None:
        """Make ``scheduler.step()`` a no-op right after a skipped ``optimizer.step()``, for the learning-rate
        schedulers the loop steps once per optimizer step (with ``skip_scheduler_on_overflow=True``, the default;
        otherwise nothing changes). The schedulers stay what they were for ``isinstance`` and ``state_dict()``."""
        self.core.guard_schedulers(schedulers)

    def setup_optimizers(self, *optimizers: Any) -> None:
        """With ``master_weights="compensated"``: keep these optimizers' FP32 state FP32 through ``fabric.load``
        (torch casts loaded state to the bf16 Parameters' dtype). Call it before ``fabric.load``; the first
        ``optimizer.step()`` does it for an optimizer not set up. Otherwise nothing changes."""
        self.core.watch_optimizers([getattr(o, "optimizer", o) for o in optimizers])  # Fabric's wrapper: the optimizer

    @override
    def teardown(self) -> None:
        self._kernels.release()
        self._first_forward.remove()
        self.core.teardown()

    def release_kernels(self) -> None:
        """The FP32 policy's kernels out of torch's dispatcher, registered from the first forward on: other code under
        ``torch.autocast`` then runs as in a fresh process. The next forward registers them again (about 1.5 ms)."""
        self._kernels.release()

    # ------------------------------------------------------------------ forward
    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        return ForwardContext(self)

    @override
    def convert_input(self, data: Any) -> Any:
        """Floating inputs in the 16-bit format, as Fabric's own ``MixedPrecision`` casts them (``x.dtype`` inside
        ``forward`` is the same under both); FP32 modules upcast what reaches them (``fp32_modules``)."""
        fmt = self.core.format
        return cast_inputs(data, fmt.dtype) if fmt.is_16bit else data

    @override
    def convert_output(self, data: Any) -> Any:
        if not self.core.format.is_16bit:
            return data
        return apply_to_collection(data, function=upcast, dtype=Tensor)

    # ------------------------------------------------------------------ backward
    @override
    def pre_backward(self, tensor: Tensor, module: nn.Module | None) -> None:  # type: ignore[override]
        self.core.before_backward()  # lean bf16: a second micro-batch sums into FP32 gradients
        return None  # Fabric ignores what pre_backward returns: the loss is scaled in backward

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any
    ) -> None:
        # the policy's kernels on (from the forward, or from here): checkpointing recomputes forwards inside it
        fallback = None
        if self.core.format.is_16bit:
            self._kernels.forward()
            fallback = self.core.policy.fallback_mode()  # fp32_ops without an aten op: a torch-function mode
        try:
            with fallback or contextlib.nullcontext(), self.core.backward_context():
                super().backward(self.core.scale_loss(tensor), model, *args, **kwargs)
        finally:
            self._kernels.backward_done()

    @override
    def post_backward(self, tensor: Tensor, module: nn.Module | None) -> None:  # type: ignore[override]
        self.core.fold()

    # ------------------------------------------------------------------ step
    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        self.core.unscale_(optimizer)

    @override
    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:
        if self.core.step.in_progress and self.core.step.skipping:
            # the step is skipped: clipping inf/NaN gradients would raise or compute NaN norms, and torch's
            # clip_grad_value_ fails on an empty list; a zero gradient clips to a norm of 0 and changes nothing
            return iter((_zero_grad_tensor(optimizer),))
        self.core.before_clipping(optimizer)  # lean bf16: clip FP32 gradients (Fabric's clipping reads these)
        return super().main_params(optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self.setup_optimizers(optimizer)  # lean bf16: its state stays FP32 through a later load (once per optimizer)
        closure = kwargs.pop("closure", None)
        if closure is not None:
            # as the Trainer plugin: the closure (forward, fabric.backward) is evaluated first, so the gradients are
            # unscaled and checked, and the step skipped, before the optimizer reads them
            refuse_lbfgs([optimizer], self.core.scaler.dynamic, self.core.lean is not None)
            first = closure()
        self.core.unscale_(optimizer)
        for listener in self._listeners:
            listener.before_optimizer_step(optimizer)  # true FP32 gradients, also on a step about to be skipped
        if closure is not None:
            # its first call returns that evaluation; a later one (LBFGS's line search, SAM's second point) runs the
            # closure again at the step's scale, unscaled and checked: non-finite raises (the parameters moved)
            after = lambda: None  # noqa: E731 (what runs after a re-evaluation: the Trainer's hooks, none here)
            kwargs["closure"] = self.core.replay_closure(optimizer, first, closure, after, self.core.step.steps)
        output = self.core.optimizer_step(optimizer, **kwargs)
        self._force_refresh = True
        self._kernels.backward_done()  # a forward whose loss was not back-propagated held the GEMMs' kernels
        self.core.end_training_step(self.core.step.steps)  # Fabric has no global step: the plugin's own count
        for listener in self._listeners:
            listener.after_optimizer_step(optimizer)
        if self._ladder.scheduled:  # the count of steps: the same on every rank; no run length (no fractions)
            self._follow_schedule(self.core.step.steps, lambda: None)
        return output

    def _switch_to(self, rung: int, step: int | None) -> None:
        self._kernels.release()  # the old policy's kernels; the next forward registers the new one's
        super()._switch_to(rung, step)
        self._first_forward.core = self.core  # a set-up still waiting for a first forward goes to the new core
        self._kernels = KernelHold(self.core.policy, self.core.gemm)
        self._force_refresh = True
        weakref.finalize(self, MixedPrecisionCore.teardown, self.core)
        weakref.finalize(self, KernelHold.release, self._kernels)

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return self._plugin_state()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if is_gradscaler_state(state_dict):  # Fabric's own MixedPrecision("16-mixed") saved its GradScaler
            take_gradscaler_state(self.core.scaler, state_dict)
        else:
            self._load_plugin_state(state_dict, self.core.step.steps)


def _zero_grad_tensor(optimizer: Optimizer) -> Tensor:
    first = next((p for group in optimizer.param_groups for p in group["params"]), None)
    t = torch.zeros((), device=first.device if first is not None else "cpu")
    t.grad = torch.zeros_like(t)
    return t


__all__ = ["MixedPrecisionPlugin"]
