"""The Trainer front end: Lightning's ``Precision`` hooks mapped onto :class:`lightning_mp.core.MixedPrecisionCore`.

``train_step_context`` -> ``core.begin`` + ``self.forward_context()`` (``core.forward_context``, a subclass's
override honoured); ``pre_backward`` -> ``core.scale_loss``; ``post_backward`` -> ``core.fold``
(``on_after_backward`` sees every gradient in FP32 ``.grad``); ``optimizer_step`` -> closure, ``core.unscale_``
(hooks and clipping see true gradients), ``core.optimizer_step`` with ``core.replay_closure`` (the optimizer gets
the closure it gets without a plugin) and, once per training step however many optimizers stepped,
``core.end_training_step`` (manual optimization: at the end of ``training_step``, so several optimizers use one
scale and move the state machine once).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Callable

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.core import CoreViews
from lightning_mp.core.ladder import run_length
from lightning_mp.numerics.checkpoint_compat import gradscaler_state, is_gradscaler_state, take_gradscaler_state



class MixedPrecisionPlugin(CoreViews, Precision):
    """Mixed precision with FP32 master weights, dynamic loss scaling and an FP32 op policy.

    The dynamic scaler's knobs (``init_scale`` ... ``max_consecutive_skips``) and their defaults are the fields of
    :class:`lightning_mp.ScalerSettings`; :class:`lightning_mp.LossScaler` documents each.

    Args:
        precision: ``"fp16"``, ``"bf16"``, ``"fp8"`` or ``"fp32"`` (aliases: ``"16"``, ``"16-mixed"``, ``"bf16-mixed"``,
            ``"32"``, ``"32-true"``). ``"fp32"`` is a passthrough: bit-identical to a Trainer without the plugin,
            plus the guard that skips steps with non-finite gradients.
        master_weights: forward and backward read 16-bit copies of the parameters while the Parameters
            themselves, and so the optimizer, hold FP32 masters (default for fp16 and bf16). ``False`` runs the
            forward under autocast only, like Lightning's ``16-mixed``/``bf16-mixed``. Ignored for fp32.
            ``"compensated"`` (bf16 only, "lean bf16"): the parameters are bf16 between steps, each with an exact
            int16 remainder and a tie bit, and the optimizer steps on the rebuilt FP32 masters bucket by bucket:
            14.1 B/param under AdamW instead of 18, bit for bit the same training in one process, accumulation and
            clipping included (``docs/behaviour.md``).
        loss_scale: ``"dynamic"``, a positive number (static scale), ``None`` (no scaling), or ``"auto"``
            (default): ``"dynamic"`` for fp16, ``None`` for bf16 and fp32.
        fp32_ops: ops that always compute in FP32 under autocast (names or torch callables); kernels at torch's
            autocast dispatch keys for the whole fit. ``None`` (default): the format's list,
            :data:`lightning_mp.DEFAULT_FP32_OPS` in fp16, :data:`lightning_mp.BF16_FP32_OPS` in bf16 (the same
            without the transcendentals listed for fp16's range). Ops of ``DEFAULT_FP32_OPS`` left out run in 16
            bits on every device, also where autocast's own list would run them in FP32.
        fp32_modules: module classes whose whole subtree (parameters and forward, children included) stays FP32,
            default :data:`lightning_mp.DEFAULT_FP32_MODULES` (norm, recurrent and embedding layers). ``"auto"``:
            those, plus the module *instances* the precision autopilot moves to FP32 when their outputs near the
            format's largest value while calibrating, or overflow later (:attr:`auto_fp32_modules`,
            ``docs/policy.md``); a tuple with ``"auto"`` in it: its classes plus the autopilot.
        calibration_steps: with ``fp32_modules="auto"``, the first training steps whose activations are measured
            (default 10; each costs about what the locator's forward checks do, 9-13% of a step).
        optimizer_state_dtype: with ``master_weights="compensated"``, ``torch.bfloat16`` keeps the optimizer's
            per-element state (Adam's moments) in bf16 between steps, stochastically rounded: 10.1 B/param (AdamW).
            ``None`` (default): FP32.
        parity_guard: with ``master_weights="compensated"``, the fraction of parameter tensors shadowed in FP32 and
            stepped beside the lean ones; the drift is in :attr:`parity`, ``LossScaleMonitor``'s
            ``precision/parity_*`` tags and a warning past one bf16 ulp. 0 (default): off, free.
        skip_scheduler_on_overflow: ``interval="step"`` learning-rate schedulers do not advance on a skipped step.
        check_finite: check the gradients for inf/NaN before every optimizer step and skip such steps, also when
            the loss is not scaled (bf16, fp32): one fused read of the gradients and, unless the optimizer is fused
            (it skips on the device), one device->host sync per step. ``False`` with no loss scaling removes both.
        locate_overflows: on a skipped step, name where it went non-finite (:class:`lightning_mp.OverflowLocator`):
            the first non-finite gradient in backward order, and from then on the first module whose forward
            output went non-finite; in a log line, :attr:`last_overflow` and the ``FloatingPointError`` that stops
            a run. A clean step costs nothing; the forward checks (9-13% of a step) are armed at the first skip.
            A loss that was already non-finite is reported as a forward overflow even before they are armed.
            ``"forward"``: the forward checks from the first step, so a run that stops at its first skip names
            the module too.
        gemm: how 16-bit matrix products run: ``"auto"`` (default) emulates them with FP32 GEMMs on the 16-bit
            values only where the device has no native 16-bit arithmetic (many CPUs do bf16 but not fp16);
            ``"native"`` always uses torch's 16-bit kernels; ``"emulated"`` always emulates.
        fp8_recipe: with ``"fp8"`` (bf16 whose chosen Linears multiply in FP8 through torchao; ``docs/fp8.md``):
            ``"rowwise"`` (default), ``"tensorwise"``, ``"rowwise_with_gw_hp"`` or ``"mxfp8"``.
        fp8_modules: with ``"fp8"``, which Linears: ``"default"`` (torchao's size rule, output head in bf16), or a
            list of module names and classes whose Linears compute in FP8; ``"auto"`` (alone or in the list): those,
            measured for ``calibration_steps`` steps in bf16, the ones FP8 hurts kept in bf16.
        schedule: precision over the run, ``{when: what}``: ``when`` an optimizer step (int) or a fraction of
            ``max_steps`` (float), ``what`` a precision or a dict of these arguments, from that step on:
            ``MixedPrecisionPlugin("fp8", schedule={0.9: "bf16"})``. Switches between steps, masters and optimizer
            state kept, on every rank at the same step (:mod:`lightning_mp.core.ladder`, ``docs/behaviour.md``).
    """

    def _set_up_front_end(self) -> None:
        self._lightning_module: LightningModule | None = None

    # ------------------------------------------------------------------ set-up
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.core.convert(module)

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        self._lightning_module = _find_lightning_module(model)
        schedulers = [c.scheduler for c in lr_schedulers if getattr(c, "interval", "epoch") == "step"]
        verdict = self.core.connect(model, self._lightning_module or model, optimizers, schedulers)
        if verdict:
            rank_zero_info(verdict)
        return model, optimizers, lr_schedulers

    @override
    def teardown(self) -> None:
        self.core.teardown()

    # ------------------------------------------------------------------ forward
    def autocast_context_manager(self) -> contextlib.AbstractContextManager:
        """The forward's context, as Lightning's ``MixedPrecision`` names it: ``torch.autocast`` to the 16-bit format,
        plus GEMM emulation and the FP32 policy's fallback where they apply (a no-op in fp32)."""
        return self.core.forward_context()

    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.autocast_context_manager()

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        if self._ladder.scheduled:  # global_step: the same on every rank and in every micro-batch of a step
            trainer = self._lightning_module.trainer
            self._follow_schedule(trainer.global_step, lambda: run_length(trainer))
        self.core.begin(force=True)  # a write through `.data` (WGAN's clamp) moves no version counter
        with self.forward_context():  # a subclass's override is entered, as Lightning's Precision does
            yield
        if self._lightning_module is not None and not self._lightning_module.automatic_optimization:
            self.core.fold()  # a bare loss.backward() in training_step
            self._end_training_step()

    @contextlib.contextmanager
    def _eval_step_context(self) -> Generator[None, None, None]:
        self.core.begin(force=False)
        with self.forward_context():
            yield

    @override
    def val_step_context(self) -> contextlib.AbstractContextManager:
        return self._eval_step_context()

    @override
    def test_step_context(self) -> contextlib.AbstractContextManager:
        return self._eval_step_context()

    @override
    def predict_step_context(self) -> contextlib.AbstractContextManager:
        return self._eval_step_context()

    # ------------------------------------------------------------------ backward
    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        self.core.before_backward()  # lean bf16: a second micro-batch sums into FP32 gradients
        return super().pre_backward(self.core.scale_loss(tensor), module)

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        with self.core.backward_context():
            super().backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        self.core.fold()  # before on_after_backward: hooks see every gradient in the Parameters' FP32 .grad
        return super().post_backward(tensor, module)

    # ------------------------------------------------------------------ optimizer step
    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        closure_result = closure()  # evaluated first: the skip decision comes before optimizer.step
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: Lightning's convention for "skip this batch", not an overflow
            self.core.fold()
            self._after_closure(model, optimizer)
            return None
        self.core.unscale_(optimizer)
        after = lambda: self._after_closure(model, optimizer)  # noqa: E731
        after()  # hooks and clipping: true FP32 gradients
        # the optimizer gets a closure, as without a plugin: its first call returns this evaluation, a later one
        # (LBFGS, SAM) evaluates again; in manual optimization opt.step(closure) returns the loss
        replay = self.core.replay_closure(optimizer, closure_result, closure, after, self._step_no())
        output = self.core.optimizer_step(optimizer, closure=replay, **kwargs)
        if model.automatic_optimization:
            self._end_training_step()
        return output

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
        if self.core.unscale_(optimizer):
            return  # the step is skipped: clipping inf/NaN gradients would only compute NaN norms
        self.core.before_clipping(optimizer)  # lean bf16: clip FP32 gradients
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def _end_training_step(self) -> None:
        self.core.end_training_step(self._step_no(), rank_zero=getattr(rank_zero_only, "rank", 0) == 0)

    def _step_no(self) -> int | None:
        trainer = getattr(self._lightning_module, "_trainer", None)
        return trainer.global_step if trainer is not None else None

    # ------------------------------------------------------------------ checkpoints
    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Take over the scale of a checkpoint that Lightning's own ``16-mixed`` wrote (:mod:`.checkpoint_compat`)."""
        native = gradscaler_state(checkpoint, type(self).__qualname__)
        if native is not None:
            take_gradscaler_state(self.core.scaler, native)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._plugin_state()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if is_gradscaler_state(state_dict):  # Lightning's deprecated alias of 16-mixed, under our key
            take_gradscaler_state(self.core.scaler, state_dict)
        else:
            self._load_plugin_state(state_dict, self._step_no())


def _find_lightning_module(model: nn.Module) -> LightningModule | None:
    """The LightningModule inside wrappers such as DistributedDataParallel."""
    for _ in range(8):
        if isinstance(model, LightningModule) or not isinstance(getattr(model, "module", None), nn.Module):
            break
        model = model.module
    return model if isinstance(model, LightningModule) else None


__all__ = ["MixedPrecisionPlugin"]
