"""``plugin.scaler``: the loss scaler as code written for Lightning's ``MixedPrecision`` asks a ``GradScaler``.

Lightning's plugin holds a ``torch.amp.GradScaler`` in ``16-mixed`` and ``None`` in ``bf16-mixed``, and public code
reads it so::

    if trainer.precision_plugin.scaler is not None:
        self.log("scale", trainer.precision_plugin.scaler.get_scale())

Ours answers the same questions from its :class:`~lightning_mp.numerics.loss_scaler.LossScaler` (``None`` whenever
the loss is not scaled), and refuses what would move the scale behind the plugin's back: the plugin scales,
unscales, steps and updates itself, once per training step. Reading it costs no host sync (the scale lives on the
host), where ``GradScaler.get_scale()`` reads the device; with a fused optimizer, whose flag stays on the device, a
read first takes the last step's flag from its non-blocking copy (:mod:`lightning_mp.numerics.deferred`).
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn

from lightning_mp.numerics.loss_scaler import LossScaler

# What a GradScaler's mutating calls would do, and what does it here.
_INSTEAD = {
    "scale": "the plugin multiplies the loss in backward (the loss training_step returns, self.manual_backward, "
    "fabric.backward); plugin.loss_scale is the factor",
    "unscale_": "the plugin unscales before on_before_optimizer_step and clipping; plugin.step.unscale_(optimizer) "
    "returns whether the training step in progress is skipped",
    "step": "call optimizer.step() (or let automatic optimization do it): the plugin skips a step whose gradients "
    "hold inf/NaN",
    "update": "the plugin moves the scale once per training step",
    "load_state_dict": "the scale travels in the plugin's own checkpoint state (Trainer checkpoints; Fabric: put "
    "the plugin in fabric.save's state), and a GradScaler state of Lightning's 16-mixed is taken over on load",
    "set_growth_factor": "pass growth_factor= to MixedPrecisionPlugin(...)",
    "set_backoff_factor": "pass backoff_factor= to MixedPrecisionPlugin(...)",
    "set_growth_interval": "pass growth_interval= to MixedPrecisionPlugin(...)",
}

# Our own knobs, readable as attributes (``plugin.scaler.hysteresis``) beside GradScaler's getters.
_KNOBS = frozenset(LossScaler.KNOBS) | {"mode", "skipped_steps"}


class ScalerView:
    """A read-only, ``GradScaler``-shaped view of the plugin's loss scaler (``plugin.scaler``; ``None`` without
    loss scaling, as Lightning's is in ``bf16-mixed``).

    Answers ``get_scale()`` (the scale the next backward uses, a float), ``is_enabled()``, ``get_growth_factor()``,
    ``get_backoff_factor()``, ``get_growth_interval()`` and ``state_dict()`` with ``GradScaler``'s keys (``scale``,
    ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker``); our own knobs as attributes
    (``mode``, ``init_scale``, ``hysteresis``, ``min_scale``, ``max_scale``, ``max_consecutive_skips``,
    ``skipped_steps``). ``scale``, ``unscale_``, ``step``, ``update``, ``load_state_dict`` and ``set_*`` raise
    ``RuntimeError`` saying what to use instead.
    """

    __slots__ = ("_scaler_", "_settle")

    def __init__(self, scaler: LossScaler, settle: Callable[[], None] | None = None) -> None:
        object.__setattr__(self, "_scaler_", scaler)
        object.__setattr__(self, "_settle", settle)  # reads a flag left on the device first (numerics.deferred)

    @property
    def _scaler(self) -> LossScaler:
        if self._settle is not None:
            self._settle()
        return self._scaler_

    def get_scale(self) -> float:
        return float(self._scaler.scale)

    def is_enabled(self) -> bool:
        return self._scaler.enabled

    def get_growth_factor(self) -> float:
        return self._scaler.growth_factor

    def get_backoff_factor(self) -> float:
        return self._scaler.backoff_factor

    def get_growth_interval(self) -> int:
        return self._scaler.growth_interval

    def state_dict(self) -> dict[str, Any]:
        """``GradScaler.state_dict()``'s keys and meanings (the plugin's own checkpoint state is
        ``plugin.state_dict()``, with hysteresis and skip counts too)."""
        s = self._scaler
        return {
            "scale": float(s.scale),
            "growth_factor": s.growth_factor,
            "backoff_factor": s.backoff_factor,
            "growth_interval": s.growth_interval,
            "_growth_tracker": s.growth_tracker,
        }

    def __getattr__(self, name: str) -> Any:
        if name in _KNOBS:
            return getattr(self._scaler, name)
        raise AttributeError(
            f"{name!r}: the loss scaler view (plugin.scaler) answers get_scale(), is_enabled(), state_dict(), "
            f"get_growth_factor(), get_backoff_factor(), get_growth_interval() and the knobs {sorted(_KNOBS)}."
        )

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(
            f"plugin.scaler is read-only (setting {name}={value!r}). HINT: pass the scaler's knobs to "
            "MixedPrecisionPlugin(...) by name."
        )

    def __reduce__(self) -> tuple[Any, ...]:  # pickle and copy without the refused __setattr__
        return ScalerView, (self._scaler_, self._settle)

    def __repr__(self) -> str:
        return f"ScalerView(mode={self._scaler.mode!r}, scale={self._scaler.scale:g})"


def _refused(name: str) -> Any:
    """A GradScaler method that would move the scale: calling it raises, naming what does that job here."""

    def refused(self: ScalerView, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(
            f"plugin.scaler.{name}(): the loss scaler of lightning_mp's MixedPrecisionPlugin is read-only "
            f"(it answers get_scale(), is_enabled(), state_dict()...). HINT: {_INSTEAD[name]}."
        )

    refused.__name__ = refused.__qualname__ = name
    return refused


for _name in _INSTEAD:
    setattr(ScalerView, _name, _refused(_name))
del _name


__all__ = ["ScalerView"]
