"""Flags left on the device (:mod:`lightning_mp.numerics.deferred`) with plain optimizers, no Trainer: a fused optimizer
skips on the device bit for bit as the host path skips, the scale moves as it does there, the host reads nothing
during a clean step and reads the flag one step late."""

import pytest
import torch
from torch import nn

from lightning_mp.numerics.deferred import fused_amp_step
from lightning_mp.numerics.loss_scaler import LossScaler
from lightning_mp.numerics.step import MixedPrecisionStep
from tests.conftest import cuda
from tests.host_reads import recording

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1, fused=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
}
# (scaler mode, knobs, steps whose gradients get an inf): the fp16 machine with hysteresis and growth, knobs whose
# factors are no powers of two (the host rounds in double, the device must pick the same FP32 numbers), bf16's guard
SCALERS = {
    "hysteresis": ("dynamic", dict(init_scale=2.0**4, growth_interval=2, hysteresis=2), {0, 3, 4, 5, 9}),
    "odd_factors": ("dynamic", dict(init_scale=1000.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=2,
                                    max_scale=1e5), {2, 3, 7, 8}),
    "unscaled": (None, {}, {1, 4, 5}),
}


def snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for p in model.parameters() for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v)}
    return params, state, sorted(len(s) for s in opt.state.values())


def train(optimizer, mode, knobs, faults, defer, steps=12, loss_dtype=torch.float32, reads=None):
    """Steps of a tiny net; returns each step's scale, parameters and optimizer state, and the scaler's final state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = OPTIMIZERS[optimizer](model.parameters())
    step = MixedPrecisionStep(LossScaler(mode, **knobs))
    step.deferral.enabled = defer
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    scales, states, per_step = [], [], []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        scales.append(step.scaler.scale_loss(torch.ones((), dtype=loss_dtype)).item())
        if reads is not None:
            reads.clear()
            reads.on = True
        loss = model(x).pow(2).mean().to(loss_dtype)
        step.scaler.scale_loss(loss).backward()
        if i in faults:
            model[0].weight.grad[0, 1] = float("inf")
        step.step(opt)
        step.end_training_step(i)
        if reads is not None:
            reads.on = False
            per_step.append((reads.sync, reads.deferred))
        states.append(snapshot(model, opt))
    step.settle()
    return scales, states, step.scaler.state_dict(), per_step


@pytest.mark.parametrize("scaler", SCALERS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_fused_optimizer_skips_on_the_device_bit_for_bit_as_the_host_path(optimizer, scaler):
    mode, knobs, faults = SCALERS[scaler]
    on_host = train(optimizer, mode, knobs, faults, defer=False)
    on_device = train(optimizer, mode, knobs, faults, defer=True)
    assert on_device[0] == on_host[0]  # the scale each step's backward used
    assert on_device[2] == on_host[2]  # the scaler's counters, trackers and scale at the end
    for i, ((p1, s1, n1), (p2, s2, n2)) in enumerate(zip(on_host[1], on_device[1])):
        assert n1 == n2, i  # the same optimizer state entries: a skipped first step creates none
        assert all(torch.equal(a, b) for a, b in zip(p1, p2)), i
        assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1), i
    assert on_device[2]["skipped_steps"] == len(faults)


@pytest.mark.parametrize(("loss_dtype", "scaler"), [(torch.float16, "odd_factors"), (torch.bfloat16, "odd_factors"),
                                                    (torch.float64, "hysteresis")])
def test_the_device_scale_multiplies_a_16_bit_or_fp64_loss_as_the_host_scale_does(loss_dtype, scaler):
    """An FP64 loss: the same where the scale is a power of two (the default factors); otherwise the device's FP32
    scale differs from the host's double in its last bits."""
    mode, knobs, faults = SCALERS[scaler]
    on_host = train("adamw", mode, knobs, faults, defer=False, loss_dtype=loss_dtype)
    on_device = train("adamw", mode, knobs, faults, defer=True, loss_dtype=loss_dtype)
    assert on_device[0] == on_host[0]
    assert all(torch.equal(a, b) for a, b in zip(on_host[1][-1][0], on_device[1][-1][0]))


@pytest.mark.parametrize("mode", ["dynamic", None])
def test_a_clean_step_reads_nothing_and_the_flag_is_read_one_step_late(mode):
    with recording(on=False) as reads:
        *_, per_step = train("adamw", mode, {}, faults=set(), defer=True, steps=5, reads=reads)
    # the first step reads its flag before the step (the optimizer's state is created by a step the host decided);
    # from the second on nothing, and each step's end reads the step before it from its copy
    assert per_step == [(1, 0), (0, 0), (0, 1), (0, 1), (0, 1)]
    with recording(on=False) as reads:
        *_, per_step = train("adamw", mode, {}, faults=set(), defer=False, steps=3, reads=reads)
    assert per_step == [(1, 0)] * 3  # the host path: one sync per step, before the optimizer step


def test_only_torchs_fused_optimizers_take_the_flag_on_the_device():
    ps = [nn.Parameter(torch.zeros(2))]
    assert fused_amp_step(torch.optim.AdamW(ps, fused=True)) and fused_amp_step(torch.optim.SGD(ps, lr=1, fused=True))
    assert not fused_amp_step(torch.optim.AdamW(ps)) and not fused_amp_step(torch.optim.AdamW(ps, foreach=True))
    assert not fused_amp_step(torch.optim.SGD(ps, lr=1)) and not fused_amp_step(torch.optim.LBFGS(ps))


def prepared(n=2, fused=(True, True)):
    """A step object and ``n`` optimizers that each stepped once (so fused ones take the device path)."""
    step = MixedPrecisionStep(LossScaler("dynamic", init_scale=8.0, growth_interval=100))
    params, opts = [], []
    for f in fused[:n]:
        p = nn.Parameter(torch.ones(3))
        params.append(p)
        opts.append(torch.optim.SGD([p], lr=1.0, fused=True) if f else torch.optim.SGD([p], lr=1.0))
    for p, opt in zip(params, opts):
        p.grad = torch.full((3,), 8.0)
        step.step(opt)
    step.end_training_step(0)
    return step, params, opts


def test_an_overflow_skips_every_later_optimizer_of_the_training_step_on_the_device():
    step, (p1, p2), (opt1, opt2) = prepared()
    p1.grad, p2.grad = torch.full((3,), float("inf")), torch.full((3,), 8.0)
    before = [p1.detach().clone(), p2.detach().clone()]
    assert step.check_(opt1) is None and step.check_(opt2) is None  # nothing read: on the device
    step.step(opt1)
    step.step(opt2)  # finite itself, but the training step is skipped
    step.end_training_step(1)
    assert torch.equal(p1.detach(), before[0]) and torch.equal(p2.detach(), before[1])
    assert step.scaler.skipped_steps == 0 and step.steps == 2  # the host has not read it yet
    assert step.skipping and step.scaler.skipped_steps == 1 and step.scaler.scale == 4.0  # asking reads it


def test_a_host_path_optimizer_after_a_device_one_reads_the_flags_left_on_the_device():
    step, (p1, p2), (opt1, opt2) = prepared(fused=(True, False))
    p1.grad, p2.grad = torch.full((3,), float("nan")), torch.full((3,), 8.0)
    before = p2.detach().clone()
    assert step.check_(opt1) is None
    assert step.check_(opt2) is True  # its own flag is clean, the fused optimizer's is not
    assert step.step(opt2) is None and torch.equal(p2.detach(), before) and torch.equal(p2.grad, torch.ones(3))
    step.end_training_step(1)
    assert step.scaler.skipped_steps == 1  # known on the host: nothing left to read late


def test_unscale_reads_a_flag_left_on_the_device():
    step, (p1,), (opt1,) = prepared(n=1)
    p1.grad = torch.full((3,), float("inf"))
    assert step.unscale_(opt1) is True and step.decided is True
    assert step.step(opt1) is None  # skipped on the host, as the flag is known there now


def test_max_consecutive_skips_stops_the_run_one_step_late_naming_the_step():
    def run(defer):
        step, (p,), (opt,) = prepared(n=1)
        step.scaler.max_consecutive_skips = 2
        step.deferral.enabled = defer
        for i in range(1, 5):
            p.grad = torch.full((3,), float("inf") if i in (2, 3) else 8.0)
            step.step(opt)
            try:
                step.end_training_step(i)
            except FloatingPointError as err:
                return i, str(err), p.detach().clone()

    at, message, _ = run(defer=False)
    late_at, late_message, weights = run(defer=True)
    assert (at, late_at) == (3, 4)  # the step after the stop has been taken by the time the host reads the flag
    assert late_message == message and "at step 3" in message
    assert not torch.equal(weights, torch.ones(3))


def test_a_checkpoint_and_the_counters_read_the_pending_flag():
    step, (p,), (opt,) = prepared(n=1)
    p.grad = torch.full((3,), float("inf"))
    step.step(opt)
    step.end_training_step(1)
    assert step.steps == 2 and step.scaler.steps == 1
    state = step.state_dict()  # reads it: the checkpoint holds this step
    assert state["scaler"]["skipped_steps"] == 1 and state["scaler"]["scale"] == 4.0 and step.scaler.steps == 2


def test_a_skip_read_late_is_reported_to_the_callback_before_the_scale_moves():
    seen = []
    step, (p,), (opt,) = prepared(n=1)
    step.on_late_skip = lambda number: seen.append((number, step.scaler.scale))
    p.grad = torch.full((3,), float("inf"))
    step.step(opt)
    step.end_training_step(7)
    assert seen == []
    step.settle()
    assert seen == [(7, 8.0)] and step.scaler.scale == 4.0


@cuda
def test_a_clean_cuda_step_with_a_fused_optimizer_makes_no_host_sync():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = MixedPrecisionStep(LossScaler("dynamic"))
    x = torch.randn(32, 64, device="cuda")
    for i in range(6):
        opt.zero_grad(set_to_none=True)
        if i >= 2:  # from the third step on: every step reads only the step before it, from pinned memory
            torch.cuda.set_sync_debug_mode("error")
        try:
            step.scaler.scale_loss(model(x).pow(2).mean()).backward()
            step.step(opt)
            step.end_training_step(i)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    step.settle()
    assert step.scaler.steps == 6 and step.scaler.skipped_steps == 0
