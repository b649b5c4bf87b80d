"""The Lightning precision plugin: thin glue from Lightning's hooks to the numerics pieces.

Where each piece runs in one training step (automatic optimization)::

    train_step_context     refresh the 16-bit copies at the first forward     (MasterWeights.begin)
                           autocast to the 16-bit format + the FP32 op policy
                           each module's forward reads its copies (hooks); the Parameters stay FP32
    pre_backward           loss * scale                                      (LossScaler.scale_loss)
    post_backward          16-bit grads of the copies folded into FP32 .grad  (MasterWeights.fold_grads)
    optimizer_step         unscale + inf/NaN check, one host sync             (MixedPrecisionStep.unscale_)
                           on_before_optimizer_step hooks and clipping see the true FP32 gradients
                           skip, or step on the FP32 parameters               (MixedPrecisionStep.step)
                           scale update, once per training step               (MixedPrecisionStep.end_training_step)

The model's Parameters hold their FP32 master values at every moment, so every Lightning feature, callback,
checkpoint and signal handler sees and changes exact FP32 weights (see :mod:`lightning_mp.master_weights`). With manual
optimization the scale update waits for the end of ``training_step``, so several optimizers stepping in one
batch use one scale and move the state machine once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable, Sequence
from typing import Any, Callable

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_mp.distributed import average_across_ranks_, world_size
from lightning_mp.checkpoint_compat import gradscaler_state, is_gradscaler_state, take_gradscaler_state
from lightning_mp.formats import Format, check_device_supports, resolve_precision
from lightning_mp.fp32_policy import DEFAULT_FP32_MODULES, DEFAULT_FP32_OPS, Fp32Policy
from lightning_mp.gemm_emulation import GemmEmulation
from lightning_mp.loss_scaler import LossScaler
from lightning_mp.master_weights import MasterWeights
from lightning_mp.plugin_state import PluginState
from lightning_mp.plugin_steps import StepHooks
from lightning_mp.overflow_locator import OverflowLocator, OverflowReport
from lightning_mp.scheduler_guard import SchedulerGuard
from lightning_mp.sharding import fsdp_mp_policy, is_sharded
from lightning_mp.step import MixedPrecisionStep
from lightning_mp.validation import check_bool

class MixedPrecisionPlugin(PluginState, StepHooks, Precision):
    """Mixed precision with FP32 master weights, dynamic loss scaling and an FP32 op policy.

    Args:
        precision: ``"fp16"``, ``"bf16"`` or ``"fp32"`` (aliases: ``"16"``, ``"16-mixed"``, ``"bf16-mixed"``,
            ``"32"``, ``"32-true"``). ``"fp32"`` is a passthrough: bit-identical to a Trainer without the plugin,
            plus the guard that skips steps with non-finite gradients.
        master_weights: run forward and backward on 16-bit copies of the parameters while the parameters
            themselves, and so the optimizer, hold FP32 masters (default for fp16 and bf16). ``False`` runs the
            forward under autocast only, like Lightning's ``16-mixed``/``bf16-mixed``. Ignored for fp32.
        loss_scale: ``"dynamic"``, a positive number (static scale) or ``None`` (no scaling). Default
            ``"dynamic"`` for fp16 and ``None`` for bf16 and fp32.
        fp32_ops: ops that always compute in FP32 inside the training/eval steps (names or torch callables),
            default :data:`lightning_mp.DEFAULT_FP32_OPS`.
        fp32_modules: module classes whose parameters stay FP32 and whose forward runs in FP32,
            default :data:`lightning_mp.DEFAULT_FP32_MODULES` (the norm layers, and the recurrent layers, which
            have no FP16 kernel on many CPUs and carry rounding through every time step).
        skip_scheduler_on_overflow: ``interval="step"`` learning-rate schedulers do not advance on a skipped step
            (Lightning's default moves them on every step, skipped or not). ``trainer.global_step`` still counts
            every training step; :attr:`skipped_steps` says how many were skipped.
        check_finite: check the gradients for inf/NaN before every optimizer step and skip such steps, also when
            the loss is not scaled (bf16, fp32). The check costs one read of every gradient and one device->host
            sync per optimizer step, which Lightning's ``bf16-mixed`` does not pay; ``False`` with no loss scaling
            removes both (a non-finite gradient then reaches the weights, as in ``bf16-mixed``). With scaling on,
            the fused unscale checks anyway.
        locate_overflows: on every skipped step, name the first module whose forward output (or else whose
            parameter gradient in the backward) went non-finite
            (:class:`lightning_mp.overflow_locator.OverflowLocator`): in a log line, in :attr:`last_overflow`, and in
            the ``FloatingPointError`` that stops a run. A clean step costs nothing: no hook, no read. On a skipped
            step the gradients the optimizer reads are checked in one fused pass, in backward order, and the first
            non-finite one is named; from the next step on every module's forward output is checked too (reading
            each activation once more costs 5-13% of a step, so it is armed only once something went wrong; a
            forward overflow that repeats is named by its module from the second skip on). ``False`` removes it.
        gemm: how 16-bit matrix products (linear, matmul, bmm, convolutions, attention) run, forward and backward:
            ``"auto"`` (default) computes them as FP32 GEMMs on the 16-bit values, with 16-bit results, only where
            the device has no native 16-bit arithmetic (detected per format: many CPUs do bf16 but not fp16, CUDA
            always native), which runs at about FP32 speed instead of 5-100x slower; ``"native"`` always uses
            torch's 16-bit kernels (warning once where they are slow); ``"emulated"`` always emulates. Weights,
            activations and gradients stay 16-bit either way (:mod:`lightning_mp.gemm_emulation`).
        **scaler_knobs: the dynamic scaler's knobs, declared once in :class:`lightning_mp.loss_scaler.LossScaler`:
            ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``hysteresis``,
            ``min_scale``, ``max_scale``, ``max_consecutive_skips``.

    Where the gradients are: ``on_after_backward`` and everything after it see FP32 gradients on the module's own
    parameters (scaled until the optimizer step unscales them, as in Lightning's ``16-mixed``);
    ``on_before_optimizer_step``, clipping, ``lightning.pytorch.utilities.grad_norm``, :func:`lightning_mp.grad_norm`
    and the monitors see the true FP32 gradients the optimizer reads. The 16-bit gradients exist only during the
    backward pass.
    """

    def __init__(
        self,
        precision: str = "bf16",
        *,
        master_weights: bool | None = None,
        loss_scale: str | float | None = "auto",
        fp32_ops: Iterable[str | Callable] = DEFAULT_FP32_OPS,
        fp32_modules: Sequence[type[nn.Module]] = DEFAULT_FP32_MODULES,
        skip_scheduler_on_overflow: bool = True,
        check_finite: bool = True,
        locate_overflows: bool = True,
        gemm: str = "auto",
        **scaler_knobs: Any,
    ) -> None:
        super().__init__()
        self.format: Format = resolve_precision(precision)
        self.precision = self.format.lightning_precision  # what Lightning's Trainer.precision reports
        if master_weights is not None and not isinstance(master_weights, bool):
            raise ValueError(f"master_weights={master_weights!r} is not allowed: use True, False or None (auto).")
        for name, value in (
            ("skip_scheduler_on_overflow", skip_scheduler_on_overflow),
            ("check_finite", check_finite),
            ("locate_overflows", locate_overflows),
        ):
            check_bool(name, value)
        self.master_weights = self.format.is_16bit and master_weights is not False
        if loss_scale == "auto":
            loss_scale = self.format.default_loss_scale
        unknown = sorted(set(scaler_knobs) - set(LossScaler.KNOBS))
        if unknown:
            raise ValueError(
                f"{unknown[0]}={scaler_knobs[unknown[0]]!r}: no such argument. Allowed: precision, master_weights, "
                f"loss_scale, fp32_ops, fp32_modules, skip_scheduler_on_overflow, check_finite, locate_overflows, "
                f"gemm, and the scaler's {', '.join(LossScaler.KNOBS)}."
            )
        self.scaler = LossScaler(loss_scale, **scaler_knobs)
        self.skip_scheduler_on_overflow = skip_scheduler_on_overflow
        self.check_finite = check_finite
        self.locate_overflows = locate_overflows
        self._locator: OverflowLocator | None = None
        self._last_overflow: OverflowReport | None = None
        self.policy = Fp32Policy(fp32_ops, fp32_modules)
        self.gemm = GemmEmulation(gemm)
        self._masters: MasterWeights | None = None
        self._step = MixedPrecisionStep(self.scaler, check_finite=check_finite, fp32_grads=self.master_weights)
        self._device_type = "cpu"
        self._module: nn.Module | None = None
        self._lightning_module: LightningModule | None = None
        self._handles: list[Any] = []
        self._sharded = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.format.name!r})"

    # ------------------------------------------------------------------ set-up
    @property
    def sharded(self) -> bool:
        """Whether the model is sharded by FSDP2: its FP32 shards are the masters (see lightning_mp.sharding)."""
        return self._sharded

    def fsdp_mp_policy(self):
        """The FSDP2 ``MixedPrecisionPolicy`` for this format: compute in it, reduce gradients in FP32.

        Pass it to every ``fully_shard(..., mp_policy=plugin.fsdp_mp_policy())`` call in ``configure_model``."""
        return fsdp_mp_policy(self.format.dtype if self.format.is_16bit else torch.float32)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        self._sharded = is_sharded(module)
        if self.master_weights and not self._sharded:
            self._masters = MasterWeights(self.format.dtype, keep_fp32=self.policy.keeps_fp32)
            self._masters.convert(module)
        return module

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        self._module = model
        self._lightning_module = _find_lightning_module(model)
        first = next(model.parameters(), None)
        self._device_type = first.device.type if first is not None else "cpu"
        check_device_supports(self.format, self._device_type)
        if self.format.is_16bit:
            rank_zero_info(self.gemm.setup(self._device_type, self.format.dtype))
        if self.scaler.dynamic and any(isinstance(opt, LBFGS) for opt in optimizers):
            raise ValueError(
                "LBFGS re-evaluates its closure inside step(), so a step with an overflow cannot be skipped: "
                "loss_scale='dynamic' does not support it. HINT: use a static loss_scale=<number>, or "
                "precision='bf16' (no scaling needed)."
            )
        if self._masters is not None and hasattr(model, "require_backward_grad_sync") and world_size() > 1:
            # autograd differentiates the 16-bit copies, not DDP's Parameters, so DDP's reducer must never wait
            # for them: we average the FP32 gradients once per step instead (see lightning_mp.distributed).
            # Lightning turns the flag back on after every manual-optimization training_step, so it is switched
            # off before every DDP forward (and so before Lightning's prepare_for_backward in manual_backward).
            model.require_backward_grad_sync = False
            self._handles.append(model.register_forward_pre_hook(_no_ddp_grad_sync))
            self._step.reduce_ = average_across_ranks_
        if self.skip_scheduler_on_overflow:
            step_schedulers = [c.scheduler for c in lr_schedulers if getattr(c, "interval", "epoch") == "step"]
            self._handles.append(SchedulerGuard(step_schedulers, lambda: self._step.skipping))
        if self.format.is_16bit:
            # the op policy's kernels at the autocast keys, for the whole fit: the backward and activation
            # checkpointing's recomputation (which replays autocast state) follow it too
            self._handles.append(self.policy.activate())
            self._handles.append(self.policy.install(model, self._device_type))
        if self.locate_overflows:
            # nothing on a clean step; a skip names the first non-finite gradient in backward order (parameter-free
            # modules by the nearest parameter the overflow reaches) and arms the forward checks
            locator = self._locator = OverflowLocator(self._lightning_module or model, input_grads=False, forward=False)
            self._step.on_overflow = lambda optimizer: locator.locate_gradients(self.named_grads(optimizer))
            self._handles.append(self._locator)
        return model, optimizers, lr_schedulers

    @override
    def teardown(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._step.on_overflow = None
        self._step.reset()  # a fit that failed mid-step leaves nothing for the next one
        if self._masters is not None:
            self._masters.remove()
            self._masters = None

    # ------------------------------------------------------------------ forward
    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        if not self.format.is_16bit:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        # autocast as well as 16-bit weights: models that build FP32 tensors inside forward still get 16-bit
        # matmuls, and for the 16-bit copies autocast's weight casts are no-ops
        stack.enter_context(torch.autocast(self._device_type, dtype=self.format.dtype))
        stack.enter_context(self.policy.op_context())
        stack.enter_context(self.gemm.context())
        return stack

    def _begin(self, force: bool) -> None:
        if self._masters is not None:
            self._masters.begin(force)

    def _fold(self) -> None:
        if self._masters is not None:
            self._masters.fold_grads()

    def _stepped(self, optimizer: Optimizer) -> None:
        """The optimizer changed its parameters: their copies are refreshed at the next forward."""
        if self._masters is not None:
            self._masters.mark_stale(p for group in optimizer.param_groups for p in group["params"])

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        # forced: a write through `.data` (WGAN's clamp) does not move a version counter
        self._begin(force=True)
        with self.forward_context():
            yield
        if self._lightning_module is not None and not self._lightning_module.automatic_optimization:
            self._fold()  # a bare loss.backward() in training_step
            self._end_training_step()

    @contextlib.contextmanager
    def _eval_step_context(self) -> Generator[None, None, None]:
        self._begin(force=False)
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
        return super().pre_backward(self.scaler.scale_loss(tensor), module)

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        # the backward's GEMMs (grad @ W, x^T @ grad, the attention backward) run under the same emulation as the
        # forward's; a bare loss.backward() outside Lightning's backward runs them natively (correct, maybe slow)
        with self.gemm.context():
            super().backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        self._fold()  # before on_after_backward: hooks see every gradient in the Parameters' FP32 .grad
        return super().post_backward(tensor, module)

    # ------------------------------------------------------------------ checkpoints
    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Take over the scale of a checkpoint that Lightning's own ``16-mixed`` wrote (:mod:`.checkpoint_compat`)."""
        native = gradscaler_state(checkpoint, type(self).__qualname__)
        if native is not None:
            take_gradscaler_state(self.scaler, native)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.format.name, **self._step.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if is_gradscaler_state(state_dict):  # Lightning's deprecated alias of 16-mixed, under our key
            take_gradscaler_state(self.scaler, state_dict)
        else:
            self._step.load_state_dict(state_dict)


def _no_ddp_grad_sync(ddp: nn.Module, args: Any) -> None:
    ddp.require_backward_grad_sync = False


def _find_lightning_module(model: nn.Module) -> LightningModule | None:
    """The LightningModule inside wrappers such as DistributedDataParallel."""
    seen = 0
    while not isinstance(model, LightningModule) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
        seen += 1
        if seen > 8:
            break
    return model if isinstance(model, LightningModule) else None


__all__ = ["MixedPrecisionPlugin"]
