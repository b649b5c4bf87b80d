"""The optimizer step under loss scaling, as one Trainer-free object.

Per optimizer, a training step moves READY -> UNSCALED -> STEPPED (torch's ``GradScaler`` contract):

* :meth:`MixedPrecisionStep.check_` divides the optimizer's gradients by the scale and checks them for inf/NaN in one
  fused pass and agrees on the flag across ranks; idempotent within a training step, so clipping can call it early
  (manual optimization: ``manual_backward`` -> ``clip_gradients`` -> ``step``). Its ``.item()`` is the one host sync
  of a training step, before the optimizer runs; where the optimizer skips on the device (torch's fused optimizers:
  :mod:`lightning_mp.numerics.deferred` says when the host reads then) the flag stays there. :meth:`unscale_`
  returns it as a bool (a host read, also of a deferred flag).
* :meth:`step` unscales if that has not happened yet, then skips (an overflow anywhere in this training step,
  this optimizer's or an earlier one's) or calls ``optimizer.step()`` (given the flag where it stayed on the device).
* :meth:`replay` is the closure ``optimizer.step`` gets, as without a plugin: the evaluation that decided the step
  first, a fresh one (unscaled and checked again) at each later call (LBFGS, SAM).
* :meth:`end_training_step` moves the scale once per training step, however many optimizers stepped (Lightning's
  own AMP moves it once per optimizer, which makes the scale grow too fast with GANs); by a deferred flag, one step
  late (:meth:`settle`).

Costs: with scaling on, one read and write of every gradient (``_amp_foreach_non_finite_check_and_unscale_``); with
it off and the guard on (bf16, fp32), a read-only check (:mod:`lightning_mp.numerics.grad_layout`; a few CPU
gradients, under 2^16 elements: one fused pass that rewrites each element as itself, fewer torch calls); with both off,
nothing: no pass and no host sync, as in ``bf16-mixed``. Gradients that tile one buffer (master weights' flat FP32
buffer) are passed as one view per buffer, the lists cached per optimizer: no Python loop over the parameters.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mp.numerics import without_grad
from lightning_mp.numerics.deferred import Deferral
from lightning_mp.numerics.distributed import agree_on_overflow_
from lightning_mp.numerics.grad_layout import optimizer_params
from lightning_mp.numerics.loss_scaler import LossScaler
from lightning_mp.numerics.step_grads import StepGradients, few_cpu_grads, fused_flag, non_finite_flag

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
            zero buffer of its own, allocated once and zeroed on each reuse. A ``reduce_`` whose attribute
            ``same_on_every_rank`` is true (:func:`~.distributed.average_across_ranks_`) leaves every rank the same
            gradients, so their inf/NaN flag needs no agreement of its own.
        on_overflow: ``on_overflow(optimizer)`` when this optimizer's gradients hold an inf/NaN, after the flag was
            read on the host, before the optimizer would step (the overflow locator reads them there).
        on_late_skip: ``on_late_skip(step)`` when a flag read a step late says that step was skipped (its log line).
    """

    def __init__(
        self,
        scaler: LossScaler,
        *,
        check_finite: bool = True,
        fp32_grads: bool = False,
        reduce_: Callable[[list[Tensor]], None] | None = None,
        on_overflow: Callable[[Optimizer], None] | None = None,
        on_late_skip: Callable[[int | None], None] | None = None,
    ) -> None:
        self.scaler = scaler
        self.check_finite = check_finite
        self.fp32_grads = fp32_grads
        self.reduce_ = reduce_
        self.on_overflow = on_overflow
        self.on_late_skip = on_late_skip
        self.apply: Callable[..., Any] = _optimizer_step  # or a stand-in: lean bf16 steps on rebuilt FP32 masters
        self._found: dict[int, bool | Tensor] = {}  # id(optimizer) -> its flag (a tensor: left on the device)
        self._found_inf = False  # a skip the host knows of, in the training step in progress
        self._late: Tensor | None = None  # the maximum of the flags left on the device in this training step
        self.deferral = Deferral()  # fused optimizers skip on the device; .enabled=False: the host reads every flag
        self._grads = StepGradients()  # the layouts per optimizer, the zero gradients reduce_ is given

    @property
    def in_progress(self) -> bool:
        """Whether an optimizer has been unscaled in the training step in progress."""
        return bool(self._found)

    @property
    def decided(self) -> bool | None:
        """The training step in progress as the host knows it, reading nothing: skipped, not so far, or ``None``."""
        return True if self._found_inf else (None if self._late is not None else False)

    @property
    def skipping(self) -> bool:
        """Whether the training step in progress skips (or, between steps, whether the last one was skipped); a flag
        still on the device is read: the current step's (a host sync), the last one's copy (:meth:`settle`)."""
        if self._found:
            if self._late is not None:
                self._read_late()
            return self._found_inf
        self.settle()
        return self.scaler.last_step_skipped

    @property
    def steps(self) -> int:
        """Training steps ended, skipped ones included (the scaler's count, plus a step whose flag is unread)."""
        return self.scaler.steps + (self.deferral.pending is not None)

    @without_grad
    def check_(self, optimizer: Optimizer) -> bool | None:
        """Unscale and check this optimizer's gradients once per training step; return :attr:`decided`. The flag is
        read on the host (one sync) unless the optimizer skips on the device (:mod:`lightning_mp.numerics.deferred`)."""
        key = id(optimizer)
        if key in self._found:
            return self.decided
        params = optimizer_params(optimizer)
        # after an all-reduce every rank holds the same gradients, so the flag checked on them is the same too: the
        # agreement's collective (one per step, 15-75 us of the training thread's CPU time on gloo) only where some
        # gradient the check reads did not go through the reduce (a sparse one), or with no reduce (FSDP2's shards)
        agreed = self.reduce_ is not None and self._grads.reduce(params, self.reduce_) and getattr(
            self.reduce_, "same_on_every_rank", False)
        found: bool | Tensor = False
        if self.scaler.enabled or self.check_finite:
            few = few_cpu_grads(params)  # a small CPU model's: as they are, no layout
            grads = self._grads.read(optimizer, params, self.fp32_grads) if few is None else None
            if self.scaler.enabled:
                flag = self.scaler.unscale_and_check_(few if grads is None else grads.tensors)
            else:
                flag = fused_flag(few) if grads is None else non_finite_flag(grads)
            if not agreed:
                flag = agree_on_overflow_(flag)
            if self.apply is _optimizer_step and self.deferral.allows(optimizer):
                found = flag  # no read: the optimizer takes it as a tensor
                self._late = flag if self._late is None else torch.maximum(self._late, flag)
            else:
                found = bool(flag.item())  # host sync: the one skip-or-step needs
                if found and self.on_overflow is not None:
                    self.on_overflow(optimizer)  # only on a skip: the locator reads the gradients there
                if self._late is not None and not found:
                    self._read_late()  # an earlier optimizer's flag stayed on the device: this one steps only if clean
        self._found[key] = found
        self._found_inf = self._found_inf or found is True
        return self.decided

    def unscale_(self, optimizer: Optimizer) -> bool:
        """:meth:`check_`, returning whether this optimizer's gradients hold an inf/NaN (read on the host)."""
        self.check_(optimizer)
        found = self._found[id(optimizer)]
        if isinstance(found, Tensor):
            found = self._found[id(optimizer)] = bool(found.item())  # host sync, asked for
            self._found_inf = self._found_inf or found
        return found

    def _read_late(self) -> None:  # this training step's flags left on the device: a host sync
        self._found_inf, self._late = self._found_inf or bool(self._late.item()), None

    def reset(self) -> None:
        """Drop the training step in progress (a fit that failed mid-step): the next step starts READY."""
        self._found, self._found_inf, self._late = {}, False, None

    def forget(self, optimizer: Optimizer) -> None:
        """Let the next :meth:`unscale_` run again (optimizers that re-evaluate a closure inside ``step``)."""
        self._found.pop(id(optimizer), None)

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Skip (``None``: the optimizer and its state do not move; the gradients stay for the loop's ``zero_grad``)
        or apply this optimizer's step; with the flag on the device the optimizer is called and skips there."""
        self.check_(optimizer)
        if self._found_inf:
            return None
        if not isinstance(self._found[id(optimizer)], Tensor):
            output = self.apply(optimizer, **kwargs)
            self.deferral.stepped_(optimizer)
            return output
        # torch GradScaler's protocol: gradients unscaled already; found_inf: this training step's flags so far (1.0: skip)
        optimizer.grad_scale, optimizer.found_inf = None, self._late
        try:
            return self.apply(optimizer, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf

    def replay(self, optimizer: Optimizer, first: Any, evaluate: Callable[[], Any], after: Callable[[], None],
               step: int | None = None) -> Callable[[], Any]:
        """The closure ``optimizer.step`` gets once an evaluation (its result: ``first``) decided skip-or-step.

        Its first call returns ``first`` (its unscaled gradients are in ``.grad``): an optimizer that calls it once
        (SGD, Adam) costs no second forward and backward. Every later call (LBFGS's line search, SAM's second point)
        runs ``evaluate()``, unscales and checks again (one more host sync) and calls ``after()`` (the hooks after a
        closure). A non-finite re-evaluation raises ``FloatingPointError``: the parameters have moved already."""
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
        """Move the scale once for the training step that ends; a no-op if no optimizer was unscaled in it. A flag
        left on the device picks the next scale there and moves the host at the next step's end (or when asked).

        Raises ``FloatingPointError`` (from the scaler) when the run cannot go on (a deferred flag: one step late)."""
        if not self._found:
            return
        found_inf, late = self._found_inf, self._late
        self._found, self._found_inf, self._late = {}, False, None
        self.settle()  # the step before this one first: the state machine moves in step order
        if late is None or found_inf:
            self.scaler.update(found_inf, step=step)
            return
        self.deferral.defer(self.scaler, late, step)

    def settle(self, stop: bool = True) -> None:
        """Move the host's state machine by the last step's flag if unread: a read of its copy (the deferred read)."""
        self.deferral.settle(self.scaler, self.on_late_skip, stop)

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn, torch.save(trainer): the gradients' caches go (.step_grads)
        self.settle()
        return dict(self.__dict__)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        self.settle()
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
        self.deferral.pending = None  # the state replaced: a flag of the run before it moves nothing
        self.scaler.load_state_dict(state["scaler"])


def _optimizer_step(optimizer: Optimizer, **kwargs: Any) -> Any:
    return optimizer.step(**kwargs)
