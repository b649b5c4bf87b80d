"""The Lightning precision plugin: thin glue from Lightning's hooks to the numerics pieces.

Where each piece runs in one training step (automatic optimization)::

    forward_context        autocast to the 16-bit format + the FP32 op policy
    pre_backward           loss * scale                              (LossScaler.scale_loss)
    post_backward          16-bit grads folded into FP32 master grads (MasterWeights.fold_grads)
    optimizer_step         unscale + inf/NaN check in one fused pass  (LossScaler.unscale_and_check_)
                           -> one host sync to decide skip / step
                           on_before_optimizer_step hooks and clipping see the true FP32 gradients
                           step the masters, re-round the 16-bit params (MasterWeights.copy_to_model)
                           scale update, once per training step       (LossScaler.update)

With manual optimization the scale update waits for the end of ``training_step``, so several optimizers
stepping in one batch use one scale and move the state machine once (Lightning's own AMP updates it once per
optimizer, which makes the scale grow too fast).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any, Callable

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_mp.formats import Format, resolve_precision
from lightning_mp.fp32_policy import DEFAULT_FP32_MODULES, DEFAULT_FP32_OPS, Fp32Policy
from lightning_mp.loss_scaler import (
    DEFAULT_INIT_SCALE,
    DEFAULT_MAX_CONSECUTIVE_SKIPS,
    DEFAULT_MAX_SCALE,
    DEFAULT_MIN_SCALE,
    LossScaler,
)
from lightning_mp.distributed import agree_on_overflow_, average_across_ranks_, world_size
from lightning_mp.master_weights import MasterWeights
from lightning_mp.scheduler_guard import SchedulerGuard

_STATE_VERSION = 1


class MixedPrecisionPlugin(Precision):
    """Mixed precision with FP32 master weights, dynamic loss scaling and an FP32 op policy.

    Args:
        precision: ``"fp16"``, ``"bf16"`` or ``"fp32"`` (aliases: ``"16"``, ``"16-mixed"``, ``"bf16-mixed"``,
            ``"32"``, ``"32-true"``). ``"fp32"`` is a passthrough: bit-identical to a Trainer without the plugin,
            plus the guard that skips steps with non-finite gradients.
        master_weights: store the model's parameters in the 16-bit format and let the optimizer update FP32
            masters (default for fp16 and bf16). ``False`` keeps FP32 parameters and runs the forward under
            autocast, like Lightning's ``16-mixed``/``bf16-mixed``. Ignored for fp32.
        loss_scale: ``"dynamic"``, a positive number (static scale) or ``None`` (no scaling). Default
            ``"dynamic"`` for fp16 and ``None`` for bf16 and fp32.
        init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale,
        max_consecutive_skips: the dynamic scaler's knobs, see :class:`lightning_mp.loss_scaler.LossScaler`.
        fp32_ops: ops that always compute in FP32 inside the training/eval steps (names or torch callables),
            default :data:`lightning_mp.DEFAULT_FP32_OPS`.
        fp32_modules: module classes whose parameters stay FP32 and whose forward runs in FP32,
            default :data:`lightning_mp.DEFAULT_FP32_MODULES` (the norm layers, and the recurrent layers, which
            have no FP16 kernel on many CPUs and carry rounding through every time step).
        skip_scheduler_on_overflow: ``interval="step"`` learning-rate schedulers do not advance on a skipped step
            (Lightning's default moves them on every step, skipped or not). ``trainer.global_step`` still counts
            every training step; :attr:`skipped_steps` says how many were skipped.
    """

    def __init__(
        self,
        precision: str = "bf16",
        *,
        master_weights: bool | None = None,
        loss_scale: str | float | None = "auto",
        init_scale: float = DEFAULT_INIT_SCALE,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = DEFAULT_MIN_SCALE,
        max_scale: float = DEFAULT_MAX_SCALE,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        fp32_ops: Iterable[str | Callable] = DEFAULT_FP32_OPS,
        fp32_modules: Sequence[type[nn.Module]] = DEFAULT_FP32_MODULES,
        skip_scheduler_on_overflow: bool = True,
    ) -> None:
        super().__init__()
        self.format: Format = resolve_precision(precision)
        self.precision = self.format.lightning_precision  # what Lightning's Trainer.precision reports
        if master_weights is not None and not isinstance(master_weights, bool):
            raise ValueError(f"master_weights={master_weights!r} is not allowed: use True, False or None (auto).")
        self.master_weights = self.format.is_16bit and master_weights is not False
        if loss_scale == "auto":
            loss_scale = self.format.default_loss_scale
        self.scaler = LossScaler(
            loss_scale,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            max_consecutive_skips=max_consecutive_skips,
        )
        if not isinstance(skip_scheduler_on_overflow, bool):
            raise ValueError(
                f"skip_scheduler_on_overflow={skip_scheduler_on_overflow!r} is not allowed: use True or False."
            )
        self.skip_scheduler_on_overflow = skip_scheduler_on_overflow
        self.policy = Fp32Policy(fp32_ops, fp32_modules)
        self._masters: MasterWeights | None = None
        self._device_type = "cpu"
        self._module: nn.Module | None = None
        self._lightning_module: LightningModule | None = None
        self._handles: list[Any] = []
        self._reduce_master_grads = False
        self._skip_this_step = False
        self._batch_steps = 0
        self._batch_found_inf = False

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
            main = self._masters.master_of(p) if self._masters is not None else None
            main = p if main is None else main
            if main.grad is not None and (allowed is None or id(main) in allowed):
                yield name, main.grad

    def describe(self) -> str:
        """A Markdown summary of this plugin's settings and its FP32 policy."""
        s = self.scaler
        lines = [
            f"precision: {self.format.name} (compute dtype {self.format.dtype}); master weights: "
            f"{'FP32 masters, 16-bit model' if self.master_weights else 'no (parameters as given)'}",
            f"loss scale: {s.mode!r}, current {s.scale:g}",
        ]
        if s.dynamic:
            lines.append(
                f"  growth x{s.growth_factor:g} every {s.growth_interval} clean steps, backoff x{s.backoff_factor:g}, "
                f"hysteresis {s.hysteresis}, range [{s.min_scale:g}, {s.max_scale:g}]"
            )
        lines.append(f"stop after {s.max_consecutive_skips} skipped steps in a row")
        return "\n".join(lines) + "\n\n" + self.policy.describe()

    # ------------------------------------------------------------------ set-up
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.master_weights:
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
        for opt in optimizers:
            if isinstance(opt, LBFGS) and self.scaler.dynamic:
                raise ValueError(
                    "LBFGS re-evaluates its closure inside step(), so a step with an overflow cannot be skipped: "
                    "loss_scale='dynamic' does not support it. HINT: use a static loss_scale=<number>, or "
                    "precision='bf16' (no scaling needed)."
                )
            if self._masters is not None:
                self._masters.attach(opt)
        if self._masters is not None and hasattr(model, "require_backward_grad_sync") and world_size() > 1:
            # DDP would average the 16-bit gradients of each micro-batch; we average the FP32 master gradients
            # once per step instead (see lightning_mp.distributed). DDP's no_sync() restores the old value, so
            # this stays off for the whole run.
            model.require_backward_grad_sync = False
            self._reduce_master_grads = True
        if self.skip_scheduler_on_overflow:
            step_schedulers = [c.scheduler for c in lr_schedulers if getattr(c, "interval", "epoch") == "step"]
            self._handles.append(SchedulerGuard(step_schedulers, lambda: self.scaler.last_step_skipped))
        if self.format.is_16bit:
            self._handles.append(self.policy.install(model, self._device_type))
        if self._masters is not None and self._lightning_module is not None:
            self._handles.append(
                self._lightning_module.register_state_dict_post_hook(functools.partial(_fp32_state_dict_hook, self))
            )
        return model, optimizers, lr_schedulers

    @override
    def teardown(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._masters is not None:
            self._masters.restore()
            self._masters = None

    # ------------------------------------------------------------------ forward
    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        if not self.format.is_16bit:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        # autocast as well as 16-bit weights: models that build FP32 tensors inside forward still get 16-bit
        # matmuls, and under master weights autocast's weight casts are no-ops (the weights are 16-bit already)
        stack.enter_context(torch.autocast(self._device_type, dtype=self.format.dtype))
        stack.enter_context(self.policy.op_context())
        return stack

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        manual = self._lightning_module is not None and not self._lightning_module.automatic_optimization
        if manual:
            self._batch_steps = 0
            self._batch_found_inf = False
        with self.forward_context():
            yield
        if manual and self._batch_steps:
            self._update_scale(self._batch_found_inf)

    # ------------------------------------------------------------------ backward
    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        return super().pre_backward(self.scaler.scale_loss(tensor), module)

    @override
    def post_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        tensor = super().post_backward(tensor, module)
        if self._masters is not None:
            self._masters.fold_grads()
        return tensor

    # ------------------------------------------------------------------ step
    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            return self._closure_optimizer_step(optimizer, model, closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: Lightning's convention for "skip this batch", not an overflow
            self._after_closure(model, optimizer)
            return None
        found_inf = self._unscale_and_check(optimizer)
        if not model.automatic_optimization:
            # one overflow anywhere in this training_step skips every optimizer stepping after it
            found_inf = found_inf or self._batch_found_inf
            self._batch_found_inf = found_inf
            self._batch_steps += 1
        self._skip_this_step = found_inf
        try:
            self._after_closure(model, optimizer)
        finally:
            self._skip_this_step = False
        output = None
        if found_inf:
            # the optimizer and its state do not move; the poisoned gradients are dropped
            optimizer.zero_grad(set_to_none=True)
        else:
            output = optimizer.step(**kwargs)
            if self._masters is not None:
                self._masters.copy_to_model()
        if model.automatic_optimization:
            self._update_scale(found_inf)
        return output

    def _unscale_and_check(self, optimizer: Optimizer) -> bool:
        if self._masters is not None:
            self._masters.fold_grads()  # grads of a bare loss.backward() that bypassed post_backward
        if self._reduce_master_grads:
            # every rank must reduce the same list: a parameter without a gradient here contributes zeros
            params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            average_across_ranks_([p.grad for p in params])
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        found = agree_on_overflow_(self.scaler.unscale_and_check_(grads))
        return bool(found.item())  # host sync: the one per step that deciding skip-or-step needs

    def _update_scale(self, found_inf: bool) -> None:
        trainer = getattr(self._lightning_module, "_trainer", None)
        self.scaler.update(found_inf, step=trainer.global_step if trainer is not None else None)

    def _closure_optimizer_step(
        self, optimizer: Optimizer, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Optimizers that evaluate the closure several times per step (LBFGS): every evaluation sees the
        current masters in the 16-bit model and leaves unscaled FP32 gradients; a non-finite one stops the run."""

        def evaluate() -> Any:
            if self._masters is not None:
                self._masters.copy_to_model()
            result = closure()
            if self._unscale_and_check(optimizer):
                trainer = model.trainer
                raise FloatingPointError(
                    f"Non-finite gradients at step {trainer.global_step} with loss scale {self.loss_scale:g} inside "
                    "an LBFGS step, which cannot be skipped. HINT: lower the learning rate or the static loss_scale."
                )
            self._after_closure(model, optimizer)
            return result

        output = optimizer.step(closure=evaluate, **kwargs)
        if self._masters is not None:
            self._masters.copy_to_model()
        self.scaler.update(False)
        return output

    @override
    def _clip_gradients(self, model: Any, optimizer: Any, clip_val: Any = None, gradient_clip_algorithm: Any = None):
        if self._skip_this_step:
            return  # the step is skipped: clipping inf/NaN gradients would only compute NaN norms
        super()._clip_gradients(model, optimizer, clip_val, gradient_clip_algorithm)

    # ------------------------------------------------------------------ checkpoints
    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Reseed the masters from the checkpoint's FP32 values (the model was loaded, then rounded to 16 bits),
        and take over the scale of a checkpoint written by Lightning's own ``16-mixed`` (its GradScaler state)."""
        self._load_native_scaler_state(checkpoint)
        module = self._lightning_module
        weights = checkpoint.get("state_dict")
        if self._masters is None or module is None or not weights:
            return
        with torch.no_grad():
            for name, param in module.named_parameters():
                value = self._masters.fp32_value(param)
                saved = weights.get(name)
                if value is not None and saved is not None:
                    value.copy_(saved)
                    if self._masters.master_of(param) is None:
                        param.copy_(saved)  # a frozen param: its 16-bit copy is refreshed here, not by a step
            self._masters.copy_to_model()

    def _load_native_scaler_state(self, checkpoint: dict[str, Any]) -> None:
        native = checkpoint.get("MixedPrecision") or checkpoint.get("native_amp_scaling_state")
        if type(self).__qualname__ in checkpoint or not isinstance(native, dict) or "scale" not in native:
            return
        if not self.scaler.dynamic:
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
        return {"version": _STATE_VERSION, "precision": self.format.name, "scaler": self.scaler.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "scaler" not in state_dict:
            raise KeyError(
                f"MixedPrecisionPlugin state must have a 'scaler' entry; got keys {sorted(state_dict)}. "
                "HINT: was this checkpoint written by another precision plugin?"
            )
        self.scaler.load_state_dict(state_dict["scaler"])


def _fp32_state_dict_hook(
    plugin: MixedPrecisionPlugin, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any
) -> None:
    """Checkpoints hold the FP32 masters, not the rounded 16-bit parameters, so a checkpoint of a bf16 run
    loads into a plain FP32 model, and a resumed run continues from exactly the values it stopped at."""
    masters = plugin._masters
    if masters is None:
        return
    for name, param in module.named_parameters(remove_duplicate=False):
        key = prefix + name
        if key in state_dict:
            value = masters.fp32_value(param)
            if value is not None:
                state_dict[key] = value


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
