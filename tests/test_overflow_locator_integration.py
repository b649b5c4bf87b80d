"""The overflow locator through the Trainer: the module named on a skipped step, in the log and in the error."""

import logging

import lightning as L
import pytest
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from tests.conftest import TinyRegressor, regression_data, trainer_kwargs
from tests.test_overflow_locator import GradAmplifier, Scale


class Middle(TinyRegressor):
    """TinyRegressor with ``middle`` between its two Linear layers: ``net.0`` -> ``net.1`` (middle) -> ReLU -> ..."""

    def __init__(self, middle, **kwargs):
        super().__init__(**kwargs)
        self.net = nn.Sequential(nn.Linear(8, 16), middle, nn.ReLU(), nn.Linear(16, 1))


def fit(model, plugin, max_steps=3):
    trainer = L.Trainer(plugins=[plugin], **trainer_kwargs(max_steps=max_steps))
    trainer.fit(model, regression_data())
    return trainer


@pytest.mark.on_device
def test_a_forward_overflow_stops_the_run_naming_the_module_in_the_error_the_log_and_the_property(caplog):
    # a clean step checks nothing: the first skip sees the loss was already non-finite (a forward overflow) and arms
    # the forward checks, which name the module from the second skip on
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0, min_scale=1.0)
    with caplog.at_level(logging.WARNING, logger="lightning_mp.lightning.plugin"):
        with pytest.raises(FloatingPointError) as err:
            fit(Middle(Scale(1e6)), plugin)
    message = str(err.value)
    # the scaler's own message is kept: the step, the scale and the hint, then where it went non-finite
    assert message.startswith("Non-finite gradients at step 1 with loss scale 1") and "HINT:" in message
    assert "Where it first went non-finite: forward overflow in `net.1` (Scale): output went inf" in message
    assert "net.0" not in message  # the Linear before it ran finite, and is not blamed
    report = plugin.last_overflow
    assert (report.phase, report.module, report.module_type, report.tensor) == ("forward", "net.1", "Scale", "output")
    assert 0 < report.input_amax < 65504  # a finite input, so the overflow is the module's own doing
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("step 0 skipped (loss scale 2): forward overflow: the loss was already ")
    assert lines[0].endswith("the forward checks are armed now and name the module at the next skipped step")
    assert lines[1:] == [f"step 1 skipped (loss scale 1): {report}"]


@pytest.mark.on_device
def test_a_run_that_stops_at_its_first_skip_says_the_forward_overflowed_and_which_knob_names_the_module(caplog):
    # issue 37: the loss was already non-finite, so naming the first non-finite gradient (`net.3`) as a backward
    # overflow sent the user to the wrong end of the model
    plugin = MixedPrecisionPlugin("fp16", init_scale=1.0, min_scale=1.0)
    with pytest.raises(FloatingPointError) as err:
        fit(Middle(Scale(1e6)), plugin)
    message = str(err.value)
    assert message.startswith("Non-finite gradients at step 0 with loss scale 1")
    assert "Where it first went non-finite: forward overflow: the loss was already " in message
    assert "backward overflow" not in message
    assert message.endswith(
        "HINT: to name the module, rerun with locate_overflows='forward': the forward checks from the first step "
        "(9-13% of a step) name it at the first skipped step."
    )
    report = plugin.last_overflow
    assert (report.phase, report.module, report.tensor, report.forward_checked) == ("forward", None, "loss", False)
    assert report.reached.module == "net.3"  # where the inf reached the gradients, kept for reference

    # the knob the hint names: the same run now names the module at its first and only skip
    plugin = MixedPrecisionPlugin("fp16", init_scale=1.0, min_scale=1.0, locate_overflows="forward")
    assert plugin.locate_overflows == "forward"
    with pytest.raises(FloatingPointError) as err:
        fit(Middle(Scale(1e6)), plugin)
    assert "Where it first went non-finite: forward overflow in `net.1` (Scale): output went inf" in str(err.value)
    assert "HINT: to name the module" not in str(err.value)
    assert (plugin.last_overflow.phase, plugin.last_overflow.module) == ("forward", "net.1")


@pytest.mark.on_device
def test_a_backward_only_overflow_is_named_as_backward_and_the_run_goes_on():
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8)
    fit(Middle(GradAmplifier(2.0**20)), plugin, max_steps=4)  # every step overflows at 2^8 and below
    report = plugin.last_overflow
    assert plugin.skipped_steps == 4
    # the plugin checks parameter gradients in the backward: the amplifier has none, so the first parameter its
    # inf reaches is named, the Linear before it; nothing after it (net.3's gradients stayed finite)
    assert (report.phase, report.module, report.module_type) == ("backward", "net.0", "Linear")
    assert str(report).startswith("backward overflow in `net.0` (Linear): gradient of ")


@pytest.mark.on_device
def test_a_weight_gradient_that_overflows_names_its_own_module():
    # 2^12 x 8 rows of a unit input: the last Linear's weight gradient passes 65504 first, nothing before it
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**20, max_scale=2.0**24)
    fit(Middle(Scale(1.0)), plugin, max_steps=1)
    assert (plugin.last_overflow.phase, plugin.last_overflow.module) == ("backward", "net.3")


@pytest.mark.on_device
def test_a_clean_run_has_no_overflow_to_report(caplog):
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8)
    with caplog.at_level(logging.WARNING, logger="lightning_mp.lightning.plugin"):
        fit(Middle(Scale(2.0)), plugin)
    assert plugin.skipped_steps == 0 and plugin.last_overflow is None and not caplog.records


@pytest.mark.on_device
def test_a_nan_loss_in_bf16_is_skipped_and_logged_without_a_module_to_blame(caplog):
    plugin = MixedPrecisionPlugin("bf16")
    with caplog.at_level(logging.WARNING, logger="lightning_mp.lightning.plugin"):
        fit(TinyRegressor(fault_at={1, 3}, fault=float("nan")), plugin, max_steps=4)
    assert plugin.skipped_steps == 2
    # the NaN came from the loss, after every module: no module is blamed, neither before the forward checks were
    # armed (the first skip) nor after (every module's output was then checked and finite)
    first, second = (r.getMessage() for r in caplog.records)
    assert first.startswith("step 1 skipped (loss scale 1): forward overflow: the loss was already nan")
    assert second == (
        "step 3 skipped (loss scale 1): forward overflow in the loss: every module's output was finite, the loss "
        "went nan (the loss function, or code outside the modules, made it)"
    )
    report = plugin.last_overflow
    assert (report.phase, report.module, report.tensor, report.forward_checked) == ("forward", None, "loss", True)


@pytest.mark.on_device
def test_locate_overflows_false_installs_nothing_and_reports_nothing():
    model = Middle(Scale(1e6))
    plugin = MixedPrecisionPlugin("fp16", init_scale=1.0, min_scale=1.0, locate_overflows=False)
    with pytest.raises(FloatingPointError) as err:
        fit(model, plugin)
    assert "Where it first went non-finite" not in str(err.value)
    assert plugin.last_overflow is None
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.on_device
def test_the_hooks_come_off_at_the_end_of_fit():
    model = Middle(Scale(1.0))
    fit(model, MixedPrecisionPlugin("fp16"))
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert all(not p._backward_hooks for p in model.parameters())


@pytest.mark.parametrize("bad", [1, "yes", "backward", None])
def test_locate_overflows_must_be_a_bool_or_forward(bad):
    with pytest.raises(ValueError, match=rf"locate_overflows={bad!r} is not allowed: use True, False or 'forward'"):
        MixedPrecisionPlugin("fp16", locate_overflows=bad)


@pytest.mark.on_device
def test_lbfgs_steps_reset_the_locator_every_step():
    plugin = MixedPrecisionPlugin("bf16")
    fit(TinyRegressor(optimizer="lbfgs"), plugin, max_steps=3)
    assert plugin.skipped_steps == 0 and plugin.last_overflow is None
    assert not plugin.core.locator._records and not plugin.core.locator._found


@pytest.mark.on_device
def test_bf16_arms_its_forward_checks_at_the_first_skip_and_names_the_module_from_the_next(caplog):
    """bf16 starts with gradient checks only (no read of every activation); a forward inf in bf16 is known as a
    forward one by the loss on the first skip, named by its own module from the second skip on, and the run stops
    naming it."""
    plugin = MixedPrecisionPlugin("bf16", max_consecutive_skips=2)
    with caplog.at_level(logging.WARNING, logger="lightning_mp.lightning.plugin"), pytest.raises(FloatingPointError) as err:
        fit(Middle(Scale(float("inf"))), plugin, max_steps=4)
    assert plugin.skipped_steps == 2 and plugin.core.locator.check_forward
    first, second = (r.getMessage() for r in caplog.records)
    assert first.startswith("step 0 skipped (loss scale 1): forward overflow: the loss was already ")  # unchecked
    assert second.startswith("step 1 skipped (loss scale 1): forward overflow in `net.1` (Scale)")
    report = plugin.last_overflow
    assert (report.phase, report.module, report.module_type) == ("forward", "net.1", "Scale")
    assert "Where it first went non-finite: forward overflow in `net.1` (Scale)" in str(err.value)


@pytest.mark.on_device
def test_bf16_clean_steps_read_no_activation():
    plugin = MixedPrecisionPlugin("bf16")
    fit(Middle(Scale(2.0)), plugin)
    assert plugin.skipped_steps == 0 and not plugin.core.locator.check_forward and not plugin.core.locator._known
