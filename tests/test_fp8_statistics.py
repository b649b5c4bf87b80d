"""The FP8 statistics against hand computations and torchao's own casts, the probe's hooks, and the autopilot's
decisions, without a Trainer."""

import logging
import math

import pytest
import torch
from torch import nn

from lightning_mp.fp8.autopilot import FLUSH_LIMIT, Fp8Autopilot
from lightning_mp.fp8.probe import Fp8Probe, flat, tag
from lightning_mp.fp8.statistics import RECIPE_SCALING, STATS, TENSORS, Scaling, measure, quantize, scales, unpack

torchao = pytest.importorskip("torchao", reason="the recipes' scalings are checked against torchao's configs")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TENSORWISE, ROWWISE = Scaling(E4M3, "tensor", False), Scaling(E4M3, "row", True)


def stats(x, scaling):
    return unpack(measure(x, scaling).tolist())


def test_tensorwise_e4m3_by_hand():
    # amax 4: scale 448 / 4 = 112; 1, 2, 4 land on 112, 224, 448 (exact in e4m3); 1e-6 * 112 = 1.1e-4 is below
    # half of e4m3's smallest subnormal (2^-9 / 2): it flushes to zero
    s = stats(torch.tensor([[1.0, 2.0, 4.0, 1e-6]]), TENSORWISE)
    assert s.amax == 4.0 and s.scale == 112.0
    assert s.flushed_fraction == 0.25 and s.saturated_fraction == 0.0
    assert s.sqnr_db == pytest.approx(10 * math.log10(21 / 1e-12), rel=1e-4)


def test_rowwise_rounds_each_rows_scale_down_to_a_power_of_two_by_hand():
    # row 0: 448 / 3 = 149.3 -> 128; 0.1 * 128 = 12.8 rounds to 13 in e4m3 (step 1 in [8, 16)), back: 13 / 128
    # row 1: its own scale, 448 / 0.5 = 896 -> 512
    x = torch.tensor([[3.0, 0.1], [0.5, 0.25]])
    assert scales(x, ROWWISE).flatten().tolist() == [128.0, 512.0]
    assert quantize(x, ROWWISE)[0].tolist() == [3.0, 13 / 128]
    s = stats(x, ROWWISE)
    noise = (13 / 128 - 0.1) ** 2
    assert s.scale == 128.0 and s.flushed_fraction == 0.0
    assert s.sqnr_db == pytest.approx(10 * math.log10((9 + 0.01 + 0.25 + 0.0625) / noise), rel=1e-4)


def test_the_flush_boundary_is_half_the_smallest_subnormal_and_e5m2_reaches_further():
    tiny = 2.0**-9  # e4m3's smallest subnormal
    x = torch.tensor([[448.0, tiny / 2, tiny * 0.51]])  # scale 1: the tie rounds to even (0), just above it does not
    assert stats(x, TENSORWISE).flushed_fraction == pytest.approx(1 / 3)
    e5m2 = Scaling(E5M2, "tensor", False)  # max 57344, smallest subnormal 2^-16: 2^-12 of a 448 amax survives
    assert stats(torch.tensor([[448.0, 448 * 2.0**-20]]), e5m2).flushed_fraction == 0.0
    assert stats(torch.tensor([[448.0, 448 * 2.0**-20]]), TENSORWISE).flushed_fraction == 0.5


def test_an_outlier_feature_flushes_the_rest_of_its_rows_while_the_sqnr_stays_high():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    healthy = stats(x, ROWWISE)
    assert healthy.flushed_fraction == 0.0 and 30 < healthy.sqnr_db < 33  # 3 mantissa bits on every value
    assert 24 < stats(x, RECIPE_SCALING["tensorwise"]["grad_output"]).sqnr_db < 27  # e5m2: 2 bits
    x[:, :4] *= 1e6
    outlier = stats(x, ROWWISE)
    assert outlier.flushed_fraction > 0.9 and outlier.sqnr_db > 30  # what SQNR alone would miss


def test_mx_blocks_of_32_each_get_their_own_scale():
    x = torch.randn(4, 64)
    x[:, 0] = 1e6  # only the first block of each row holds the outlier
    s = stats(x, RECIPE_SCALING["mxfp8"]["input"])
    assert 0.4 < s.flushed_fraction < 0.5  # most of the first 31 of every 64 values
    with pytest.raises(ValueError, match="multiple of 32"):
        measure(torch.ones(2, 48), RECIPE_SCALING["mxfp8"]["input"])


def test_saturation_is_zero_under_dynamic_scales_and_a_zero_tensor_is_exact():
    s = stats(torch.randn(128, 128, generator=torch.Generator().manual_seed(0)) * 1e4, TENSORWISE)
    assert s.saturated_fraction == 0.0
    # 42260.5078125 * fl(448 / 42260.5078125) is 448.00003 in FP32: the scale's rounding, not a saturated value
    # (it was counted as one, so an unseeded tensor of this test read 6e-5 depending on the RNG's state)
    assert stats(torch.tensor([[42260.5078125, 1.0]]), TENSORWISE).saturated_fraction == 0.0
    zero = stats(torch.zeros(4, 16), ROWWISE)
    assert zero.flushed_fraction == 0.0 and zero.sqnr_db == math.inf


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_the_table_is_torchaos_and_the_casts_are_torchaos(recipe):
    from torchao.float8.config import Float8LinearConfig, ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    config = Float8LinearConfig.from_recipe_name(recipe)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    for tensor in TENSORS:
        cast = getattr(config, f"cast_config_{tensor}")
        scaling = RECIPE_SCALING[recipe][tensor]
        rowwise = cast.scaling_granularity is ScalingGranularity.AXISWISE
        assert (scaling.dtype, scaling.granularity, scaling.power_of_2) == (
            cast.target_dtype, "row" if rowwise else "tensor", config.round_scales_to_power_of_2)
        scale = tensor_to_scale(x, cast.target_dtype, scaling_granularity=cast.scaling_granularity,
                                axiswise_dim=-1 if rowwise else None,
                                round_scales_to_power_of_2=config.round_scales_to_power_of_2)
        theirs = to_fp8_saturated(x.float() * scale, cast.target_dtype).float() / scale
        assert torch.equal(quantize(x, scaling), theirs)


def test_the_probe_measures_input_weight_and_grad_output_once_per_armed_step():
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    probe = Fp8Probe([("layer", linear)], "tensorwise", torch.bfloat16)
    x = torch.randn(8, 32, requires_grad=True)
    linear(x).sum().backward()
    assert probe.collect() == {}  # not armed: no hooks, nothing measured
    probe.arm()
    out = linear(x)
    linear(x * 2).sum()  # a second forward (a micro-batch) in the same step is not measured
    (out * 3).sum().backward()
    measured = probe.collect()
    assert list(measured["layer"]) == list(TENSORS) and not probe.armed
    expected = stats(x.detach().to(torch.bfloat16), RECIPE_SCALING["tensorwise"]["input"])
    assert measured["layer"]["input"] == expected
    assert measured["layer"]["grad_output"].amax == 3.0 and measured["layer"]["grad_output"].flushed_fraction == 0
    tags = flat(measured)
    assert len(tags) == 3 * len(STATS) and tag("layer", "weight", "sqnr_db") in tags
    assert set(tags) >= {f"fp8/layer/{t}/{s}" for t in TENSORS for s in STATS}


def outlier_linears():
    torch.manual_seed(0)
    return [("offender", nn.Linear(64, 64)), ("fine", nn.Linear(64, 64))]


def calibrate(pilot, linears, steps):
    for _ in range(steps):
        x = torch.randn(16, 64)
        x[:, :4] *= 1e6
        h = linears[0][1](x)
        linears[1][1](h / h.abs().amax()).sum().backward()
        ended = pilot.end_step()
    return ended


def test_the_autopilot_keeps_exactly_the_linear_whose_input_flushes_and_restores_its_decisions(caplog):
    linears = outlier_linears()
    pilot = Fp8Autopilot("rowwise", calibration_steps=3)
    pilot.attach(linears, torch.bfloat16)
    assert pilot.holds("fine") and pilot.holds("offender") and "calibrating (0 of 3 steps)" in pilot.describe()
    with caplog.at_level(logging.WARNING, logger="lightning_mp.plugin"):
        assert calibrate(pilot, linears, 3)
    assert pilot.kept == ["offender"] and not pilot.holds("fine") and not pilot.calibrating
    (decision,) = pilot.decisions
    assert decision.step == 2 and f"input flushed" in decision.evidence and f"limit {FLUSH_LIMIT:.0%}" in str(decision)
    assert "fp8_modules='auto': `offender` kept in bf16 at step 2" in caplog.text
    assert pilot.end_step() is False  # calibrated: nothing more is measured or decided

    resumed = Fp8Autopilot("rowwise", calibration_steps=3)
    resumed.load_state_dict(pilot.state_dict())
    resumed.attach(outlier_linears(), torch.bfloat16)
    assert resumed.kept == ["offender"] and not resumed.calibrating and not resumed.holds("fine")
    assert "decided by the run this checkpoint comes from" in resumed.describe()
