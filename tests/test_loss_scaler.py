"""Unit tests of the loss-scale state machine and the fused unscale/check, without a Trainer."""

import math

import pytest
import torch

from lightning_mp.numerics.loss_scaler import LossScaler


def run(scaler, pattern):
    """Feed a string of steps ('.' clean, 'x' overflow) and return the scale after each."""
    scales = []
    for c in pattern:
        scaler.update(c == "x")
        scales.append(scaler.scale)
    return scales


def test_grows_after_interval_of_clean_steps():
    s = LossScaler(init_scale=8.0, growth_interval=3, growth_factor=2.0)
    assert run(s, "......") == [8, 8, 16, 16, 16, 32]


def test_overflow_backs_off_at_once_and_resets_growth():
    s = LossScaler(init_scale=64.0, growth_interval=3)
    assert run(s, "..x...") == [64, 64, 32, 32, 32, 64]
    assert s.skipped_steps == 1
    assert not s.last_step_skipped


def test_hysteresis_two_tolerates_one_overflow_but_still_skips():
    s = LossScaler(init_scale=64.0, growth_interval=100, hysteresis=2)
    assert run(s, "x") == [64]
    assert s.last_step_skipped and s.skipped_steps == 1
    # second overflow backs off; hysteresis is not refilled by clean steps, only by growth (Megatron)
    assert run(s, "..x") == [64, 64, 32]
    assert run(s, "x") == [16]


def test_hysteresis_refilled_by_growth():
    s = LossScaler(init_scale=64.0, growth_interval=2, hysteresis=2)
    assert run(s, "x..x") == [64, 64, 128, 128]


def test_max_scale_caps_growth():
    s = LossScaler(init_scale=4.0, growth_interval=1, max_scale=16.0)
    assert run(s, "....") == [8, 16, 16, 16]


def test_backoff_below_min_scale_stops_with_step_scale_and_hint():
    s = LossScaler(init_scale=4.0, min_scale=1.0)
    run(s, "xx")
    assert s.scale == 1.0
    with pytest.raises(FloatingPointError, match=r"step 7 .*loss scale 1.*min_scale=1.*HINT"):
        s.update(True, step=7)


def test_static_scale_never_moves_but_skips_and_stops_after_bound():
    s = LossScaler(1024.0, max_consecutive_skips=3)
    assert run(s, "x.x" + "." * 5000) == [1024.0] * 5003
    assert s.skipped_steps == 2
    s.update(True)
    s.update(True)
    with pytest.raises(FloatingPointError, match="3 optimizer steps in a row"):
        s.update(True, step=11)


def test_the_stop_after_max_consecutive_skips_names_the_scale_the_step_used_and_then_the_backed_off_one():
    s = LossScaler(init_scale=4096.0, max_consecutive_skips=2)
    s.update(True, step=0)
    with pytest.raises(FloatingPointError) as err:
        s.update(True, step=1)
    assert s.last_step_scale == 2048.0  # what the skip line and TensorBoard show for this step
    assert str(err.value).startswith(
        "Non-finite gradients at step 1 with loss scale 2048 (backed off to 1024 after it): 2 optimizer steps in a "
        "row were skipped (max_consecutive_skips=2). HINT: "
    )
    static = LossScaler(1024.0, max_consecutive_skips=1)
    with pytest.raises(FloatingPointError, match=r"^Non-finite gradients at step 5 with loss scale 1024: 1 optimizer"):
        static.update(True, step=5)  # a scale that did not move is not said to have backed off


def test_disabled_scaler_has_scale_one_and_does_not_touch_the_loss():
    s = LossScaler(None)
    loss = torch.tensor(0.3)
    assert s.scale == 1.0 and not s.enabled
    assert s.scale_loss(loss) is loss


def test_state_dict_round_trip_continues_identically():
    a = LossScaler(init_scale=2.0**10, growth_interval=4, hysteresis=2)
    run(a, "..x...x.")
    b = LossScaler(init_scale=2.0**16, growth_interval=4, hysteresis=2)
    b.load_state_dict(a.state_dict())
    tail = ".....x..x....."
    assert run(b, tail) == run(a, tail)
    assert b.state_dict() == a.state_dict()


def test_static_scaler_keeps_its_own_scale_when_loading_dynamic_state():
    a = LossScaler(init_scale=2.0**10)
    a.update(True)
    b = LossScaler(128.0)
    b.load_state_dict(a.state_dict())
    assert b.scale == 128.0 and b.skipped_steps == 1


@pytest.mark.parametrize("mode", [None, 128.0, 4, "dynamic"])
def test_every_mode_a_scaler_can_save_loads(mode):
    saved = LossScaler(mode, init_scale=2.0**10)
    saved.update(True)
    loaded = LossScaler("dynamic")
    loaded.load_state_dict(saved.state_dict())
    assert loaded.skipped_steps == 1
    assert loaded.scale == (2.0**9 if mode == "dynamic" else 2.0**16)  # only a dynamic saved scale is taken


@pytest.mark.parametrize("mode", ["static", "Dynamic", "auto", -1.0, 0.0, math.inf, math.nan, True, [2.0]])
def test_a_saved_mode_it_does_not_know_is_refused_naming_it_and_what_is_allowed(mode):
    state = LossScaler(init_scale=2.0**10).state_dict() | {"mode": mode, "skipped_steps": 3}
    scaler = LossScaler("dynamic")
    with pytest.raises(ValueError) as err:
        scaler.load_state_dict(state)
    message = str(err.value)
    assert f"mode={mode!r}" in message
    assert "allowed are 'dynamic', a positive finite number (a static scale) or None (no scaling)" in message
    assert "HINT:" in message
    assert scaler.scale == 2.0**16 and scaler.skipped_steps == 0  # nothing half-loaded: no silent restart


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": -1.0}, "init_scale"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, "min_scale"),
        ({"init_scale": math.inf}, "init_scale"),
        ({"mode": "auto"}, "loss_scale"),
        ({"mode": -3.0}, "loss_scale"),
        ({"mode": True}, "loss_scale"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
    ],
)
def test_invalid_arguments_name_the_argument_and_value(kwargs, name):
    mode = kwargs.pop("mode", "dynamic")
    with pytest.raises(ValueError, match=name):
        LossScaler(mode, **kwargs)


def test_unscale_and_check_is_one_pass_and_exact_for_powers_of_two():
    s = LossScaler(init_scale=2.0**16)
    g = [torch.full((5,), 3.0 * 2**16), torch.full((2, 2), 2.0**-8)]
    found = s.unscale_and_check_(g)
    assert found.item() == 0
    assert torch.equal(g[0], torch.full((5,), 3.0))
    assert torch.equal(g[1], torch.full((2, 2), 2.0**-24))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_unscale_and_check_flags_non_finite_even_without_scaling(bad):
    s = LossScaler(None)
    g = [torch.ones(3), torch.tensor([1.0, bad])]
    assert s.unscale_and_check_(g).item() != 0
    assert torch.equal(g[0], torch.ones(3))  # scale 1: finite values untouched


def test_scale_change_updates_the_cached_inverse():
    s = LossScaler(init_scale=4.0)
    s.unscale_and_check_([torch.ones(1)])
    s.update(True)  # scale 2
    g = [torch.full((1,), 8.0)]
    s.unscale_and_check_(g)
    assert g[0].item() == 4.0
