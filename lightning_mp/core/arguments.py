"""The plugins' arguments: Lightning's own ``MixedPrecision`` arguments screened with a hint, and one core built
from a dict of them (the plugin's own, or a precision schedule's rung)."""

from __future__ import annotations

from typing import Any

from lightning_mp.core.run import MixedPrecisionCore
from lightning_mp.fp8 import Fp8Settings
from lightning_mp.numerics.loss_scaler import ScalerSettings

# Arguments of Lightning's own precision plugins (``MixedPrecision(precision, device, scaler)``) that have no place
# here, and what to write instead.
_FOREIGN_ARGUMENTS = {
    "device": "the device is the Trainer's or Fabric's (accelerator='cuda' / 'cpu'): drop device=",
    "scaler": "the loss scaler is built in (no torch.amp.GradScaler): drop scaler= and set loss_scale= "
    "('dynamic', a number or None) and the scaler's knobs (init_scale=, growth_factor=, backoff_factor=, "
    "growth_interval=, hysteresis=, min_scale=, max_scale=) by name",
}


def screen_arguments(cls: type, args: tuple, kwargs: dict[str, Any], own_init: bool) -> None:
    """Lightning's ``MixedPrecision(precision, device, scaler)`` arguments get a hint instead of Python's bare
    "unexpected keyword argument"; everything else is ``__init__``'s (whose signature ``__signature__`` shows).
    ``own_init``: ``cls`` has the plugins' ``__init__`` (a subclass with its own decides about positionals itself)."""
    for name, hint in _FOREIGN_ARGUMENTS.items():
        if name in kwargs:
            raise ValueError(
                f"{name}={kwargs[name]!r} is not an argument of {cls.__name__} (it is one of Lightning's "
                f"MixedPrecision). HINT: {hint}."
            )
    if len(args) > 1 and own_init:
        # Lightning's positional order, MixedPrecision("16-mixed", "cuda"): its device is the Trainer's here
        foreign = list(_FOREIGN_ARGUMENTS)[: len(args) - 1]
        named = ", ".join(f"{name}={value!r}" for name, value in zip(foreign, args[1:]))
        raise ValueError(
            f"{cls.__name__}({', '.join(map(repr, args))}): only `precision` is positional; in the order of "
            f"Lightning's MixedPrecision(precision, device, scaler) the rest is {named}, which this plugin does "
            f"not take. HINT: {'; '.join(_FOREIGN_ARGUMENTS[name] for name in foreign)}; every other argument "
            "goes by name (master_weights=, loss_scale=, ...)."
        )


def make_core(arguments: dict[str, Any]) -> MixedPrecisionCore:
    """A core from the plugin's arguments (a schedule's rung is such a dict too)."""
    a = dict(arguments)
    scaler = ScalerSettings(**{k: a.pop(k) for k in list(a) if k in ScalerSettings.__dataclass_fields__})
    fp8 = Fp8Settings(a.pop("fp8_recipe"), a.pop("fp8_modules"))
    return MixedPrecisionCore(a.pop("precision"), scaler=scaler, fp8=fp8, **a)
