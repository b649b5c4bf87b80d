"""The log2 magnitude counts without a Trainer: buckets, fractions at a scale, inf/NaN, chunking, the device."""

import math

import pytest
import torch

from lightning_mp import MixedPrecisionPlugin
from lightning_mp import log2_histogram as lh
from lightning_mp.doctor.log2_histogram import LOG2_LOW, NUM_BUCKETS, gradient_range, histogram_kwargs
from tests.conftest import cuda

FP32 = torch.finfo(torch.float32)
FP16 = torch.finfo(torch.float16)
BF16 = torch.finfo(torch.bfloat16)


def bucket_of(value, dtype=torch.float32):
    """The left edge (an integer log2) of the one bucket that ``value`` lands in."""
    hist = gradient_range([torch.tensor([value], dtype=dtype)], scale=1.0).histogram
    assert sum(hist) == 1, hist
    return LOG2_LOW + hist.index(1)


# ---------------------------------------------------------------------------------------------- bucket layout
# (name, value, left edge of its bucket): the landmarks a user reads the histogram against
LANDMARKS = [
    ("fp32 smallest subnormal", FP32.smallest_normal * FP32.eps, -149),
    ("bf16 smallest subnormal", BF16.smallest_normal * BF16.eps, -133),
    ("bf16/fp32 smallest normal", FP32.smallest_normal, -126),
    ("fp16 smallest subnormal", FP16.smallest_normal * FP16.eps, -24),
    ("fp16 smallest normal", FP16.smallest_normal, -14),
    ("a known gradient", 2.0**-20, -20),
    ("just under the next octave", 2.0**-20 * (2 - 2**-23), -20),
    ("just under 1", 1 - 2**-24, -1),
    ("just under 2^-20 (float32 log2 gives exactly -20)", 2.0**-20 * (1 - 2**-24), -21),
    ("one", 1.0, 0),
    ("fp16 max (65504)", FP16.max, 15),
    ("fp32 max", FP32.max, 127),
]


@pytest.mark.parametrize("name, value, left", LANDMARKS, ids=[row[0] for row in LANDMARKS])
def test_each_value_lands_in_its_octave(name, value, left):
    assert bucket_of(value) == left
    assert bucket_of(-value) == left  # magnitude: the sign does not matter


def test_the_buckets_span_every_finite_fp32_exponent_with_integer_edges():
    assert LOG2_LOW == -149 and NUM_BUCKETS == 277  # [2^-149, 2^128): nothing finite falls outside
    kw = histogram_kwargs([1] * NUM_BUCKETS)
    assert kw["bucket_limits"] == [float(k) for k in range(-148, 129)]
    assert (kw["min"], kw["max"], kw["num"]) == (-149.0, 128.0, NUM_BUCKETS)


def test_bf16_and_fp16_gradients_are_bucketed_like_their_fp32_values():
    assert bucket_of(2.0**-20, torch.bfloat16) == -20
    assert bucket_of(2.0**-24, torch.float16) == -24


def test_fp64_values_beyond_the_fp32_range_go_to_the_edge_buckets():
    assert bucket_of(2.0**-1000, torch.float64) == -149
    assert bucket_of(2.0**500, torch.float64) == 127


def test_histogram_is_trimmed_to_the_filled_span_with_exact_edges():
    counts = [0] * NUM_BUCKETS
    counts[-20 - LOG2_LOW] = 3
    counts[-18 - LOG2_LOW] = 1
    kw = histogram_kwargs(counts)
    assert kw["bucket_limits"] == [-19.0, -18.0, -17.0]  # right edges; the empty bucket in between stays
    assert kw["bucket_counts"] == [3.0, 0.0, 1.0]
    assert (kw["min"], kw["max"], kw["num"]) == (-20.0, -17.0, 4)
    assert kw["sum"] == pytest.approx(3 * -19.5 + -17.5)  # bucket midpoints
    empty = histogram_kwargs([0] * NUM_BUCKETS)
    assert empty["num"] == 0 and empty["bucket_limits"] == [] and empty["bucket_counts"] == []


# ---------------------------------------------------------------------------------------------- fractions
def constructed(scale):
    """16 elements of known classes at ``scale`` (FP16: underflow below 2^-24 / scale, overflow above 65504 / scale)."""
    under_at, over_at = 2.0**-24 / scale, 65504.0 / scale
    zeros = [0.0, -0.0, 0.0]
    under = [under_at / 64, -under_at / 2]
    over = [over_at * 2, -over_at * 1.5, math.inf, math.nan]
    edges = [under_at, -over_at]  # exactly at a limit: representable, so neither under- nor overflow
    normal = [under_at * 4, -over_at / 4, over_at / 1024, -math.sqrt(under_at * over_at), under_at * 1000]
    return torch.tensor(zeros + under + over + edges + normal), dict(zeros=3, under=2, over=4, finite_nonzero=11)


@pytest.mark.parametrize("scale", [1.0, 2.0**10, 2.0**16, 1000.0])
def test_fractions_count_zero_underflow_and_overflow_at_the_scale(scale):
    grad, expected = constructed(scale)
    r = gradient_range([grad], scale=scale)
    assert (r.numel, r.zeros, r.underflow, r.overflow) == (16, expected["zeros"], expected["under"], expected["over"])
    assert r.zero_fraction == 3 / 16 and r.underflow_fraction == 2 / 16 and r.overflow_fraction == 4 / 16
    # the histogram holds exactly the nonzero finite elements (finite overflows too): zeros, inf and NaN are not
    assert sum(r.histogram) == expected["finite_nonzero"]


def test_a_gradient_that_underflows_fp16_at_one_scale_survives_at_a_larger_one():
    grad = torch.full((10,), 2.0**-30)
    assert gradient_range([grad], scale=1.0).underflow_fraction == 1.0  # 2^-30 < 2^-24
    assert gradient_range([grad], scale=2.0**16).underflow_fraction == 0.0  # 2^-14 is fine


def test_all_non_finite_gradients_do_not_crash_and_count_as_overflow():
    grad = torch.tensor([math.inf, -math.inf, math.nan, 0.0])
    r = gradient_range([grad, torch.full((3, 2), math.nan)], scale=2.0**16, per_tensor=True)
    assert (r.numel, r.overflow, r.zeros, r.underflow) == (10, 9, 1, 0)
    assert sum(r.histogram) == 0 and histogram_kwargs(r.histogram)["num"] == 0


def test_per_tensor_rows_add_up_to_the_total_and_keep_each_tensors_buckets():
    a = torch.full((4, 4), 2.0**-20)
    b = torch.tensor([2.0**3, -(2.0**3), 0.0])
    c = torch.full((5,), 2.0**-40)
    per = gradient_range([a, b, c], scale=1.0, per_tensor=True)
    total = gradient_range([a, b, c], scale=1.0)
    assert len(per.counts) == 3
    assert per.counts[0][-20 - LOG2_LOW] == 16 and sum(per.counts[0]) == 16
    assert per.counts[1][3 - LOG2_LOW] == 2 and sum(per.counts[1]) == 2
    assert per.counts[2][-40 - LOG2_LOW] == 5 and sum(per.counts[2]) == 5
    assert per.histogram == total.histogram
    assert (per.zeros, per.underflow, per.overflow) == (total.zeros, total.underflow, total.overflow) == (1, 5, 0)


def test_chunking_large_gradient_sets_gives_the_same_counts(monkeypatch):
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) * 2.0 ** torch.randint(-40, 20, (n,), generator=g) for n in (7, 30, 3, 64, 1)]
    grads[1][5] = math.inf
    grads[3][:10] = 0.0
    whole = gradient_range(grads, scale=2.0**16, per_tensor=True)
    monkeypatch.setattr(lh, "_CHUNK_NUMEL", 16)  # several chunks, and tensors bigger than a chunk alone
    assert len(lh._chunks(grads)) > 2
    assert gradient_range(grads, scale=2.0**16, per_tensor=True) == whole


def test_measuring_leaves_the_gradients_untouched():
    single = torch.tensor([-1.0, -(2.0**-30), math.nan])
    pair = [torch.tensor([-2.0, 0.5]), torch.tensor([-3.0])]
    before = [t.clone() for t in [single, *pair]]
    gradient_range([single], scale=2.0**16)
    gradient_range(pair, scale=2.0**16)
    for t, b in zip([single, *pair], before):
        torch.testing.assert_close(t, b, equal_nan=True)


def test_no_gradients_give_empty_counts():
    r = gradient_range([], scale=1.0)
    assert r.numel == 0 and r.zero_fraction == 0.0 and sum(r.histogram) == 0


# ---------------------------------------------------------------------------------------------- reference scale
@pytest.mark.parametrize(
    "plugin, scale",
    [
        (MixedPrecisionPlugin("fp16", init_scale=2.0**8), 2.0**8),  # the scale this step used
        (MixedPrecisionPlugin("fp16", loss_scale=None), 1.0),  # fp16 without scaling: what really happens
        (MixedPrecisionPlugin("bf16"), 2.0**16),  # what FP16 would start with
        (MixedPrecisionPlugin("fp32"), 2.0**16),
    ],
    ids=["fp16-dynamic", "fp16-unscaled", "bf16", "fp32"],
)
def test_fractions_are_measured_against_fp16_at_this_scale(plugin, scale):
    assert lh.reference_scale(plugin) == scale


# ---------------------------------------------------------------------------------------------- CUDA cost
@cuda
@pytest.mark.cuda
def test_measuring_on_cuda_queues_everything_without_a_host_sync():
    grads = [torch.randn(1000, 100, device="cuda") * 2.0**-20, torch.full((7,), math.inf, device="cuda")]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = lh.measure_on_device(grads, 2.0**16, per_tensor=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    r = lh.unpack(packed.tolist(), 100_007, 2)
    assert r.overflow == 7 and sum(r.counts[0]) == 100_000
