"""The optimizer step under loss scaling, as one Trainer-free object.

Per optimizer, a training step moves READY -> UNSCALED -> STEPPED (torch's ``GradScaler`` contract):

* :meth:`MixedPrecisionStep.unscale_` divides the optimizer's gradients by the scale and checks them for inf/NaN
  in one fused pass, agrees on the flag across ranks, and returns it. It is idempotent within a training step, so
  clipping can call it early (manual optimization: ``manual_backward`` -> ``clip_gradients`` -> ``step``) and
  the step does not unscale twice. Its ``.item()`` is the one host sync per optimizer step that deciding
  skip-or-step needs, and the only one the step makes (on CUDA nothing else reads the device).
* :meth:`step` unscales if that has not happened yet, then skips (an overflow anywhere in this training step,
  this optimizer's or an earlier one's) or calls ``optimizer.step()``.
* :meth:`replay` is the closure ``optimizer.step`` gets, as without a plugin: the evaluation that decided the step
  first, a fresh one (unscaled and checked again) at each later call (LBFGS, SAM).
* :meth:`end_training_step` moves the scale once per training step, however many optimizers stepped (Lightning's
  own AMP moves it once per optimizer, which makes the scale grow too fast with GANs).

Costs: with scaling on, one read and write of every gradient (``_amp_foreach_non_finite_check_and_unscale_``).
With scaling off and the guard on (bf16, fp32), a read-only check that rewrites nothing
(:mod:`lightning_mp.numerics.grad_layout`). With scaling off and ``check_finite=False``, nothing at all: no pass over the
gradients and no host sync, as in Lightning's ``bf16-mixed``. Gradients that tile one buffer (the flat FP32
buffer master weights fold into) are passed as one view per buffer, and the lists are cached per optimizer: a
steady-state step runs no Python loop over its parameters (a few C-level ``map`` passes check that nothing moved).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from lightning_mp.numerics import grad_layout, without_grad
from lightning_mp.numerics.distributed import agree_on_overflow_
from lightning_mp.numerics.grad_layout import GradLayout, Grads, optimizer_params
from lightning_mp.numerics.loss_scaler import LossScaler

_STATE_VERSION = 2


class MixedPrecisionStep:
    """Owns the unscale / check / skip-or-step / scale-update sequence of each training step.

    Args:
        scaler: the loss-scale state machine.
        check_finite: check gradients for inf/NaN and skip such steps even when the loss is not scaled.
        fp32_grads: the optimizer must not read 16-bit (float16 / bfloat16) gradients (master weights); such a
            gradient raises when the step reads the gradients (scaling or ``check_finite`` on). Other dtypes
            (float64, complex) are the user's choice and pass.
        reduce_: averages a list of dense gradients across ranks in place (``None`` in a single process, or when
            DDP already averaged them). Every rank passes the same list: a parameter without a gradient gets a
            zero buffer of its own, allocated once and zeroed on each reuse.
        on_overflow: called as ``on_overflow(optimizer)`` when this optimizer's gradients hold an inf/NaN, after
            the flag was read and before the step drops them: the overflow locator reads them there. Never
            called on a clean step.
    """

    def __init__(
        self,
        scaler: LossScaler,
        *,
        check_finite: bool = True,
        fp32_grads: bool = False,
        reduce_: Callable[[list[Tensor]], None] | None = None,
        on_overflow: Callable[[Optimizer], None] | None = None,
    ) -> None:
        self.scaler = scaler
        self.check_finite = check_finite
        self.fp32_grads = fp32_grads
        self.reduce_ = reduce_
        self.on_overflow = on_overflow
        # what a clean step runs: optimizer.step, or a stand-in (lean bf16 steps on rebuilt FP32 masters)
        self.apply: Callable[..., Any] = _optimizer_step
        self._found: dict[int, bool] = {}  # id(optimizer) -> its flag, for the training step in progress
        self._found_inf = False
        self._layouts: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizer -> GradLayout
        self._last: tuple[int, GradLayout | None] = (0, None)  # (id(optimizer), its layout), the last one read
        self._zero_grads: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its zero gradient (reduce_)

    @property
    def in_progress(self) -> bool:
        """Whether an optimizer has been unscaled in the training step in progress."""
        return bool(self._found)

    @property
    def skipping(self) -> bool:
        """Whether the training step in progress skips (or, between steps, whether the last one was skipped)."""
        return self._found_inf if self._found else self.scaler.last_step_skipped

    @without_grad
    def unscale_(self, optimizer: Optimizer) -> bool:
        """Unscale and check this optimizer's gradients once per training step; return whether any is inf/NaN."""
        key = id(optimizer)
        if key in self._found:
            return self._found[key]
        params = optimizer_params(optimizer)
        if self.reduce_ is not None:
            self._reduce(params)
        found = False
        if self.scaler.enabled or self.check_finite:
            grads = self._gradients(optimizer, params)
            if self.scaler.enabled:
                flag = self.scaler.unscale_and_check_(grads.tensors)
            else:
                flag = grad_layout.non_finite_flag(grads.groups)
            found = bool(agree_on_overflow_(flag).item())  # host sync: the one skip-or-step needs
            if found and self.on_overflow is not None:
                self.on_overflow(optimizer)  # only on a skip: the locator reads the gradients before they go
        self._found[key] = found
        self._found_inf = self._found_inf or found
        return found

    def reset(self) -> None:
        """Drop the training step in progress (a fit that failed between the unscale and the scale update): the
        next step starts READY, and an overflow found before the failure does not skip it."""
        self._found, self._found_inf = {}, False

    def forget(self, optimizer: Optimizer) -> None:
        """Let the next :meth:`unscale_` run again (optimizers that re-evaluate a closure inside ``step``)."""
        self._found.pop(id(optimizer), None)

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Skip or apply this optimizer's step; ``None`` when skipped (the optimizer and its state do not move)."""
        self.unscale_(optimizer)
        if self._found_inf:
            optimizer.zero_grad(set_to_none=True)  # the poisoned gradients are dropped
            return None
        return self.apply(optimizer, **kwargs)

    def replay(self, optimizer: Optimizer, first: Any, evaluate: Callable[[], Any], after: Callable[[], None],
               step: int | None = None) -> Callable[[], Any]:
        """The closure ``optimizer.step`` gets once an evaluation (its result: ``first``) decided skip-or-step.

        Its first call returns ``first`` (that evaluation's unscaled gradients are in ``.grad``), so an optimizer that
        calls it once (SGD, Adam) costs no second forward and backward, and returns the loss. Every later call (LBFGS's
        line search, SAM's second point) runs ``evaluate()``, unscales and checks this optimizer's gradients again
        (one more host sync) and calls ``after()`` (the hooks that follow a closure). A non-finite re-evaluation
        raises ``FloatingPointError``: the optimizer has already moved the parameters, the step cannot be skipped."""
        calls = 0

        def closure() -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return first
            result = evaluate()
            self.forget(optimizer)
            if self.unscale_(optimizer):
                raise FloatingPointError(
                    f"Non-finite gradients at step {step} with loss scale {self.scaler.scale:g} when "
                    f"{type(optimizer).__name__} re-evaluated its closure inside step(), after moving the "
                    "parameters: the step cannot be skipped halfway. HINT: lower the learning rate (SAM: rho), "
                    "or the loss scale (a static loss_scale=<number>, or precision='bf16')."
                )
            after()
            return result

        return closure

    def end_training_step(self, step: int | None = None) -> None:
        """Move the scale once for the training step that ends; a no-op if no optimizer was unscaled in it.

        Raises ``FloatingPointError`` (from the scaler) when the run cannot go on."""
        if not self._found:
            return
        found_inf, self._found, self._found_inf = self._found_inf, {}, False
        self.scaler.update(found_inf, step=step)

    # ------------------------------------------------------------------ gradients
    def _gradients(self, optimizer: Optimizer, params: list[Tensor]) -> Grads:
        """This optimizer's gradients as the fused passes read them; the layout is rebuilt only when they moved."""
        key, layout = self._last
        if key != id(optimizer):  # the one-entry cache spares the weak dictionary's Python on every step
            layout = self._layouts.get(optimizer)
        grads = layout.read(params) if layout is not None else None  # checks the parameters: a reused id misses
        if grads is None:
            layout = self._layouts[optimizer] = GradLayout(params, refuse_16_bit=self.fp32_grads)
            grads = layout.read(params)
        self._last = (id(optimizer), layout)
        return grads

    def _reduce(self, params: list[Tensor]) -> None:
        """Average the dense gradients across ranks; every rank reduces the same list (DDP path only)."""
        reducible = []
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = self._zero_grad(p)
            if p.grad is not None and not p.grad.is_sparse:
                reducible.append(p.grad)
        self.reduce_(reducible)

    def _zero_grad(self, p: Tensor) -> Tensor:
        """A zero gradient for ``p``, the same buffer every step (a fresh one costs an allocation and the kernel's
        zeroing of new pages each step), so the layout cache keeps it too."""
        buf = self._zero_grads.get(p)
        if buf is None or buf.shape != p.shape or buf.dtype != p.dtype or buf.device != p.device:
            buf = self._zero_grads[p] = torch.zeros_like(p)
        else:
            buf.zero_()  # the optimizer or the user may have written it since
        return buf

    # ------------------------------------------------------------------ pickling (spawned processes)
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)  # the caches hold weak references and this process's tensors: not sent
        state["_layouts"], state["_zero_grads"], state["_last"] = None, None, (0, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._layouts, self._zero_grads = WeakIdKeyDictionary(), WeakIdKeyDictionary()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version = state.get("version", 1)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            # not a newer format (upgrading would not help): a foreign or damaged state
            raise ValueError(
                f"the checkpoint's loss-scaling state has version={version!r}: allowed is an integer from 1 to "
                f"{_STATE_VERSION}. HINT: the checkpoint is corrupt or was written by another plugin under this "
                "plugin's key; resume from one this plugin wrote."
            )
        if version > _STATE_VERSION:
            raise ValueError(
                f"loss-scaling state version {version!r} is newer than this lightning_mp understands "
                f"(<= {_STATE_VERSION}). HINT: upgrade lightning_mp to resume this checkpoint."
            )
        if "scaler" not in state:
            raise KeyError(
                f"loss-scaling state must have a 'scaler' entry; got keys {sorted(state)}. "
                "HINT: was this checkpoint written by another precision plugin?"
            )
        self.scaler.load_state_dict(state["scaler"])


def _optimizer_step(optimizer: Optimizer, **kwargs: Any) -> Any:
    return optimizer.step(**kwargs)
