"""The read-only state both front ends show, read from the :class:`MixedPrecisionCore` they hold."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.core.arguments import make_core, screen_arguments
from lightning_mp.core.ladder import Ladder, switch
from lightning_mp.core.run import MixedPrecisionCore
from lightning_mp.core.scaler_view import ScalerView
from lightning_mp.doctor.report import OverflowReport
from lightning_mp.formats import Format
from lightning_mp.fp8 import DEFAULT_FP8_MODULES, DEFAULT_FP8_RECIPE
from lightning_mp.gemm.emulation import GemmEmulation
from lightning_mp.numerics.loss_scaler import LossScaler, ScalerSettings
from lightning_mp.numerics.sharding import fsdp_mp_policy
from lightning_mp.numerics.step import MixedPrecisionStep
from lightning_mp.policy.ops import DEFAULT_FP32_MODULES
from lightning_mp.policy.policy import Fp32Policy

_S = ScalerSettings  # the scaler's knobs and their defaults are declared once, there

class CoreViews:
    """What both front ends share: the constructor (one signature, every knob by name; the scaler's knobs and
    defaults come from :class:`~lightning_mp.numerics.loss_scaler.ScalerSettings`) and the read-only state, read
    from their ``core``."""

    core: MixedPrecisionCore

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        screen_arguments(cls, args, kwargs, cls.__init__ is CoreViews.__init__)
        return super().__new__(cls)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__signature__ = _init_signature(cls)

    def __init__(
        self,
        precision: str = "bf16",
        *,
        master_weights: bool | str | None = None,
        loss_scale: str | float | None = "auto",
        fp32_ops: Iterable[str | Callable] | None = None,
        fp32_modules: str | Sequence[type[nn.Module] | str] = DEFAULT_FP32_MODULES,
        calibration_steps: int = 10,
        optimizer_state_dtype: torch.dtype | None = None,
        parity_guard: float = 0.0,
        skip_scheduler_on_overflow: bool = True,
        check_finite: bool = True,
        locate_overflows: bool | str = True,
        gemm: str = "auto",
        fp8_recipe: str = DEFAULT_FP8_RECIPE,
        fp8_modules: str | Sequence[type[nn.Module] | str] = DEFAULT_FP8_MODULES,
        init_scale: float = _S.init_scale,
        growth_factor: float = _S.growth_factor,
        backoff_factor: float = _S.backoff_factor,
        growth_interval: int = _S.growth_interval,
        hysteresis: int = _S.hysteresis,
        min_scale: float = _S.min_scale,
        max_scale: float = _S.max_scale,
        max_consecutive_skips: int = _S.max_consecutive_skips,
        schedule: Mapping[int | float, str | dict[str, Any]] | None = None,
    ) -> None:
        arguments = {k: v for k, v in locals().items() if k not in ("self", "schedule", "__class__")}
        defaults = {k: p.default for k, p in inspect.signature(CoreViews.__init__).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        self.core = make_core(arguments)
        self._ladder = Ladder(schedule, arguments, defaults, make_core)
        self.precision = self.core.format.lightning_precision  # what Lightning's Trainer.precision reports
        self._set_up_front_end()

    def _set_up_front_end(self) -> None:
        """The front end's own state (called at the end of ``__init__``)."""
        pass

    def fsdp_mp_policy(self):
        """The FSDP2 ``MixedPrecisionPolicy`` for this format (compute in it, reduce gradients in FP32): pass it to every
        ``fully_shard(..., mp_policy=plugin.fsdp_mp_policy())``, in ``configure_model`` or a ``parallelize_fn``."""
        return fsdp_mp_policy(self.core.format.dtype)

    @property
    def ladder(self) -> Ladder:
        """The precision ``schedule``: its rungs (each the plugin's arguments with an entry applied; rung 0 is the
        plugin's own), the step each begins at (``starts``, known once the fit runs) and the one computing now
        (``current``); without a schedule, rung 0 alone."""
        return self._ladder

    def _follow_schedule(self, step: int, length: Callable[[], int | None]) -> None:
        """Between optimizer steps, before step ``step``: the schedule's rung for it (``length``: the run's steps,
        asked once, where the schedule has fractions)."""
        rung = self._ladder.due(step, length, self.core)
        if rung is not None:
            self._switch_to(rung, step)

    def _switch_to(self, rung: int, step: int | None) -> None:
        """Between optimizer steps: the run goes on in rung ``rung`` of the schedule (:func:`~.ladder.switch`)."""
        new = make_core(self._ladder.rungs[rung])
        switch(self.core, new, step, self._ladder.describe(rung))
        self.core, self._ladder.current = new, rung
        self.precision = new.format.lightning_precision

    def _plugin_state(self) -> dict[str, Any]:
        return {**self.core.state_dict(), **self._ladder.state_dict()}

    def _load_plugin_state(self, state: dict[str, Any], step: int | None) -> None:
        rung = self._ladder.saved_rung(state)
        if rung != self._ladder.current:  # the rung that wrote it, then its state (its scale, its decisions)
            self._switch_to(rung, step)
        self.core.load_state_dict(state)

    @property
    def device(self) -> str:
        """The device type the run computes on (``"cpu"``, ``"cuda"``), as Lightning's ``MixedPrecision.device``:
        the Trainer's or Fabric's, read from the model when it is connected (``"cpu"`` until then)."""
        return self.core.device_type

    # The scale and the skips below are exact when read: a flag a fused optimizer left on the device is read first
    # (from its copy, numerics.deferred). The step counts read nothing.
    @property
    def loss_scale(self) -> float:
        """The scale the next backward uses (1.0 when scaling is off)."""
        return self._settled().scale

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because their gradients held inf or NaN."""
        return self._settled().skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent training step was skipped."""
        return self._settled().last_step_skipped

    @property
    def last_step_scale(self) -> float:
        """The scale the most recent training step's backward used (before that step's update)."""
        return self._settled().last_step_scale

    @property
    def training_steps(self) -> int:
        """Training steps the scaler has seen, skipped ones included (several optimizers in one step count once)."""
        return self.core.step.steps

    @property
    def optimizer_steps(self) -> int:
        """Deprecated name of :attr:`training_steps` (it always counted training steps)."""
        return self.core.step.steps

    def _settled(self) -> LossScaler:
        self.core.step.settle()
        return self.core.scaler

    @property
    def last_overflow(self) -> OverflowReport | None:
        """Where the most recent skipped step went non-finite (``None`` before any skip, with
        ``locate_overflows=False``, or when no gradient or watched output was non-finite)."""
        return self.core.last_overflow

    @property
    def auto_fp32_modules(self) -> list[str]:
        """With ``fp32_modules="auto"``: qualified names of the module instances moved to FP32, in the order decided
        (each decision is also a log line with its evidence, and in :meth:`describe`); ``[]`` otherwise."""
        return self.core.autopilot.modules if self.core.autopilot is not None else []

    @property
    def parity(self) -> tuple[float, float] | None:
        """With ``master_weights="compensated"`` and ``parity_guard``: (relative drift of the lean parameters from
        their FP32 shadows, fraction of the shadows' updates the lean values lost) at the last step."""
        return self.core.lean.parity if self.core.lean is not None else None

    @property
    def step(self) -> MixedPrecisionStep:
        """The step object: ``plugin.step.unscale_(optimizer)`` returns the overflow flag of this training step."""
        return self.core.step

    @property
    def scaler(self) -> ScalerView | None:
        """The loss scaler as code written for Lightning's ``MixedPrecision`` reads a ``GradScaler``: ``None``
        without loss scaling (bf16 and fp32 by default, as Lightning's is in ``bf16-mixed``), else a read-only
        :class:`~lightning_mp.core.scaler_view.ScalerView` (``get_scale()``, ``is_enabled()``, ``state_dict()``...).
        The whole scaler, every knob and counter, is ``plugin.core.scaler`` (one step behind while a fused optimizer's
        flag is unread; ``plugin.core.step.settle()`` reads it)."""
        return ScalerView(self.core.scaler, self.core.step.settle) if self.core.scaler.enabled else None

    @property
    def policy(self) -> Fp32Policy:
        return self.core.policy

    @property
    def gemm(self) -> GemmEmulation:
        return self.core.gemm

    @property
    def format(self) -> Format:
        return self.core.format

    @property
    def dtype(self) -> torch.dtype:
        return self.core.format.dtype

    @property
    def master_weights(self) -> bool:
        return self.core.master_weights

    @property
    def check_finite(self) -> bool:
        return self.core.check_finite

    @property
    def locate_overflows(self) -> bool | str:
        return self.core.locate_overflows

    @property
    def skip_scheduler_on_overflow(self) -> bool:
        return self.core.skip_scheduler_on_overflow

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded by FSDP2: its FP32 shards are the masters (see numerics.sharding)."""
        return self.core.sharded

    def named_grads(self, optimizer: Optimizer | None = None) -> Iterator[tuple[str, Tensor]]:
        """(parameter name, FP32 gradient the optimizer reads), for one optimizer's parameters or all of them.

        In ``on_before_optimizer_step(optimizer)`` the gradients of that optimizer are unscaled (true values); with
        several optimizers, another optimizer's gradients may still be scaled until its own step."""
        return self.core.named_grads(optimizer)

    def named_fp32_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """(name, value) of every parameter: the FP32 masters, which the Parameters hold at every moment
        (``module.named_parameters()`` is the same; kept for code written against earlier versions)."""
        lean = self.core.lean
        if self.core.root is not None:
            for name, p in self.core.root.named_parameters():
                yield name, lean.master(p) if lean is not None else p.detach()

    def describe(self) -> str:
        """A Markdown summary of this plugin's settings and its FP32 policy."""
        s = self._settled()
        masters = "FP32 parameters, 16-bit copies read by the forward" if self.master_weights else "no (autocast only)"
        if self.core.lean is not None:
            lean = self.core.lean
            masters = (f"compensated (bf16 parameters + exact int16 remainders; optimizer state {lean.state_dtype}; "
                       f"parity guard {f'on {lean.parity_fraction:g} of the tensors' if lean.parity_fraction else 'off'})")
        lines = [
            f"precision: {self.format.name} (compute dtype {self.format.dtype}); master weights: {masters}",
            f"loss scale: {s.mode!r}, current {s.scale:g}",
        ]
        if s.dynamic:
            lines.append(
                f"  growth x{s.growth_factor:g} every {s.growth_interval} clean steps, backoff x{s.backoff_factor:g}, "
                f"hysteresis {s.hysteresis}, range [{s.min_scale:g}, 2^{_log2(s.max_scale)}]"
            )
        guard = ("on (one host sync per step, none with fused optimizers)" if self.check_finite or s.enabled
                 else "off (no sync, no extra pass)")
        lines.append(f"non-finite guard: {guard}; stop after {s.max_consecutive_skips} skipped steps in a row")
        if self.format.is_16bit:
            lines.append(self.gemm.describe())
        if self.core.autopilot is not None:
            lines.append(self.core.autopilot.describe())
        if self.core.fp8.enabled:
            lines.append(self.core.fp8.describe())
        return "\n".join(lines) + "\n\n" + self.policy.describe()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.core.format.name!r})"


def _init_signature(cls: type) -> inspect.Signature:
    """The class's call signature is its ``__init__``'s less ``self`` (``__new__`` only screens arguments)."""
    sig = inspect.signature(cls.__init__)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


CoreViews.__signature__ = _init_signature(CoreViews)


def _log2(x: float) -> str:
    exponent = torch.tensor(x).log2().item()
    return f"{exponent:g}" if exponent == int(exponent) else f"{exponent:.3g}"
