"""The precision autopilot without a Trainer: which module instance it moves to FP32, and what it keeps."""

import logging
import math
import threading

import pytest
import torch
from torch import nn

from lightning_mp import DEFAULT_FP32_MODULES, MixedPrecisionPlugin, resolve_precision
from lightning_mp.doctor.report import OverflowReport
from lightning_mp.core import agreement
from lightning_mp.core.autopilot import MARGIN, Autopilot, split_auto
from tests.test_agreement import FakeRanks

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
    assert pilot.demote(_located("0")) and not pilot.pending  # a proposal: the ranks agree at the step's end
    pilot.end_step(step=7, skipped=True)
    assert pilot.apply() and pilot.decisions[0].step == 7 and pilot.modules == ["0"]
    assert pilot.decisions[0].evidence == (
        "the step overflowed there: forward overflow in `0` (Linear): output went inf; largest input magnitude 0.9"
    )


def _located(module, tensor="output", value="inf", input_amax=0.9):
    return OverflowReport("forward", module, "Linear", tensor, value, input_amax)


def test_the_root_unknown_names_and_backward_or_loss_reports_are_not_moved():
    model = nn.Sequential(nn.Linear(16, 16))
    pilot = _calibrate(model, steps=0)
    assert not pilot.demote(_located("")) and not pilot.demote(_located("9"))
    assert not pilot.demote(OverflowReport("backward", "0", "Linear", "input gradient", "inf"))
    assert not pilot.demote(OverflowReport("forward", None, None, "loss", "nan"))  # no module named
    pilot.end_step(step=3, skipped=True)
    assert not pilot.pending


def test_calibration_steps_is_checked_at_construction_with_or_without_auto():
    for value in (-1, None, "10", 2.5, True):
        for modules in ("auto", (nn.LayerNorm,)):
            with pytest.raises(ValueError, match=rf"calibration_steps={value!r} is not allowed: use an integer >= 0"):
                MixedPrecisionPlugin("fp16", fp32_modules=modules, calibration_steps=value)
    assert MixedPrecisionPlugin("fp16", calibration_steps=0).auto_fp32_modules == []


_BUILD = threading.Lock()


def _outlier_model():
    # Linear(16, 16) x 2e3 after a Linear: outputs of a few hundred from inputs below 0.1, about 1.3e4 from inputs
    # of 20, past fp16's 65504 from inputs of 200. The lock: ranks faked as threads share torch's global generator,
    # and interleaved initialisations would give each rank different weights.
    with _BUILD:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), nn.Sequential(_big_linear(2e3), nn.LayerNorm(16)), nn.Linear(16, 4))


def _fit_steps(pilot, model, batches, skipped=()):
    for step, x in enumerate(batches):
        if pilot.pending:
            pilot.apply()
        with torch.autocast("cpu", dtype=torch.float16):
            model(x)
        pilot.end_step(step=step, skipped=step in skipped)
    pilot.apply()


def test_a_module_one_rank_measures_past_the_threshold_moves_on_every_rank_with_the_same_decision(
    monkeypatch, caplog
):
    ranks = FakeRanks(monkeypatch)
    clean = [torch.rand(8, 16) * 0.1 for _ in range(4)]
    outlier = [torch.full((8, 16), 200.0), *clean[1:]]  # rank 1's first batch only: past 65504

    def rank(r):
        model = _outlier_model()
        pilot = Autopilot(FP16, 2, lambda m: isinstance(m, nn.LayerNorm))
        pilot.attach(model, "cpu")
        _fit_steps(pilot, model, outlier if r == 1 else clean)
        with torch.autocast("cpu", dtype=torch.float16):
            hidden = model[1][0](model[0](clean[0]))
        return pilot, hidden.dtype

    with caplog.at_level(logging.WARNING, logger="lightning_mp"):
        (p0, dtype0), (p1, dtype1) = ranks.run(rank)
    assert p0.modules == p1.modules == ["1.0"] and p0.decisions == p1.decisions  # module, step and evidence
    assert dtype0 == dtype1 == torch.float32  # rank 0 computes it in FP32 too
    assert p0.decisions[0].step == 0 and p0.decisions[0].evidence.endswith("(rank 1 of 2)")
    assert p0.state_dict() == p1.state_dict() == {"modules": ["1.0"], "calibrated_steps": 4}  # what a checkpoint holds
    # one collective per calibration step (2), none on the clean steps after it
    assert ranks.calls == 2
    assert [r.getMessage() for r in caplog.records].count(f"fp32_modules='auto': {p0.decisions[0]}") == 1


def test_the_largest_values_over_the_ranks_are_the_evidence_when_several_ranks_measure_it(monkeypatch):
    ranks = FakeRanks(monkeypatch)

    def rank(r):
        model = _outlier_model()
        pilot = Autopilot(FP16, 1, lambda m: isinstance(m, nn.LayerNorm))
        pilot.attach(model, "cpu")
        _fit_steps(pilot, model, [torch.full((8, 16), 20.0 if r == 0 else 40.0)])  # outputs near 1.3e4 and 2.6e4
        return pilot

    p0, p1 = ranks.run(rank)
    assert p0.decisions == p1.decisions and p0.modules == ["1.0"]
    # the largest output over the ranks (rank 1's), the largest inputs, and both ranks named
    single = Autopilot(FP16, 1, lambda m: isinstance(m, nn.LayerNorm))
    model = _outlier_model()
    single.attach(model, "cpu")
    monkeypatch.setattr(agreement, "world_size", lambda: 1)
    monkeypatch.setattr(agreement, "rank", lambda: 0)
    _fit_steps(single, model, [torch.full((8, 16), 40.0)])
    assert p0.decisions[0].evidence == (
        single.decisions[0].evidence + " (ranks 0 to 1 of 2: the largest values measured)"
    )


def test_an_overflow_located_on_one_rank_moves_the_module_on_every_rank_after_calibration(monkeypatch):
    ranks = FakeRanks(monkeypatch)

    def rank(r):
        model = _outlier_model()
        pilot = Autopilot(FP16, 0, lambda m: isinstance(m, nn.LayerNorm))
        pilot.attach(model, "cpu")
        pilot.end_step(step=4)  # a clean step: no collective
        if r == 1:  # the locator named it on rank 1 only; the skip itself is agreed (the overflow flag)
            assert pilot.demote(_located("1.0", input_amax=3.5))
        pilot.end_step(step=5, skipped=True)
        assert pilot.apply()
        return pilot

    p0, p1 = ranks.run(rank)
    assert p0.decisions == p1.decisions and p0.modules == ["1.0"] and p0.decisions[0].step == 5
    assert p0.decisions[0].evidence == (
        "the step overflowed there: forward overflow in `1.0` (Linear): output went inf; largest input magnitude 3.5 "
        "(rank 1 of 2)"
    )
    assert ranks.calls == 1  # the skipped step's only


def test_a_checkpoint_holds_what_the_ranks_agreed_and_nothing_they_did_not():
    # a checkpoint written between a step and the next forward (ModelCheckpoint's moment) holds the step's decision;
    # what one rank measured in a step that never ended was agreed by none, and a next fit applies nothing of it
    for ended in (True, False):
        model = _outlier_model()
        pilot = Autopilot(FP16, 5, lambda m: isinstance(m, nn.LayerNorm))
        pilot.attach(model, "cpu")
        with torch.autocast("cpu", dtype=torch.float16):
            model(torch.full((8, 16), 40.0))
        if ended:
            pilot.end_step(step=0)
        assert pilot.state_dict()["modules"] == (["1.0"] if ended else [])
        pilot.remove()
        pilot.attach(model, "cpu")
        assert pilot.apply() == ended and pilot.modules == (["1.0"] if ended else [])


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
