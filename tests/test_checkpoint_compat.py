"""Lightning's GradScaler state handed to our scaler, without a Trainer."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_mp.numerics.checkpoint_compat import gradscaler_state, is_gradscaler_state, take_gradscaler_state
from lightning_mp.numerics.loss_scaler import LossScaler


def _gradscaler_state(scale: float = 512.0, growth: int = 7) -> dict:
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    state = scaler.state_dict()
    state["_growth_tracker"] = growth
    return state


def test_a_16_mixed_checkpoint_hands_over_its_scale_and_growth_count():
    checkpoint = {"state_dict": {}, "MixedPrecision": _gradscaler_state(512.0, 7)}
    native = gradscaler_state(checkpoint, "MixedPrecisionPlugin")
    scaler = LossScaler("dynamic")
    take_gradscaler_state(scaler, native)
    assert scaler.scale == 512.0 and scaler.state_dict()["growth_tracker"] == 7 and scaler.skipped_steps == 0


def test_older_key_is_read_and_our_own_state_wins():
    assert gradscaler_state({"native_amp_scaling_state": {"scale": 8.0}}, "X") == {"scale": 8.0}
    assert gradscaler_state({"X": {}, "MixedPrecision": {"scale": 8.0}}, "X") is None
    assert gradscaler_state({"state_dict": {}}, "X") is None


def test_the_deprecated_alias_state_is_told_apart_from_ours():
    assert is_gradscaler_state(_gradscaler_state())
    assert not is_gradscaler_state({"scaler": LossScaler("dynamic").state_dict(), "version": 2})


def test_a_static_or_disabled_scaler_keeps_its_scale():
    for scaler, expected in ((LossScaler(128.0), 128.0), (LossScaler(None), 1.0)):
        take_gradscaler_state(scaler, _gradscaler_state(512.0))
        assert scaler.scale == expected


@pytest.mark.parametrize("bad", [0.0, -4.0, math.inf, math.nan])
def test_a_corrupt_scale_is_refused_with_its_value(bad):
    with pytest.raises(ValueError, match="GradScaler scale .* not a positive finite number"):
        take_gradscaler_state(LossScaler("dynamic"), {"scale": bad, "_growth_tracker": 0})
