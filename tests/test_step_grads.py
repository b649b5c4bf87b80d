"""What the step reads of an optimizer's gradients (lightning_mp/numerics/step_grads.py): the inf/NaN flag of a few CPU
gradients in one fused pass, the read-only check elsewhere, and the reduce that says whether it covered every
gradient (then the flag needs no agreement of its own across ranks)."""

import math
from unittest import mock

import pytest
import torch
from torch import nn

from lightning_mp.numerics import step_grads
from lightning_mp.numerics.grad_layout import GradLayout
from lightning_mp.numerics.loss_scaler import LossScaler
from lightning_mp.numerics.step import MixedPrecisionStep
from lightning_mp.numerics.step_grads import SMALL_CHECK, non_finite_flag
from tests.test_step import flat_model


def grads_of(params):
    return GradLayout(params).read(params)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", ["tiled", "loose"])
def test_a_few_cpu_gradients_are_checked_in_one_fused_pass_that_leaves_them_as_they_were(bad, where):
    params, tiled, loose, flat = flat_model()
    grads = grads_of(params)
    before = [p.grad.clone() for p in params]
    with mock.patch.object(torch, "_amp_foreach_non_finite_check_and_unscale_",
                           wraps=torch._amp_foreach_non_finite_check_and_unscale_) as fused:
        assert non_finite_flag(grads).item() == 0.0
    assert fused.call_count == 1  # one pass over the run and the loose gradients; the read-only check makes 5 calls
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))  # unscaled by 1.0: bitwise the same
    (tiled if where == "tiled" else loose)[1].grad.view(-1)[2] = bad
    assert non_finite_flag(grads_of(params)).item() == 1.0


def test_many_elements_or_gradients_with_a_graph_are_checked_read_only():
    big = nn.Parameter(torch.zeros(SMALL_CHECK + 1))
    big.grad = torch.zeros(SMALL_CHECK + 1)
    graph = nn.Parameter(torch.zeros(3))
    graph.grad = torch.zeros(3, requires_grad=True) * 1.0  # create_graph=True leaves a gradient with a graph
    for params in ([big], [graph]):
        versions = [p.grad._version for p in params]
        assert non_finite_flag(grads_of(params)).item() == 0.0
        assert [p.grad._version for p in params] == versions  # not written: the gradient's graph stays usable
    big.grad[-1] = math.nan
    assert non_finite_flag(grads_of([big])).item() == 1.0


def averaging(grads):
    pass


averaging.same_on_every_rank = True


@pytest.mark.parametrize("reduce_, sparse, agreements", [
    (averaging, False, 0),  # every rank holds the same averaged gradients: the same flag, no collective for it
    (averaging, True, 1),  # a sparse gradient is not averaged: its flag may differ between ranks
    (lambda grads: None, False, 1),  # a reduce that does not say its results are the same on every rank
])
def test_the_flag_is_agreed_across_ranks_unless_every_gradient_was_averaged(reduce_, sparse, agreements):
    # before: the flag's own all-reduce ran after the gradients' average too, a second collective per step
    step = MixedPrecisionStep(LossScaler(None), reduce_=reduce_)
    dense = nn.Parameter(torch.ones(2))
    dense.grad = torch.full((2,), math.inf)
    params = [dense]
    if sparse:
        emb = nn.Parameter(torch.ones(4, 2))
        emb.grad = torch.sparse_coo_tensor([[1]], torch.ones(1, 2), (4, 2))
        params.append(emb)
    with mock.patch("lightning_mp.numerics.step.agree_on_overflow_", wraps=lambda flag: flag) as agree:
        assert step.unscale_(torch.optim.SGD(params, lr=1.0)) is True  # the overflow is seen either way
    assert agree.call_count == agreements


def test_the_reduce_passes_every_gradient_and_zeros_for_missing_ones_on_the_steady_path():
    seen = []
    a, b, c = (nn.Parameter(torch.ones(2)) for _ in range(3))
    a.grad, b.grad, c.grad = torch.ones(2), torch.full((2,), 2.0), torch.full((2,), 3.0)
    cache = step_grads.StepGradients()
    assert cache.reduce([a, b, c], seen.append) is True
    assert seen[-1][0] is a.grad and seen[-1][2] is c.grad  # the gradients themselves, in the optimizer's order
    b.grad = None
    assert cache.reduce([a, b, c], seen.append) is True
    assert torch.equal(seen[-1][1], torch.zeros(2)) and b.grad is seen[-1][1]
