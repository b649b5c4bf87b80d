"""One run's numerics, as one object that both front ends (the Trainer plugin and the Fabric plugin) hold.

Where each piece runs in a training step (the front ends only map their framework's hooks onto these calls)::

    begin(force)          the next forward refreshes the 16-bit copies             (MasterWeights.begin)
    forward_context()     autocast to the 16-bit format + GEMM emulation; each module's forward reads its copies;
                          the FP32 op policy's kernels are active for the whole fit (connect -> teardown)
    scale_loss(loss)      loss * scale                                              (LossScaler.scale_loss)
    backward_context()    the backward's GEMMs emulated as the forward's
    fold()                the copies' 16-bit gradients into the Parameters' FP32 .grad (MasterWeights.fold_grads)
    unscale_(optimizer)   unscale + inf/NaN check, one host sync (fused optimizers: none); the locator names a skip
    step(optimizer)       skip, or step on the FP32 Parameters (lean bf16: on rebuilt FP32 masters, LeanBf16.step)
    end_training_step()   the scale moves once; a skipped step is logged with where it went non-finite

What a fit installs before its first step and removes after its last (``convert``, ``connect``, ``teardown``) is in
:mod:`lightning_mp.core.wiring`; what a forward computes in, in :mod:`lightning_mp.core.contexts`.

Nothing here imports Lightning: the front ends pass the model, the optimizers, the schedulers, the global step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.core.autopilot import Autopilot, split_auto
from lightning_mp.core.contexts import forward_context
from lightning_mp.core.skips import not_resumed, skip_line, stop_error
from lightning_mp.core.wiring import FitWiring
from lightning_mp.doctor.locator import OverflowLocator
from lightning_mp.doctor.report import OverflowReport
from lightning_mp.formats import Format, resolve_precision
from lightning_mp.fp8 import Fp8Linears, Fp8Settings
from lightning_mp.gemm.emulation import GemmEmulation
from lightning_mp.numerics.grad_layout import named_grads, optimizer_params
from lightning_mp.numerics.lean import lean_bf16
from lightning_mp.numerics.loss_scaler import LossScaler, ScalerSettings
from lightning_mp.numerics.master_weights import MasterWeights
from lightning_mp.numerics.step import MixedPrecisionStep
from lightning_mp.policy.policy import BF16_FP32_OPS, DEFAULT_FP32_OPS, Fp32Policy
from lightning_mp.validation import check_bool, check_int

log = logging.getLogger("lightning_mp.plugin")  # the name users filter on for the skip lines


class MixedPrecisionCore(FitWiring):
    """The numerics of one run: format, loss scaler, step, master weights, FP32 policy, GEMM choice, locator.
    The arguments are :class:`lightning_mp.MixedPrecisionPlugin`'s; ``scaler`` and ``fp8`` hold their knobs."""

    def __init__(
        self,
        precision: str,
        *,
        master_weights: bool | str | None,
        loss_scale: str | float | None,
        fp32_ops: Iterable[Any] | None,
        fp32_modules: str | Sequence[type[nn.Module] | str],
        calibration_steps: int,
        optimizer_state_dtype: torch.dtype | None,
        parity_guard: float,
        skip_scheduler_on_overflow: bool,
        check_finite: bool,
        locate_overflows: bool | str,
        gemm: str,
        scaler: ScalerSettings,
        fp8: Fp8Settings = Fp8Settings(),
    ) -> None:
        self.format: Format = resolve_precision(precision)
        self.lean = lean_bf16(self.format, master_weights, optimizer_state_dtype, parity_guard)
        check_bool("skip_scheduler_on_overflow", skip_scheduler_on_overflow)
        check_bool("check_finite", check_finite)
        check_int("calibration_steps", calibration_steps, 0, why="with fp32_modules='auto', training steps measured")
        check_bool("locate_overflows", locate_overflows, also=("forward", "the forward checks from the first step"))
        self.master_weights = self.format.is_16bit and master_weights is not False and self.lean is None
        self.skip_scheduler_on_overflow = skip_scheduler_on_overflow
        self.check_finite = check_finite
        self.locate_overflows = locate_overflows
        if loss_scale == "auto":
            loss_scale = self.format.default_loss_scale
        self.scaler = LossScaler.from_settings(loss_scale, scaler)
        classes, auto = split_auto(fp32_modules)
        default_ops = BF16_FP32_OPS if self.format.dtype == torch.bfloat16 else DEFAULT_FP32_OPS  # bf16: FP32's range
        self.policy = Fp32Policy(default_ops if fp32_ops is None else fp32_ops, classes)
        self.autopilot = Autopilot(self.format, calibration_steps, self.policy.keeps_fp32) if auto else None
        self.gemm = GemmEmulation(gemm)
        self.fp8 = Fp8Linears(self.format.name, fp8, calibration_steps)  # "fp8": bf16, chosen Linears' GEMMs in FP8
        self.step = MixedPrecisionStep(self.scaler, check_finite=check_finite, fp32_grads=self.master_weights)
        self.last_overflow: OverflowReport | None = None
        # set by convert and connect, cleared by teardown (FitWiring)
        self.masters: MasterWeights | None = None
        self.locator: OverflowLocator | None = None
        self.device_type = "cpu"
        self.sharded = False
        self.root: nn.Module | None = None  # the module whose parameter names the reports and views use
        self._handles: list[Any] = []  # what connect installed, removed at teardown
        self.calls: list[tuple[str, tuple]] = []  # convert/connect/... as the front end made them (core.ladder)
        self._hold: Any = None  # the policy's kernels, switched on for the whole fit (see forward_context)

    # ------------------------------------------------------------------ the step
    def begin(self, force: bool) -> None:
        """A forward follows: the copies are refreshed at the first hooked module (``force``: every trainable one,
        since a write through ``.data`` moves no version counter)."""
        if self.autopilot is not None and self.autopilot.pending and self.autopilot.apply() and self.masters is not None:
            self.masters.rebuild()  # the moved modules' parameters keep no 16-bit copy from now on
        if self.masters is not None:
            self.masters.begin(force)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Autocast, the FP32 policy and the GEMMs' emulation for the forward (:func:`~.contexts.forward_context`)."""
        return forward_context(self.format, self.device_type, self.policy, self._hold, self.gemm)

    def backward_context(self) -> contextlib.AbstractContextManager:
        """The backward's GEMMs (grad @ W, x^T @ grad, the attention backward) under the forward's emulation."""
        return self.gemm.context()

    def before_backward(self) -> None:
        """Lean bf16: gradients this backward would add to in bf16 (an earlier micro-batch's) become FP32 first."""
        if self.lean is not None:
            self.lean.before_backward()

    def before_clipping(self, optimizer: Optimizer) -> None:
        """Lean bf16: clipping reads and scales FP32 gradients (the step then reads those), as over FP32 masters."""
        if self.lean is not None:
            self.lean.before_clipping(optimizer)

    def scale_loss(self, loss: Tensor) -> Tensor:
        if self.locator is not None:
            self.locator.note_loss(loss)  # a reference; read only if the step is skipped (a non-finite loss)
        return self.scaler.scale_loss(loss)

    def fold(self) -> None:
        """The copies' 16-bit gradients into the Parameters' FP32 ``.grad`` (after each backward; idempotent)."""
        if self.masters is not None:
            self.masters.fold_grads()

    def unscale_(self, optimizer: Optimizer) -> bool | None:
        """Unscale and check once per training step; whether the step is skipped (``None``: on the device)."""
        self.fold()  # a bare loss.backward() that bypassed the front end's backward
        return self.step.check_(optimizer)

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Skip (``None``) or step; the stepped parameters' copies are refreshed at the next forward.

        ``closure`` (from :meth:`replay_closure`) goes to ``optimizer.step`` as without a plugin; lean bf16 steps
        bucket by bucket, where a closure cannot re-run, so there it is only called once for the step's result."""
        if closure is not None and self.lean is None:
            kwargs["closure"] = closure
        output = self.step.step(optimizer, **kwargs)
        if closure is not None and self.lean is not None and not self.step.skipping:
            output = closure()  # the evaluation that decided the step: the loss, at no cost
        if self.masters is not None:
            self.masters.mark_stale(optimizer_params(optimizer))
        return output

    def end_training_step(self, step: int | None, rank_zero: bool = True) -> None:
        """Move the scale once; on a skipped step, say where it overflowed (the locator's one read-back)."""
        report, self._rank_zero = None, rank_zero
        self.step.settle()  # the step before this one first (a flag read late): its line, then this step's scale
        if self.step.in_progress and self.step.decided:  # a flag left on the device: read a step late (defer_flags)
            report = self.locator.report() if self.locator is not None else None
            self.last_overflow = report or self.last_overflow
            if self.locator is not None:
                self.locator.check_forward = True  # armed at the first skip: names a forward overflow next time
            if rank_zero:
                log.warning(skip_line(step, self.scaler.scale, report))
            located = report is not None and report.phase == "forward" and report.module is not None
            if self.autopilot is not None and located:
                self.autopilot.demote(report)  # a proposal: the ranks agree in end_step
        if self.autopilot is not None and self.step.in_progress:
            self.autopilot.end_step(step, skipped=bool(self.step.decided))  # the agreement: every rank, same steps
        self.fp8.end_step(self.step.in_progress)  # fp8_modules='auto': calibration ends on every rank at one step
        try:
            self.step.end_training_step(step)
        except FloatingPointError as err:
            if report is None:
                raise
            raise stop_error(err, report) from err
        finally:
            if self.locator is not None:
                self.locator.begin_step()

    def replay_closure(self, optimizer: Optimizer, first: Any, closure: Callable[[], Any],
                       after_closure: Callable[[], None], step: int | None) -> Callable[[], Any]:
        """The closure ``optimizer.step`` gets (:meth:`MixedPrecisionStep.replay`): a re-evaluation reads copies of
        the parameters the optimizer moved and leaves unscaled FP32 gradients, which ``after_closure`` sees."""

        def evaluate() -> Any:
            self.begin(force=True)  # the optimizer moved the masters in place: refresh the copies
            result = closure()
            self.fold()  # a bare loss.backward() inside the closure
            return result

        return self.step.replay(optimizer, first, evaluate, after_closure, step)

    # ------------------------------------------------------------------ what the front ends show
    def named_grads(self, optimizer: Optimizer | None = None) -> Iterator[tuple[str, Tensor]]:
        """(parameter name, FP32 gradient the optimizer reads), for one optimizer's parameters or all of them."""
        return named_grads(self.root, optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The plugin's checkpoint state: the format, the scaler, and the autopilot's decisions."""
        state = {"precision": self.format.name, **self.step.state_dict(), **self.fp8.state_dict()}
        if self.autopilot is not None:
            state["auto_fp32_modules"] = self.autopilot.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step.load_state_dict(state)
        self.fp8.load_state_dict(state)  # fp8_modules='auto''s decisions
        if self.autopilot is not None and "auto_fp32_modules" in state:
            self.autopilot.load_state_dict(state["auto_fp32_modules"])
        elif state.get("auto_fp32_modules", {}).get("modules"):
            log.warning(not_resumed(state["auto_fp32_modules"]["modules"]))

    def _keeps_fp32(self, module: nn.Module) -> bool:
        return self.policy.keeps_fp32(module) or (self.autopilot is not None and self.autopilot.keeps(module))

