"""The precision autopilot without a Trainer: which module instance it moves to FP32, and what it keeps."""

import math

import pytest
import torch
from torch import nn

from lightning_mp import DEFAULT_FP32_MODULES, resolve_precision
from lightning_mp.policy.autopilot import MARGIN, Autopilot, split_auto

FP16 = resolve_precision("fp16")


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def _big_linear(factor: float) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(16, 16)
    with torch.no_grad():
        layer.weight.mul_(factor)
    return layer


def _calibrate(model, steps=1, kept=lambda m: isinstance(m, nn.LayerNorm), calibration_steps=5):
    pilot = Autopilot(FP16, calibration_steps, kept)
    pilot.attach(model, "cpu")
    x = torch.rand(8, 16)
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            model(x)
        pilot.end_step()
    return pilot


def test_the_module_whose_output_overflows_fp16_moves_to_fp32_and_then_computes_finite():
    # a Linear whose outputs sit near 1e5 (past 65504) in a block: the Linear is named, not its block (which only
    # passes the values on), not the LayerNorm after it, not the Linear before it
    model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(_big_linear(5e5), nn.LayerNorm(16)), nn.Linear(16, 4))
    x = torch.rand(8, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not model[1][0](model[0](x)).isfinite().all()  # what plain fp16 computes
    pilot = _calibrate(model)
    assert pilot.pending and pilot.apply()
    assert pilot.modules == ["1.0"]
    decision = pilot.decisions[0]
    assert decision.step == 0 and "went non-finite" in decision.evidence and f"/ {MARGIN:g}" in decision.evidence
    with torch.autocast("cpu", dtype=torch.float16):
        hidden = model[1][0](model[0](x))
        out = model(x)
    assert hidden.dtype == torch.float32 and hidden.isfinite().all() and hidden.abs().max() > 65504
    assert out.isfinite().all()


def test_outputs_within_the_margin_of_the_largest_value_move_it_before_it_overflows():
    # outputs near 2e4: finite in fp16, but within a factor 8 of 65504
    model = nn.Sequential(_big_linear(2e4), nn.LayerNorm(16))
    with torch.autocast("cpu", dtype=torch.float16):
        out = model[0](torch.rand(8, 16))
    assert out.isfinite().all() and out.abs().max() > FP16.max / MARGIN
    pilot = _calibrate(model)
    pilot.apply()
    assert pilot.modules == ["0"] and "reached" in pilot.decisions[0].evidence


def test_a_model_that_fits_fp16_moves_nothing():
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
    pilot = _calibrate(model, steps=3)
    assert not pilot.pending and pilot.modules == []


def test_the_maker_of_big_values_is_moved_not_the_modules_that_receive_them_or_the_classes_kept_already():
    # Scale(1e5) makes them from small inputs; the Identity after it only receives them; a LayerNorm (kept FP32
    # by class) that produced big values would be left alone
    model = nn.Sequential(nn.Linear(16, 16), Scale(1e5), nn.Identity(), nn.LayerNorm(16))
    pilot = _calibrate(model)
    pilot.apply()
    assert pilot.modules == ["1"]


def test_own_code_of_a_parent_is_blamed_when_no_child_made_the_values():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(16, 16)

        def forward(self, x):
            return self.inner(x) * 1e5  # the parent's own code overflows, its child does not

    model = nn.Sequential(Residual(), nn.LayerNorm(16))
    pilot = _calibrate(model)
    pilot.apply()
    assert pilot.modules == ["0"]


def test_calibration_ends_after_its_steps_and_costs_nothing_afterwards():
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    pilot = _calibrate(model, steps=2, calibration_steps=2)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with torch.no_grad():
        model[0].weight.mul_(1e5)  # would be moved while calibrating; after it, only a located overflow moves it
    with torch.autocast("cpu", dtype=torch.float16):
        model(torch.rand(8, 16))
    assert not pilot.pending
    assert pilot.demote("0", "the step overflowed there", step=7) and pilot.apply()
    assert pilot.decisions[0].step == 7 and pilot.modules == ["0"]


def test_the_root_and_unknown_names_are_not_moved():
    model = nn.Sequential(nn.Linear(16, 16))
    pilot = _calibrate(model, steps=0)
    assert not pilot.demote("", "overflow", 0) and not pilot.demote("9", "overflow", 0) and not pilot.pending


def test_decisions_survive_a_checkpoint_and_a_second_fit():
    model = nn.Sequential(nn.Linear(16, 16), Scale(1e5), nn.LayerNorm(16))
    pilot = _calibrate(model)
    pilot.apply()
    state = pilot.state_dict()
    assert state == {"modules": ["1"], "calibrated_steps": 1}

    fresh = Autopilot(FP16, 5, lambda m: False)
    fresh.attach(model, "cpu")
    fresh.load_state_dict(state)  # after attach, as the Trainer restores
    assert fresh.apply() and fresh.modules == ["1"] and fresh.decisions[0].step is None
    fresh.remove()
    assert fresh.modules == ["1"]  # still listed after the fit
    fresh.attach(model, "cpu")  # the plugin's next fit applies them again, without listing them twice
    assert fresh.apply() and fresh.modules == ["1"]
    with pytest.raises(ValueError, match=r"module '1'.*this model does not have.*HINT"):
        other = Autopilot(FP16, 5, lambda m: False)
        other.load_state_dict(state)
        other.attach(nn.Sequential(nn.Linear(16, 16)), "cpu")


@pytest.mark.parametrize(
    "given, classes",
    [("auto", DEFAULT_FP32_MODULES), (("auto", nn.LayerNorm), (nn.LayerNorm,)), ([nn.GRU, "auto"], (nn.GRU,))],
)
def test_auto_alone_starts_from_the_default_classes_and_in_a_tuple_from_its_classes(given, classes):
    assert split_auto(given) == (classes, True)
    assert split_auto((nn.LayerNorm,)) == ((nn.LayerNorm,), False)


def test_another_string_names_the_argument():
    with pytest.raises(ValueError, match=r"fp32_modules='automatic' is not allowed: use 'auto'"):
        split_auto("automatic")


def test_bf16_shares_fp32s_range_so_the_same_model_moves_nothing():
    model = nn.Sequential(nn.Linear(16, 16), Scale(1e5), nn.LayerNorm(16))
    pilot = Autopilot(resolve_precision("bf16"), 5, lambda m: False)
    pilot.attach(model, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.rand(8, 16))
    pilot.end_step()
    assert not pilot.pending and math.isclose(pilot.threshold, torch.finfo(torch.bfloat16).max / MARGIN)
