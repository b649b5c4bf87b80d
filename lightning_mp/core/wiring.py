"""What a fit installs on the model and its optimizers, and takes off again at its end: the set-up half of
:class:`lightning_mp.core.MixedPrecisionCore` (a base class of it; the step's half is in :mod:`lightning_mp.core.run`).

Everything ``connect`` installs goes into ``_handles``, and ``teardown`` removes each: hooks, the FP32 policy's and
the emulated GEMMs' kernels, the FP8 Linears' forwards, the locator, the autopilot, the schedulers' guard."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_mp.core.skips import LocateOverflow, defer_flags, refuse_lbfgs
from lightning_mp.doctor.locator import OverflowLocator
from lightning_mp.formats import check_device_supports
from lightning_mp.numerics.distributed import agree_on_max_, average_fp32_grads_per_step, world_size
from lightning_mp.numerics.master_weights import MasterWeights
from lightning_mp.numerics.scheduler_guard import SchedulerGuard, WeakSchedulers
from lightning_mp.numerics.sharding import is_sharded
from lightning_mp.policy.policy import refuse_16_bit_batch_norm


def recorded_optimizers(calls: list[tuple[str, tuple]]) -> list[Optimizer]:
    """The optimizers in a core's recorded calls: ``connect``'s and ``watch_optimizers``'."""
    return [o for name, args in calls if name in ("connect", "watch_optimizers")
            for o in (args[2] if name == "connect" else args[0])]


class FitWiring:
    """``convert``, ``connect``, ``guard_schedulers`` and ``teardown``, a base class of
    :class:`~lightning_mp.core.MixedPrecisionCore`: they read the parts its ``__init__`` built (format, scaler,
    step, policy, GEMM choice, FP8 Linears, autopilot) and set the state below, which ``__init__`` starts empty."""

    root: nn.Module | None  # the module whose parameter names the reports and views use
    device_type: str
    sharded: bool
    masters: MasterWeights | None
    locator: OverflowLocator | None
    _handles: list[Any]  # what connect installed, removed at teardown
    _hold: Any  # the policy's kernels, switched on for the whole fit (see forward_context)
    calls: list[tuple[str, tuple]]  # the front end's calls below since the last teardown: a switch replays them

    def convert(self, module: nn.Module) -> nn.Module:
        """Watch ``module``'s parameters as FP32 masters (several calls: several models in one store)."""
        self.calls.append(("convert", (module,)))
        self.sharded = is_sharded(module)
        if self.master_weights or self.lean is not None:  # parameters that become 16-bit copies or bf16 Parameters
            refuse_16_bit_batch_norm(module, self._keeps_fp32, self.policy.ops)
        if self.lean is not None:
            self.lean.convert(module, self._keeps_fp32, self.sharded)
        elif self.master_weights and not self.sharded:
            if self.masters is None:
                self.masters = MasterWeights(self.format.dtype, keep_fp32=self._keeps_fp32)
            self.masters.convert(module)
        return module

    def connect(self, model: nn.Module, root: nn.Module, optimizers: Sequence[Optimizer], schedulers: Sequence[Any],
                hold_kernels: bool = True) -> str:
        """The one-time set-up on the model's device; returns the GEMM verdict for the front end to log.

        ``model`` is what runs the forward (a DDP wrapper, say); ``root`` the module whose names reports use.
        ``hold_kernels=False``: the FP32 policy's and the emulated GEMMs' kernels are registered only for the blocks
        of ``forward_context()`` and the front end's backward (Fabric's, which has no end of fit)."""
        self.calls.append(("connect", (model, root, optimizers, schedulers, hold_kernels)))
        self.root = root
        first = next(model.parameters(), None)
        self.device_type = first.device.type if first is not None else "cpu"
        check_device_supports(self.format, self.device_type)
        # every rank takes the slowest rank's GEMM probe figures: one all-reduce of 4 floats, none in one process
        agree = agree_on_max_ if world_size() > 1 else None  # one process: not even a read of the figures
        verdict = self.gemm.setup(self.device_type, self.format.dtype, hold_kernels, agree) if self.format.is_16bit \
            else ""
        fp8 = self.fp8.attach(root, self.device_type, self.format.dtype, self._keeps_fp32)
        verdict = "\n".join(filter(None, (verdict, fp8)))
        self._handles.extend((self.gemm, self.fp8))  # emulated GEMMs' kernels, FP8 Linears' forwards: until teardown
        refuse_lbfgs(optimizers, self.scaler.dynamic, self.lean is not None)
        self._data_parallel(model)
        self._guard_schedulers(schedulers)
        if self.lean is not None:
            self.lean.watch(optimizers)
            self.step.apply = self.lean.step
        if self.format.is_16bit:
            # the op policy's kernels for the whole fit: backward and checkpointing's recomputation follow it too
            self._hold = self.policy.activate() if hold_kernels else None  # else: forward_context's op_context()
            modules = self.policy.install(model, self.device_type, kernels_active=True)
            self._handles.extend(h for h in (self._hold, modules) if h is not None)
            if self.autopilot is not None:
                self.autopilot.attach(root, self.device_type)
                self._handles.append(self.autopilot)
        defer_flags(self)  # fused optimizers skip on the device, the host reads their flags a step late
        if self.locate_overflows:  # nothing on a clean step; a skip names the first non-finite gradient
            forward = self.locate_overflows == "forward"  # the forward checks from the first step (9-13% of a step)
            locator = self.locator = OverflowLocator(root, input_grads=False, forward=forward)
            self.step.on_overflow = LocateOverflow(self)
            self._handles.append(locator)
        return verdict

    def watch_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Optimizers a front end meets outside ``connect`` (Fabric's, at ``setup_optimizers`` or their first step):
        lean bf16 keeps their FP32 state FP32 through a load, and a schedule's switch keeps their state (each is
        recorded once)."""
        seen = set(map(id, recorded_optimizers(self.calls)))
        new = [o for o in optimizers if id(o) not in seen]
        if new:
            self.calls.append(("watch_optimizers", (new,)))
        if self.lean is not None:
            self.lean.watch(optimizers)

    def data_parallel(self, model: nn.Module) -> None:
        """With master weights, a DDP wrapper's own gradient sync goes off and the step averages the FP32 gradients
        once (:func:`~lightning_mp.numerics.distributed.average_fp32_grads_per_step`); anything else: nothing. From
        ``connect``, or later where the wrapper is made after it (Fabric wraps after ``convert_module``)."""
        self.calls.append(("data_parallel", (model,)))  # a wrapper made after connect (Fabric's)
        self._data_parallel(model)

    def _data_parallel(self, model: nn.Module) -> None:
        if self.masters is not None:
            self.average_per_step(model)

    def average_per_step(self, model: nn.Module) -> None:
        """A DDP wrapper's own gradient sync off until teardown, the step averaging the FP32 gradients once
        (:func:`~lightning_mp.numerics.distributed.average_fp32_grads_per_step`). Master weights need it; a schedule's
        rung without them keeps it where an earlier rung turned DDP's sync off (:mod:`.ladder`)."""
        self._handles.extend(average_fp32_grads_per_step(model, self.step))

    def guard_schedulers(self, schedulers: Sequence[Any]) -> None:
        """With ``skip_scheduler_on_overflow``, these schedulers do not advance right after a skipped step."""
        self.calls.append(("guard_schedulers", (WeakSchedulers(schedulers),)))  # Fabric's plugin.guard_schedulers
        self._guard_schedulers(schedulers)

    def _guard_schedulers(self, schedulers: Sequence[Any]) -> None:
        if self.skip_scheduler_on_overflow and schedulers:
            self._handles.append(SchedulerGuard(schedulers, lambda: self.step.skipping))

    def __getstate__(self) -> dict[str, Any]:
        # a copy (ddp_spawn's pickle, torch.save of a plugin mid-run) is not wired to any fit: no calls to replay
        return {**self.__dict__, "calls": []}

    def teardown(self) -> None:
        """Hooks and kernels out, per-step state dropped: a failed fit leaves nothing for the next one."""
        self.step.settle(stop=False)  # the last step's flag: counted; a stop it would raise comes after the run
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.calls = []
        self.step.on_overflow = None
        self.step.reset()  # a fit that failed mid-step leaves nothing for the next one
        if self.masters is not None:
            self.masters.remove()
            self.masters = None
        if self.lean is not None:
            self.lean.remove()  # the Parameters hold their FP32 masters again
