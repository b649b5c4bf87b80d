"""``plugin.scaler`` (:mod:`lightning_mp.core.scaler_view`): what code written for Lightning's ``MixedPrecision``
asks its ``GradScaler``, answered from our loss scaler; ``None`` where Lightning's is ``None``. The Trainer runs of the
``scaler is not None`` idiom are in ``test_dropin_integration.py``."""

import copy
import pickle

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.fabric import MixedPrecisionPlugin as FabricPlugin


def test_the_scaler_answers_what_a_gradscaler_with_the_same_knobs_answers():
    knobs = dict(init_scale=2.0**10, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    ours = MixedPrecisionPlugin("fp16", **knobs).scaler
    torch_scaler = torch.amp.GradScaler("cpu", **knobs)
    for question in ("get_scale", "is_enabled", "get_growth_factor", "get_backoff_factor", "get_growth_interval"):
        assert getattr(ours, question)() == getattr(torch_scaler, question)(), question
    assert ours.state_dict() == torch_scaler.state_dict()
    assert isinstance(ours.get_scale(), float)
    assert ours.hysteresis == 1 and ours.min_scale == 1.0  # our own knobs, read-only


@pytest.mark.parametrize("call", ["update", "scale", "step", "unscale_", "load_state_dict", "set_growth_factor"])
def test_calls_that_would_move_the_scale_are_refused_saying_what_to_use(call):
    plugin = MixedPrecisionPlugin("fp16")
    with pytest.raises(RuntimeError, match=rf"plugin\.scaler\.{call}\(\).*read-only.*HINT: "):
        getattr(plugin.scaler, call)(1.0)
    with pytest.raises(AttributeError, match="read-only"):
        plugin.scaler.growth_interval = 10
    assert plugin.loss_scale == 2.0**16


def test_no_scaler_where_the_loss_is_not_scaled_as_lightnings_bf16():
    assert MixedPrecision("bf16-mixed", "cpu").scaler is None
    assert MixedPrecisionPlugin("bf16").scaler is None and MixedPrecisionPlugin("fp32").scaler is None
    assert MixedPrecisionPlugin("fp16", loss_scale=None).scaler is None
    assert FabricPlugin("bf16").scaler is None and FabricPlugin("fp16").scaler.get_scale() == 2.0**16
    assert MixedPrecisionPlugin("fp16", loss_scale=128.0).scaler.get_scale() == 128.0  # a static scale: scaled


def test_the_view_reads_the_live_scale_and_pickles():
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8)
    view = plugin.scaler
    plugin.core.scaler.update(found_inf=True)  # what a skipped step does
    assert view.get_scale() == plugin.scaler.get_scale() == 2.0**7 and view.skipped_steps == 1
    assert pickle.loads(pickle.dumps(view)).get_scale() == copy.deepcopy(view).get_scale() == 2.0**7
