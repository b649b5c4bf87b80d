"""The Fabric precision plugin: Fabric's ``Precision`` hooks mapped onto the pieces the Trainer plugin uses.

Where each piece runs in one iteration of a Fabric loop::

    fabric.setup(model, opt)  convert_module: the model's FP32 parameters are the masters         (MasterWeights)
    model(x)                  forward_context, which Fabric's module wrapper enters around forward:
                                16-bit copies refreshed where their masters changed            (MasterWeights.begin)
                                autocast to the 16-bit format + the FP32 op policy + the GEMM emulation
                                floating outputs come back as FP32 (as from Fabric's own MixedPrecision),
                                so a loss computed in the loop, outside autocast, is an FP32 loss
    fabric.backward(loss)     backward: loss * scale                                          (LossScaler.scale_loss)
                              post_backward: the copies' 16-bit grads folded into FP32 .grad  (MasterWeights.fold_grads)
    fabric.clip_gradients     unscale_gradients: unscale + inf/NaN check, one host sync   (MixedPrecisionStep.unscale_)
                                clipping sees the true FP32 gradients
    optimizer.step()          optimizer_step: unscale (if clipping did not), skip or step (MixedPrecisionStep.step)
                                one scale update per optimizer.step()         (MixedPrecisionStep.end_training_step)

The model's Parameters hold their FP32 masters at every moment, so the optimizer (and its state),
``model.state_dict()``, ``fabric.save``/``fabric.load`` (also right after a forward whose loss is never
back-propagated), clipping and anything the loop reads see exact FP32 weights. The first forward after an
``optimizer.step()`` refreshes every trainable copy (a write through ``.data`` after the step is seen); other
forwards refresh the copies whose masters changed, so two forwards through one model in one graph (a GAN's
discriminator on real and fake data) share their copies.

Fabric has no ``connect`` hook and calls ``convert_module`` before it moves the model to its device, so the one-time
set-up that needs the device (device check, GEMM verdict, FP32 module hooks, overflow locator) runs on the first
forward, through the same code as the Trainer plugin's ``connect``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Generator, Iterator
from typing import Any

import torch
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.distributed import world_size
from lightning_mp.formats import HALF_DTYPES
from lightning_mp.plugin import MixedPrecisionPlugin as _TrainerPlugin
from lightning_mp.scheduler_guard import SchedulerGuard


class MixedPrecisionPlugin(_TrainerPlugin):
    """Mixed precision with FP32 master weights, dynamic loss scaling and an FP32 op policy, for Fabric.

    ``Fabric(plugins=[MixedPrecisionPlugin("bf16")])``. The arguments, their defaults and the read-only state
    (``loss_scale``, ``skipped_steps``, ``last_step_skipped``, ``last_step_scale``, ``optimizer_steps``,
    ``last_overflow``, ``step``, ``named_grads()``, ``named_fp32_parameters()``, ``describe()``) are those of
    :class:`lightning_mp.MixedPrecisionPlugin`; the numerics are the same objects. What differs in a Fabric loop:

    * The scale moves once per ``optimizer.step()`` (Fabric has no training step around several optimizers, so a
      loop with two optimizers moves it twice per iteration, as Fabric's own ``MixedPrecision`` does), and
      :attr:`optimizer_steps` counts those calls, skipped ones included.
    * ``fabric.clip_gradients`` on a step that will be skipped clips nothing and returns a norm of 0 (the
      gradients hold inf/NaN; ``clip_grad_norm_`` would raise with Fabric's default ``error_if_nonfinite=True``).
    * ``skip_scheduler_on_overflow`` applies to the schedulers passed to :meth:`guard_schedulers` (a Fabric
      scheduler is stepped by the loop, and the plugin never sees it otherwise).
    * The plugin's state is saved only when the loop puts it in the checkpoint:
      ``fabric.save(path, {"model": model, "optimizer": opt, "precision": plugin})`` and the same dict for
      ``fabric.load``. A checkpoint of Fabric's own ``MixedPrecision("16-mixed")`` (its GradScaler state) is taken
      over too.
    * ``optimizer.step(closure=...)`` (LBFGS) is not supported.
    * One process only with master weights: several ranks are refused at the first forward (Fabric's DDP would
      average each micro-batch's 16-bit gradients, not the FP32 ones once per step). ``master_weights=False`` is
      not refused, but has no multi-process test yet.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: list[nn.Module] = []  # converted modules whose device set-up waits for the first forward
        self._listeners: list[Any] = []  # PrecisionMonitor objects, told about every optimizer step
        self._force_refresh = True  # the next forward refreshes every trainable copy (set by optimizer steps)

    __init__.__signature__ = inspect.signature(_TrainerPlugin.__init__)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ set-up
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        # several fabric.setup() calls (a GAN's two models) share one store: it grows with every module
        if self._masters is not None:
            self._masters.convert(module)
        else:
            super().convert_module(module)
        self._pending.append(module)
        return module

    def _set_up_pending(self) -> None:
        """The Trainer plugin's ``connect`` for the modules set up since the last forward, now on their device."""
        if not self._pending:
            return
        modules, self._pending = self._pending, []
        if self._masters is not None and world_size() > 1:
            raise NotImplementedError(
                f"lightning_mp.fabric.MixedPrecisionPlugin(precision={self.format.name!r}) with master weights runs "
                f"in one process; this one has {world_size()} ranks. HINT: pass master_weights=False (autocast with "
                "the same loss scaling and skipping, the flag agreed across ranks), or use the Trainer plugin with "
                "strategy='ddp'."
            )
        root = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
        _TrainerPlugin.connect(self, root, [], [])

    @override
    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any:
        raise TypeError(
            "lightning_mp.fabric.MixedPrecisionPlugin maps Fabric's hooks and cannot drive a Trainer. "
            "HINT: use `Trainer(plugins=[lightning_mp.MixedPrecisionPlugin(...)])` with the same arguments."
        )

    def guard_schedulers(self, *schedulers: Any) -> None:
        """Make ``scheduler.step()`` a no-op right after a skipped ``optimizer.step()``, for the learning-rate
        schedulers the loop steps once per optimizer step (with ``skip_scheduler_on_overflow=True``, the default;
        otherwise nothing changes). The schedulers stay what they were for ``isinstance`` and ``state_dict()``."""
        if self.skip_scheduler_on_overflow:
            self._handles.append(SchedulerGuard(list(schedulers), lambda: self._step.skipping))

    @override
    def teardown(self) -> None:
        super().teardown()
        self._pending.clear()

    def _global_step(self) -> int:
        """The optimizer step the messages name: Fabric has no global step, so this plugin's own count."""
        return self.scaler.steps

    # ------------------------------------------------------------------ forward
    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        return self._forward_context()

    @contextlib.contextmanager
    def _forward_context(self) -> Generator[None, None, None]:
        self._set_up_pending()
        self._begin(force=self._force_refresh)
        self._force_refresh = False
        with super().forward_context():
            yield

    @override
    def convert_output(self, data: Any) -> Any:
        if not self.format.is_16bit:
            return data
        return apply_to_collection(data, function=_to_fp32, dtype=Tensor)

    # ------------------------------------------------------------------ backward
    @override
    def pre_backward(self, tensor: Tensor, module: nn.Module | None) -> None:  # type: ignore[override]
        return None  # Fabric ignores what pre_backward returns: the loss is scaled in backward

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any
    ) -> None:
        # the backward's GEMMs run under the same emulation as the forward's
        with self.gemm.context():
            FabricPrecision.backward(self, self.scaler.scale_loss(tensor), model, *args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: nn.Module | None) -> None:  # type: ignore[override]
        self._fold()

    # ------------------------------------------------------------------ step
    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        self._fold()  # a bare loss.backward() in the loop
        self._step.unscale_(optimizer)

    @override
    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:
        if self._step.in_progress and self._step.skipping:
            # the step is skipped: clipping inf/NaN gradients would raise or compute NaN norms, and torch's
            # clip_grad_value_ fails on an empty list; a zero gradient clips to a norm of 0 and changes nothing
            return iter((_zero_grad_tensor(optimizer),))
        return FabricPrecision.main_params(self, optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if kwargs.get("closure") is not None:
            raise ValueError(
                f"optimizer.step(closure={kwargs['closure']!r}): closures are not supported by "
                "lightning_mp.fabric.MixedPrecisionPlugin (the gradients must be unscaled and checked before the "
                "optimizer reads them, and a closure computes them inside step()). HINT: use an optimizer without a "
                "closure, or the Trainer plugin, which runs LBFGS with a static loss_scale or bf16."
            )
        self._fold()
        self._step.unscale_(optimizer)
        for listener in self._listeners:
            listener.before_optimizer_step(optimizer)  # true FP32 gradients, also on a step about to be skipped
        output = self._step.step(optimizer, **kwargs)
        self._stepped(optimizer)
        self._force_refresh = True
        self._end_training_step()
        for listener in self._listeners:
            listener.after_optimizer_step(optimizer)
        return output


def _zero_grad_tensor(optimizer: Optimizer) -> Tensor:
    first = next((p for group in optimizer.param_groups for p in group["params"]), None)
    t = torch.zeros((), device=first.device if first is not None else "cpu")
    t.grad = torch.zeros_like(t)
    return t


def _to_fp32(t: Tensor) -> Tensor:
    return t.float() if t.dtype in HALF_DTYPES else t


__all__ = ["MixedPrecisionPlugin"]
