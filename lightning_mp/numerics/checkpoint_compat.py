"""Resuming from a checkpoint that Lightning's own ``16-mixed`` wrote: its GradScaler state becomes our scale.

Lightning's ``MixedPrecision`` plugin saves ``GradScaler.state_dict()`` under the key ``"MixedPrecision"`` (older
releases: ``"native_amp_scaling_state"``); its deprecated alias ``precision.MixedPrecisionPlugin`` saves it under
``"MixedPrecisionPlugin"``, the same key as our plugin. Without this hand-over a run switched to
``MixedPrecisionPlugin("fp16")`` would restart from 2^16 and skip a handful of steps finding its scale again.
The weights need nothing: Lightning loads them into the FP32 parameters before any 16-bit copy is made.
"""

from __future__ import annotations

import math
from typing import Any

from lightning_mp.numerics.loss_scaler import LossScaler

GRADSCALER_KEYS = ("MixedPrecision", "native_amp_scaling_state")


def gradscaler_state(checkpoint: dict[str, Any], own_key: str) -> dict[str, Any] | None:
    """The GradScaler state of a checkpoint that holds none of ours (``own_key``), else None."""
    if own_key in checkpoint:
        return None
    return next((checkpoint[k] for k in GRADSCALER_KEYS if isinstance(checkpoint.get(k), dict)), None)


def is_gradscaler_state(state_dict: dict[str, Any]) -> bool:
    """Whether a state dict under our own key is really a GradScaler's (Lightning's deprecated alias wrote it)."""
    return "scaler" not in state_dict and "scale" in state_dict and "_growth_tracker" in state_dict


def take_gradscaler_state(scaler: LossScaler, native: dict[str, Any]) -> None:
    """Continue from a GradScaler's scale and growth count; a static or disabled scaler keeps its own scale."""
    if "scale" not in native or not scaler.dynamic:
        return
    scale = float(native["scale"])
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"the checkpoint's GradScaler scale {scale!r} is not a positive finite number.")
    scaler.load_state_dict(
        {
            "mode": "dynamic",
            "scale": scale,
            "growth_tracker": int(native.get("_growth_tracker", 0)),
            "hysteresis_tracker": scaler.hysteresis,
            "skipped_steps": 0,
        }
    )
