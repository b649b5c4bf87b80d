"""The locator's tensor checks on their own: which tensors, which mode, and the inf/NaN/magnitude numerics."""

import math

import pytest
import torch

from lightning_mp.doctor.finite_checks import (
    _amax,
    _bare,
    _cpu_non_finite,
    _first_non_finite,
    _non_finite,
    _real_dense,
    _tensors,
    _to_host,
)
from lightning_mp.policy.policy import Fp32Policy


@pytest.mark.parametrize(
    "values, expected",
    [([1.0, 2.0], None), ([1.0, math.inf], "inf"), ([-math.inf, 1.0], "-inf"), ([math.inf, math.nan], "nan")],
)
def test_cpu_non_finite_names_the_value_nan_first(values, expected):
    assert _cpu_non_finite(torch.tensor(values)) == expected
    assert _non_finite(values) == expected


def test_an_fp16_tensor_whose_sum_passes_65504_is_finite():
    assert _cpu_non_finite(torch.full((4, 8), 60000.0, dtype=torch.half)) is None  # each row sums to 480000
    # one row summing to 100000 rounds to inf in FP16; the element-by-element confirmation finds nothing
    assert _cpu_non_finite(torch.full((1000,), 100.0, dtype=torch.half)) is None
    assert _cpu_non_finite(torch.tensor([1.0, math.inf], dtype=torch.half)) == "inf"


def test_an_empty_tensor_is_finite():
    assert _cpu_non_finite(torch.empty(0)) is None


def test_amax_is_the_largest_magnitude_and_inf_for_nan():
    assert _amax([-3.0, 2.0]) == 3.0
    assert _amax([math.nan, 1.0]) == math.inf
    assert _amax([]) is None


def test_to_host_keeps_the_order_across_dtypes():
    tensors = [torch.tensor(1.0), torch.tensor(2.0, dtype=torch.half), torch.tensor(-math.inf), torch.tensor(4.0)]
    assert _to_host(tensors) == [1.0, 2.0, -math.inf, 4.0]
    assert _to_host([]) == []


def test_sparse_and_complex_gradients_are_checked_as_real_values():
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, math.inf], (4,), check_invariants=True)
    assert _real_dense(sparse).tolist() == [1.0, math.inf]
    assert _real_dense(torch.tensor([1 + 2j])).tolist() == [[1.0, 2.0]]


def test_the_tensors_of_an_output_one_level_deep():
    a, b = torch.ones(1), torch.zeros(1)
    assert list(_tensors(a)) == [a]
    assert [t is x for t, x in zip(_tensors((a, 3, b)), (a, b))] == [True, True]
    assert list(_tensors({"x": a, "n": 1})) == [a]
    assert list(_tensors([(a,)])) == [] and list(_tensors(None)) == []


def test_checks_run_outside_autocast_and_the_fp32_policy():
    x = torch.ones(4, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Policy().op_context():
        assert torch.softmax(x, 0).dtype == torch.float32
        assert torch.mm(x.float().view(2, 2), x.float().view(2, 2)).dtype == torch.bfloat16
        with _bare():
            assert torch.softmax(x, 0).dtype == torch.bfloat16
            assert torch.mm(x.float().view(2, 2), x.float().view(2, 2)).dtype == torch.float32


def test_first_non_finite_names_the_first_tensor_in_the_order_given_and_its_value():
    a, b, c = torch.ones(4), torch.tensor([1.0, -math.inf]), torch.tensor([math.nan])
    assert _first_non_finite([a, b, c]) == (1, "-inf")
    assert _first_non_finite([c, b]) == (0, "nan")
    assert _first_non_finite([a, torch.ones(2, dtype=torch.float64)]) is None
    assert _first_non_finite([]) is None


def test_first_non_finite_is_not_fooled_by_a_norm_that_overflows():
    fp16 = torch.full((1000,), 60000.0, dtype=torch.half)  # a 16-bit norm would be inf
    huge = torch.full((4,), 1e30)  # an FP32 2-norm overflows, no element does
    assert _first_non_finite([fp16, huge]) is None
    assert _first_non_finite([fp16, huge, torch.tensor([math.inf], dtype=torch.bfloat16)]) == (2, "inf")
