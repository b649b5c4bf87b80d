"""The loss-scale state machine and the fused unscale + non-finite check.

Why scale at all: real gradients span roughly 1e-9 .. 1e-3, FP16 only reaches 2^-24 (subnormal) / 2^-14
(normal), so small gradients flush to zero in the backward pass. Multiplying the loss by ``scale`` shifts the
whole gradient distribution up by log2(scale) octaves; dividing the FP32 master gradients by the same factor
afterwards restores them (exactly while the scale is a power of two, as with the default knobs; other values of
``init_scale``, ``growth_factor`` or ``backoff_factor`` round once more in FP32).

The state machine (Megatron's meaning of hysteresis):

* overflow step: the step is skipped, the growth tracker resets; the hysteresis counter drops by one and the
  scale is multiplied by ``backoff_factor`` once it reaches zero (``hysteresis=1`` backs off at once,
  ``hysteresis=2`` tolerates one overflowing step, which is still skipped).
* clean step: the growth tracker counts up; after ``growth_interval`` clean steps in a row the scale is
  multiplied by ``growth_factor`` (capped at ``max_scale``) and the hysteresis counter is refilled.
* a scale that would fall below ``min_scale``, or ``max_consecutive_skips`` skipped steps in a row, stop the run
  with :class:`FloatingPointError`: persistent non-finite gradients are a bug in the model or data, and skipping
  them forever would silently train nothing.

The state lives on the host as Python numbers, moved by :meth:`LossScaler.update` with each step's flag read on the
host. Where that flag stays on the device (a fused optimizer skips there, :mod:`lightning_mp.numerics.deferred`), the
host moves one step late, and the next step's scale is picked on the device between the two values this machine
would move to (:meth:`LossScaler.branches`): the same numbers, with no second state machine to keep in step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from lightning_mp.formats import by_device_and_dtype
from lightning_mp.numerics import without_grad
from lightning_mp.validation import check_int, check_number

DEFAULT_INIT_SCALE = 2.0**16
DEFAULT_MAX_SCALE = 2.0**24
DEFAULT_MIN_SCALE = 1.0
DEFAULT_MAX_CONSECUTIVE_SKIPS = 50

_HINT = (
    "HINT: non-finite gradients at every scale usually come from the model or the data, not from FP16's range: "
    "a NaN/inf in the inputs, a log/sqrt/division of zero, a learning rate that is too high, or an op that "
    "overflows in 16 bits in the forward pass (add it to `fp32_ops`, or try precision='bf16')."
)


@dataclass(frozen=True)
class ScalerSettings:
    """The dynamic scaler's knobs, declared once: :class:`LossScaler` and both plugins take them by these names and
    defaults (their signatures are checked against these fields). Checked here, each error naming its argument."""

    init_scale: float = DEFAULT_INIT_SCALE
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = DEFAULT_MIN_SCALE
    max_scale: float = DEFAULT_MAX_SCALE
    max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS

    def __post_init__(self) -> None:
        check_number("init_scale", self.init_scale, low=0.0, low_open=True)
        check_number("growth_factor", self.growth_factor, low=1.0, low_open=True)
        check_number("backoff_factor", self.backoff_factor, low=0.0, low_open=True, high=1.0)
        check_int("growth_interval", self.growth_interval, low=1)
        check_int("hysteresis", self.hysteresis, low=1)
        check_number("min_scale", self.min_scale, low=0.0, low_open=True)
        check_number("max_scale", self.max_scale, low=0.0, low_open=True)
        check_int("max_consecutive_skips", self.max_consecutive_skips, low=1)
        if self.min_scale > self.max_scale:
            raise ValueError(f"min_scale={self.min_scale!r} must not exceed max_scale={self.max_scale!r}.")


_S = ScalerSettings


class LossScaler:
    """Dynamic or static loss scale with growth, backoff, hysteresis and limits.

    Args:
        mode: ``"dynamic"``, a positive number (a static scale), or ``None`` (no scaling, scale 1.0). Steps with
            non-finite gradients are skipped in every mode; only ``"dynamic"`` changes the scale.
        init_scale: starting scale of a dynamic scaler.
        growth_factor: multiplier after ``growth_interval`` clean steps; must be > 1.
        backoff_factor: multiplier on overflow; must be in (0, 1).
        growth_interval: clean steps in a row before the scale grows; >= 1.
        hysteresis: overflowing steps tolerated before a backoff (Megatron's meaning); >= 1.
        min_scale: a dynamic scale that would fall below this stops the run with ``FloatingPointError``.
        max_scale: the scale never grows above this.
        max_consecutive_skips: this many skipped steps in a row stop the run, whatever the mode.
    """

    KNOBS = tuple(f.name for f in fields(ScalerSettings))

    def __init__(
        self,
        mode: str | float | None = "dynamic",
        *,
        init_scale: float = _S.init_scale,
        growth_factor: float = _S.growth_factor,
        backoff_factor: float = _S.backoff_factor,
        growth_interval: int = _S.growth_interval,
        hysteresis: int = _S.hysteresis,
        min_scale: float = _S.min_scale,
        max_scale: float = _S.max_scale,
        max_consecutive_skips: int = _S.max_consecutive_skips,
    ) -> None:
        if mode is not None and mode != "dynamic":
            if isinstance(mode, bool) or not isinstance(mode, (int, float)) or not math.isfinite(mode) or mode <= 0:
                raise ValueError(
                    f"loss_scale={mode!r} is not supported. Allowed: 'dynamic', a positive finite number "
                    "(a static scale), None (no scaling) or 'auto' (dynamic for fp16, none for bf16 and fp32)."
                )
        ScalerSettings(
            init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale,
            max_consecutive_skips,
        )  # fmt: skip
        if mode == "dynamic" and not min_scale <= init_scale <= max_scale:
            raise ValueError(
                f"init_scale={init_scale!r} must lie in [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}]."
            )
        self.mode = mode
        self.init_scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.max_consecutive_skips = int(max_consecutive_skips)

        if mode == "dynamic":
            self.scale = self.init_scale
        elif mode is None:
            self.scale = 1.0
        else:
            self.scale = float(mode)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.last_step_skipped = False
        self.last_step_scale = self.scale  # the scale the most recent step's backward used
        self.steps = 0  # state-machine updates so far: training steps, skipped ones included
        self._inv_scale: Tensor | None = None
        # [scale, 1/scale] of the next step, picked on the device while the host has not read the last step's flag
        # (numerics.deferred); None once update() has caught up: the host numbers are exact again
        self.device_next: Tensor | None = None

    @classmethod
    def from_settings(cls, mode: str | float | None, settings: ScalerSettings) -> LossScaler:
        return cls(mode, **{f.name: getattr(settings, f.name) for f in fields(settings)})

    @property
    def dynamic(self) -> bool:
        return self.mode == "dynamic"

    @property
    def enabled(self) -> bool:
        """Whether the loss is multiplied at all: ``False`` only with ``loss_scale=None`` (no scaling)."""
        return self.mode is not None

    def scale_loss(self, loss: Tensor) -> Tensor:
        if self.device_next is None:
            return loss * self.scale if self.enabled else loss
        scale = self.device_next[0].to(loss.device)
        if loss.dtype in (torch.float16, torch.bfloat16):  # as ``loss * float``: in FP32, rounded once to 16 bits
            return (loss.float() * scale).to(loss.dtype)
        return loss * scale.to(loss.dtype)  # FP64: the FP32 scale, the host's double where it is a power of two

    @without_grad
    def unscale_and_check_(self, grads: list[Tensor]) -> Tensor:
        """Divide ``grads`` by the scale in place and return a 0-dim float tensor, nonzero if any is non-finite.

        One fused pass per (device, dtype) group: torch's ``_amp_foreach_non_finite_check_and_unscale_`` reads
        each element once, multiplies it by 1/scale and raises the flag on inf/NaN, with no host sync. Call it
        on the FP32 gradients: unscaling in 16 bits would push small gradients back under FP16's floor.
        Only with scaling on: without it the step checks read-only (``numerics.grad_layout.non_finite_flag``).
        """
        if not grads:
            return torch.zeros(())
        device = grads[0].device
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        inv = self._inv_scale_on(device) if self.device_next is None else self.device_next[1]
        for (dev, _), idx in by_device_and_dtype(grads).items():
            group = [grads[i] for i in idx]
            flag = found_inf if dev == device else torch.zeros((), dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv.to(dev))
            if flag is not found_inf:  # a maximum: a fused optimizer skips on exactly 1.0
                torch.maximum(found_inf, flag.to(device), out=found_inf)
        return found_inf

    def _inv_scale_on(self, device: torch.device) -> Tensor:
        inv = self._inv_scale
        if inv is None or inv.device != device:
            inv = self._inv_scale = torch.empty((), dtype=torch.float32, device=device)
            inv.fill_(1.0 / self.scale)
        return inv

    def _set_scale(self, scale: float) -> None:
        self.scale = scale
        if self._inv_scale is not None:
            self._inv_scale.fill_(1.0 / scale)

    def branches(self) -> tuple[float, float]:
        """The scale :meth:`update` leaves after a clean step and after an overflow (an overflow that stops the run
        leaves the scale where it is)."""
        clean, overflow = self._moved(False)[0], self._moved(True)[0]
        return clean, (overflow if overflow >= self.min_scale else self.scale)

    def _moved(self, found_inf: bool) -> tuple[float, int, int]:
        """(scale, growth tracker, hysteresis tracker) after one more step of the dynamic machine."""
        if not found_inf:
            if self.growth_tracker + 1 >= self.growth_interval:
                return min(self.scale * self.growth_factor, self.max_scale), 0, self.hysteresis
            return self.scale, self.growth_tracker + 1, self.hysteresis_tracker
        hysteresis = self.hysteresis_tracker - 1
        return (self.scale * self.backoff_factor if hysteresis <= 0 else self.scale), 0, hysteresis

    def update(self, found_inf: bool, step: int | None = None) -> None:
        """Advance the state machine by one optimizer step (call once per training step)."""
        self.device_next = None
        self.last_step_skipped = bool(found_inf)
        self.last_step_scale = self.scale
        self.steps += 1
        self.consecutive_skips = self.consecutive_skips + 1 if found_inf else 0
        self.skipped_steps += bool(found_inf)
        where = f"step {step}" if step is not None else "this step"
        if self.dynamic:
            scale, self.growth_tracker, self.hysteresis_tracker = self._moved(found_inf)
            if scale < self.min_scale:
                raise FloatingPointError(
                    f"Non-finite gradients at {where} with loss scale {self.scale:g}: backing off would take "
                    f"the scale to {scale:g}, below min_scale={self.min_scale:g} "
                    f"({self.consecutive_skips} skipped steps in a row). {_HINT}"
                )
            if scale != self.scale:
                self._set_scale(scale)
        if self.consecutive_skips >= self.max_consecutive_skips:
            # the scale this step's backward used (the skip line's, ``last_step_scale``'s), not the one after backoff
            used = self.last_step_scale
            moved = f" (backed off to {self.scale:g} after it)" if self.scale != used else ""
            raise FloatingPointError(
                f"Non-finite gradients at {where} with loss scale {used:g}{moved}: {self.consecutive_skips} "
                f"optimizer steps in a row were skipped (max_consecutive_skips={self.max_consecutive_skips}). "
                f"{_HINT}"
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "last_step_skipped": self.last_step_skipped,
            "last_step_scale": self.last_step_scale,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters. A saved scale is taken only if this scaler is dynamic and so was the saved one:
        a static or disabled scaler keeps the scale it was configured with."""
        missing = {"scale", "growth_tracker", "hysteresis_tracker", "skipped_steps"} - set(state)
        if missing:
            raise KeyError(f"loss scaler state is missing {sorted(missing)}; got keys {sorted(state)}.")
        self.device_next = None
        mode = state.get("mode", "dynamic")
        if not _is_saved_mode(mode):
            # dropping the saved scale would restart a dynamic run at init_scale without a word
            raise ValueError(
                f"the checkpoint's loss scaler state has mode={mode!r}, which this lightning_mp does not know: "
                "allowed are 'dynamic', a positive finite number (a static scale) or None (no scaling). "
                "HINT: the checkpoint is corrupt or was written by another plugin; resume from one this plugin wrote."
            )
        if self.dynamic and mode == "dynamic":
            scale = float(state["scale"])
            if not math.isfinite(scale) or scale <= 0:
                raise ValueError(f"saved loss scale {scale!r} is not a positive finite number.")
            self._set_scale(min(max(scale, self.min_scale), self.max_scale))
            self.growth_tracker = int(state["growth_tracker"])
            self.hysteresis_tracker = int(state["hysteresis_tracker"])
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.last_step_skipped = bool(state.get("last_step_skipped", False))
        self.last_step_scale = float(state.get("last_step_scale", self.scale))
        self.steps = int(state.get("steps", 0))


def _is_saved_mode(mode: Any) -> bool:
    """Whether ``mode`` is one a :class:`LossScaler` can have saved: 'dynamic', None or a static scale."""
    if mode is None or mode == "dynamic":
        return True
    return isinstance(mode, (int, float)) and not isinstance(mode, bool) and math.isfinite(mode) and mode > 0
