"""MixedPrecisionStep with plain optimizers: no Trainer, no plugin."""

from unittest import mock

import pytest
import torch
from torch import nn

from lightning_mp.loss_scaler import LossScaler
from lightning_mp.step import MixedPrecisionStep


def sgd(value=1.0, grad=None, lr=1.0, shape=(3,)):
    p = nn.Parameter(torch.full(shape, value))
    if grad is not None:
        p.grad = torch.full(shape, grad)
    return p, torch.optim.SGD([p], lr=lr)


def test_unscale_is_idempotent_within_a_training_step():
    step = MixedPrecisionStep(LossScaler("dynamic", init_scale=8.0))
    p, opt = sgd(grad=8.0)
    assert step.unscale_(opt) is False
    assert step.unscale_(opt) is False  # e.g. clipping called it first, then the step
    assert torch.equal(p.grad, torch.ones(3))  # divided once
    step.step(opt)
    assert torch.equal(p.detach(), torch.zeros(3))
    step.end_training_step()
    assert step.scaler.steps == 1


def test_overflow_skips_the_step_and_every_later_optimizer_of_the_training_step_scale_moves_once():
    scaler = LossScaler("dynamic", init_scale=8.0, growth_interval=1)
    step = MixedPrecisionStep(scaler)
    p1, opt1 = sgd(grad=float("inf"))
    p2, opt2 = sgd(grad=8.0)
    assert step.step(opt1) is None and step.skipping
    assert step.step(opt2) is None  # finite itself, but the training step is skipped
    assert torch.equal(p1.detach(), torch.ones(3)) and torch.equal(p2.detach(), torch.ones(3))
    assert p1.grad is None and p2.grad is None  # poisoned gradients dropped
    step.end_training_step(step=7)
    assert scaler.scale == 4.0 and scaler.skipped_steps == 1 and scaler.steps == 1
    assert step.skipping  # between steps: the last one was skipped
    # next training step: clean for both, one growth
    for p, opt in ((p1, opt1), (p2, opt2)):
        p.grad = torch.full((3,), 4.0)
        step.step(opt)
    step.end_training_step()
    assert scaler.scale == 8.0 and not step.skipping and scaler.steps == 2


def test_an_optimizer_that_stepped_before_the_overflow_stays_stepped():
    step = MixedPrecisionStep(LossScaler(None))
    p1, opt1 = sgd(grad=1.0)
    p2, opt2 = sgd(grad=float("nan"))
    step.step(opt1)
    step.step(opt2)
    step.end_training_step()
    assert torch.equal(p1.detach(), torch.zeros(3)) and torch.equal(p2.detach(), torch.ones(3))


def test_check_without_scaling_reads_the_gradients_without_rewriting_them():
    step = MixedPrecisionStep(LossScaler(None))
    p, opt = sgd(grad=0.5)
    version = p.grad._version
    assert step.unscale_(opt) is False
    assert p.grad._version == version  # read-only check: no multiply by 1.0
    p.grad[0] = float("nan")
    step.end_training_step()
    assert step.unscale_(opt) is True


def test_guard_off_and_no_scaling_costs_no_pass_and_no_host_sync():
    step = MixedPrecisionStep(LossScaler(None), check_finite=False)
    p, opt = sgd(grad=float("nan"))
    with mock.patch.object(torch.Tensor, "item", side_effect=AssertionError("host sync")), mock.patch(
        "lightning_mp.step._non_finite_flag", side_effect=AssertionError("pass over the gradients")
    ):
        assert step.unscale_(opt) is False
        step.step(opt)
    assert p.detach().isnan().all()  # the user's choice: nothing stops the NaN (as in bf16-mixed)


def test_a_16_bit_gradient_reaching_the_optimizer_under_master_weights_raises_with_a_hint():
    step = MixedPrecisionStep(LossScaler(None), fp32_grads=True)
    p = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"torch.bfloat16 gradient.*HINT"):
        step.unscale_(torch.optim.SGD([p], lr=1.0))


def test_sparse_and_complex_gradients_are_unscaled_and_checked():
    step = MixedPrecisionStep(LossScaler(4.0))
    emb = nn.Embedding(5, 2, sparse=True)
    emb(torch.tensor([1, 1, 3])).sum().backward()  # uncoalesced: index 1 twice
    c = nn.Parameter(torch.ones(2, dtype=torch.complex64))
    c.grad = torch.full((2,), 4 + 8j, dtype=torch.complex64)
    opt = torch.optim.SGD([emb.weight, c], lr=1.0)
    expected = torch.zeros(5, 2)
    expected[1], expected[3] = 2.0 / 4, 1.0 / 4
    assert step.unscale_(opt) is False
    assert torch.equal(emb.weight.grad.to_dense(), expected)
    assert torch.equal(c.grad, torch.full((2,), 1 + 2j, dtype=torch.complex64))
    step.end_training_step()
    c.grad = torch.tensor([1 + 1j, complex(0, float("inf"))], dtype=torch.complex64)
    assert step.unscale_(opt) is True


def test_reduce_sees_the_same_list_on_every_rank_missing_gradients_as_zeros():
    seen = []
    step = MixedPrecisionStep(LossScaler(None), reduce_=lambda grads: seen.append([g.clone() for g in grads]))
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    a.grad = torch.full((2,), 3.0)
    step.unscale_(torch.optim.SGD([a, b], lr=1.0))
    assert [g.tolist() for g in seen[0]] == [[3.0, 3.0], [0.0, 0.0, 0.0]]


def test_forget_lets_a_closure_optimizer_check_each_evaluation():
    step = MixedPrecisionStep(LossScaler(None))
    p, opt = sgd(grad=1.0)
    assert step.unscale_(opt) is False
    p.grad.fill_(float("inf"))
    assert step.unscale_(opt) is False  # cached for this training step
    step.forget(opt)
    assert step.unscale_(opt) is True


def test_state_round_trip_and_a_newer_version_is_refused():
    scaler = LossScaler("dynamic", init_scale=64.0, growth_interval=3)
    step = MixedPrecisionStep(scaler)
    p, opt = sgd(grad=float("inf"))
    step.step(opt)
    step.end_training_step()
    state = step.state_dict()
    assert state["version"] == 2 and state["scaler"]["scale"] == 32.0
    other = MixedPrecisionStep(LossScaler("dynamic", init_scale=64.0, growth_interval=3))
    other.load_state_dict(state)
    assert other.scaler.state_dict() == scaler.state_dict()
    with pytest.raises(ValueError, match="version 3 is newer.*HINT"):
        other.load_state_dict({**state, "version": 3})
    with pytest.raises(KeyError, match="'scaler'"):
        other.load_state_dict({"version": 2})
