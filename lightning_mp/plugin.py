"""The Lightning precision plugin: thin glue from Lightning's hooks to the numerics pieces.

Where each piece runs in one training step (automatic optimization)::

    train_step_context     16-bit copies swapped into the parameters (MasterWeights.swap_in)
                           autocast to the 16-bit format + the FP32 op policy
    pre_backward           loss * scale                                      (LossScaler.scale_loss)
    post_backward          FP32 values back, 16-bit grads folded into FP32    (MasterWeights.swap_out)
    optimizer_step         unscale + inf/NaN check, one host sync             (MixedPrecisionStep.unscale_)
                           on_before_optimizer_step hooks and clipping see the true FP32 gradients
                           skip, or step on the FP32 parameters               (MixedPrecisionStep.step)
                           scale update, once per training step               (MixedPrecisionStep.end_training_step)

Outside the forward and backward the model's parameters hold their FP32 master values, so every Lightning
feature and callback sees and changes exact FP32 weights (see :mod:`lightning_mp.master_weights`). With manual
optimization the scale update waits for the end of ``training_step``, so several optimizers stepping in one
batch use one scale and move the state machine once.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any, Callable

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_mp.distributed import average_across_ranks_, world_size
from lightning_mp.formats import Format, resolve_precision
from lightning_mp.fp32_policy import DEFAULT_FP32_MODULES, DEFAULT_FP32_OPS, Fp32Policy
from lightning_mp.gemm_emulation import GemmEmulation
from lightning_mp.loss_scaler import LossScaler
from lightning_mp.master_weights import MasterWeights
from lightning_mp.overflow_locator import OverflowLocator, OverflowReport
from lightning_mp.scheduler_guard import SchedulerGuard
from lightning_mp.sharding import fsdp_mp_policy, is_sharded
from lightning_mp.step import MixedPrecisionStep
from lightning_mp.validation import check_bool

log = logging.getLogger(__name__)


class MixedPrecisionPlugin(Precision):
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
            the ``FloatingPointError`` that stops a run. Checks stay on the device and are read only on a skipped
            step; ``False`` removes the hooks and their cost.
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

    # ------------------------------------------------------------------ read-only state
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
        if module is None or (self._masters is not None and self._masters.swapped_in):
            return
        allowed = None if optimizer is None else {id(p) for g in optimizer.param_groups for p in g["params"]}
        for name, p in module.named_parameters():
            if p.grad is not None and (allowed is None or id(p) in allowed):
                yield name, p.grad

    def named_fp32_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """(name, FP32 value) of every parameter, also during the forward/backward when the module holds 16-bit
        copies: the documented way for callbacks (EMA, weight averaging) to read exact values at any time."""
        module = self._lightning_module or self._module
        if module is None:
            return
        for name, p in module.named_parameters():
            yield name, self._masters.fp32_value(p) if self._masters is not None else p.detach()

    def describe(self) -> str:
        """A Markdown summary of this plugin's settings and its FP32 policy."""
        s = self.scaler
        lines = [
            f"precision: {self.format.name} (compute dtype {self.format.dtype}); master weights: "
            f"{'FP32 parameters, 16-bit copies for forward/backward' if self.master_weights else 'no (autocast only)'}",
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
        _check_device_supports(self.format, self._device_type)
        if self.format.is_16bit:
            rank_zero_info(self.gemm.setup(self._device_type, self.format.dtype))
        if self.scaler.dynamic and any(isinstance(opt, LBFGS) for opt in optimizers):
            raise ValueError(
                "LBFGS re-evaluates its closure inside step(), so a step with an overflow cannot be skipped: "
                "loss_scale='dynamic' does not support it. HINT: use a static loss_scale=<number>, or "
                "precision='bf16' (no scaling needed)."
            )
        if self._masters is not None and hasattr(model, "require_backward_grad_sync") and world_size() > 1:
            # DDP would average the 16-bit gradients of each micro-batch; we average the FP32 gradients once per
            # step instead (see lightning_mp.distributed). DDP's no_sync() restores the old value, so this stays
            # off for the whole run.
            model.require_backward_grad_sync = False
            self._step.reduce_ = average_across_ranks_
        if self.skip_scheduler_on_overflow:
            step_schedulers = [c.scheduler for c in lr_schedulers if getattr(c, "interval", "epoch") == "step"]
            self._handles.append(SchedulerGuard(step_schedulers, lambda: self._step.skipping))
        if self.format.is_16bit:
            self._handles.append(self.policy.install(model, self._device_type))
        if self.locate_overflows:
            # parameter gradients only in the backward: checking every activation gradient too costs ~1.5% more
            # step time on the demo GPT (bf16, CPU); parameter-free modules are then named by the nearest
            # parameter the overflow reaches
            self._locator = OverflowLocator(self._lightning_module or model, input_grads=False)
            self._handles.append(self._locator)
        return model, optimizers, lr_schedulers

    @override
    def teardown(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._masters is not None:
            self._masters.release()
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

    def _swap_in(self) -> None:
        if self._masters is not None:
            self._masters.swap_in()

    def _swap_out(self) -> None:
        if self._masters is not None:
            self._masters.swap_out()

    def _consumed(self, optimizer: Optimizer) -> None:
        if self._masters is not None:
            self._masters.mark_consumed(p for group in optimizer.param_groups for p in group["params"])

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        self._swap_in()  # swapped out again by the backward (post_backward)
        with self.forward_context():
            yield
        if self._lightning_module is not None and not self._lightning_module.automatic_optimization:
            self._swap_out()  # a training_step without backward
            self._end_training_step()

    @contextlib.contextmanager
    def _eval_step_context(self) -> Generator[None, None, None]:
        self._swap_in()
        try:
            with self.forward_context():
                yield
        finally:
            self._swap_out()

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
        self._swap_out()  # before on_after_backward: hooks see FP32 gradients on the module's parameters
        return super().post_backward(tensor, module)

    # ------------------------------------------------------------------ step
    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            return self._closure_optimizer_step(optimizer, model, closure, **kwargs)
        closure_result = closure()
        self._swap_out()  # a bare loss.backward() that bypassed post_backward, or no backward at all
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: Lightning's convention for "skip this batch", not an overflow
            self._after_closure(model, optimizer)
            self._consumed(optimizer)
            return None
        self._step.unscale_(optimizer)
        self._after_closure(model, optimizer)  # hooks and clipping: true FP32 gradients
        output = self._step.step(optimizer, **kwargs)
        self._consumed(optimizer)
        if model.automatic_optimization:
            self._end_training_step()
        return output

    def _end_training_step(self) -> None:
        """Move the scale once; on a skipped step, say where it overflowed (the locator's one read-back)."""
        report = None
        if self._step.in_progress and self._step.skipping:
            report = self._locator.report() if self._locator is not None else None
            self._last_overflow = report or self._last_overflow
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
        self._swap_out()
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
            self._swap_out()
            self._step.forget(optimizer)
            if self._step.unscale_(optimizer):
                raise FloatingPointError(
                    f"Non-finite gradients at step {self._global_step()} with loss scale {self.loss_scale:g} "
                    "inside an LBFGS step, which cannot be skipped. HINT: lower the learning rate or the static "
                    "loss_scale."
                )
            self._after_closure(model, optimizer)
            self._consumed(optimizer)  # the next evaluation zeroes them
            return result

        output = optimizer.step(closure=evaluate, **kwargs)
        self._end_training_step()  # never a skip here (a non-finite evaluation raised); resets the locator
        return output

    # ------------------------------------------------------------------ checkpoints
    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Take over the scale of a checkpoint written by Lightning's own ``16-mixed`` (its GradScaler state).

        The model's weights need nothing here: Lightning loads them into the FP32 parameters before the plugin
        makes any 16-bit copy, so a resumed run continues from exactly the values it stopped at."""
        native = checkpoint.get("MixedPrecision") or checkpoint.get("native_amp_scaling_state")
        if type(self).__qualname__ not in checkpoint and isinstance(native, dict):
            self._take_gradscaler_state(native)

    def _take_gradscaler_state(self, native: dict[str, Any]) -> None:
        if "scale" not in native or not self.scaler.dynamic:
            return  # a static or disabled scaler keeps its configured scale
        scale = float(native["scale"])
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"the checkpoint's GradScaler scale {scale!r} is not a positive finite number.")
        self.scaler.load_state_dict(
            {
                "mode": "dynamic",
                "scale": scale,
                "growth_tracker": int(native.get("_growth_tracker", 0)),
                "hysteresis_tracker": self.scaler.hysteresis,
                "skipped_steps": 0,
            }
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.format.name, **self._step.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "scaler" not in state_dict and "scale" in state_dict and "_growth_tracker" in state_dict:
            # Lightning's deprecated `precision.MixedPrecisionPlugin` alias writes its GradScaler state under the
            # same key as this class
            self._take_gradscaler_state(state_dict)
            return
        self._step.load_state_dict(state_dict)


def _check_device_supports(fmt: Format, device_type: str) -> None:
    """Fail at setup, not mid-run, when the device cannot compute in the requested format."""
    if not fmt.is_16bit:
        return
    if not torch.amp.is_autocast_available(device_type):
        raise RuntimeError(
            f"precision={fmt.name!r} needs autocast on the {device_type!r} device, which this torch build does not "
            "support. HINT: use precision='fp32', or run on 'cpu' or 'cuda'."
        )
    if device_type == "cuda" and fmt.dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise RuntimeError(
            f"precision='bf16' was requested but {torch.cuda.get_device_name()} has no bfloat16 support. "
            "HINT: use precision='fp16' (with dynamic loss scaling) on this GPU."
        )


def _rank_zero() -> bool:
    return getattr(rank_zero_only, "rank", 0) == 0


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
