"""OverflowLocator without a Trainer: which module it names, in which phase, what it costs to leave installed."""

import math
from unittest import mock

import pytest
import torch
from torch import nn

from lightning_mp import overflow_locator as ol
from lightning_mp.doctor import step_report
from lightning_mp.doctor.locator import OverflowLocator, OverflowReport
from tests.conftest import cuda


class Scale(nn.Module):
    """Multiplies by a constant: x 1e6 overflows FP16 (65504) for any input above ~0.07."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class _AmplifyGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class GradAmplifier(nn.Module):
    """Identity in the forward; multiplies the gradient by ``factor`` in the backward: a backward-only overflow."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return _AmplifyGrad.apply(x, self.factor)


class OwnCode(nn.Module):
    """Overflows in its own forward code, between two submodules."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x) * 1e6)


class OutOfOrder(nn.Module):
    """Registers `late` before `early` but calls `early` first: execution order, not registration order, counts."""

    def __init__(self):
        super().__init__()
        self.late = Scale(1e6)
        self.early = Scale(1e6)

    def forward(self, x):
        return self.late(self.early(x))


def half_mlp(middle):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), middle, nn.ReLU(), nn.Linear(8, 1)).half()


def step(model, locator, x, scale=1.0):
    model.zero_grad(set_to_none=True)  # the gradients of this step only, as an optimizer loop sees them
    locator.begin_step()
    (model(x).float().sum() * scale).backward()
    return locator.report()


X = torch.full((3, 4), 0.5, dtype=torch.half)


@pytest.fixture(params=["eager", "deferred"])
def path(request, monkeypatch):
    """Both check paths on the CPU: read at once (CPU) and kept on the device until report() (CUDA and others)."""
    if request.param == "deferred":
        monkeypatch.setattr(ol, "_EAGER_DEVICE_TYPES", frozenset())
    return request.param


# ---------------------------------------------------------------------------------------------- forward
def test_forward_overflow_names_the_module_whose_output_went_inf_and_its_input_magnitude(path):
    model = half_mlp(Scale(1e6))
    locator = OverflowLocator(model)
    report = step(model, locator, X)
    h = model[0](X)
    assert report == OverflowReport("forward", "1", "Scale", "output", "inf", h.abs().max().item())
    assert str(report).startswith("forward overflow in `1` (Scale): output went inf; largest input magnitude ")


def test_the_first_module_in_execution_order_is_named_not_the_first_registered(path):
    model = OutOfOrder().half()
    report = step(model, OverflowLocator(model), torch.ones(2, 2, dtype=torch.half, requires_grad=True))
    assert (report.module, report.phase) == ("early", "forward")


def test_an_overflow_in_a_parents_own_code_names_the_parent(path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), OwnCode()).half()
    report = step(model, OverflowLocator(model), X)
    assert (report.module, report.module_type, report.tensor, report.phase) == ("1", "OwnCode", "own code", "forward")
    assert "own forward code" in str(report)


def test_a_non_finite_batch_is_reported_at_the_first_module_with_its_input_non_finite(path):
    model = half_mlp(nn.Identity())
    x = X.clone()
    x[0, 0] = math.nan
    report = step(model, OverflowLocator(model), x)
    assert (report.module, report.value, report.input_amax) == ("0", "nan", math.inf)
    assert str(report).endswith("its input was already non-finite")


# ---------------------------------------------------------------------------------------------- backward
def test_a_backward_only_overflow_names_the_parameter_free_module_whose_backward_made_it(path):
    model = half_mlp(GradAmplifier(1e6))
    report = step(model, OverflowLocator(model), X, scale=1.0)
    assert (report.phase, report.module, report.module_type, report.tensor) == (
        "backward", "1", "GradAmplifier", "input gradient"
    )  # fmt: skip
    assert report.input_amax is None and str(report) == (
        "backward overflow in `1` (GradAmplifier): input gradient went inf"
    )


def test_without_input_grads_the_nearest_parameter_upstream_is_named(path):
    model = half_mlp(GradAmplifier(1e6))
    report = step(model, OverflowLocator(model, input_grads=False), X)
    assert (report.phase, report.module, report.tensor) == ("backward", "0", "gradient of bias")


def test_a_loss_scale_too_large_names_the_last_layer_in_the_backward(path):
    model = half_mlp(nn.Identity())
    report = step(model, OverflowLocator(model), X, scale=2.0**20)  # 3 rows x 2^20 > 65504 in the weight gradient
    assert report.phase == "backward" and report.module == "3"


def test_a_forward_overflow_wins_over_the_backward_non_finite_it_causes(path):
    model = half_mlp(Scale(1e6))
    assert step(model, OverflowLocator(model), X, scale=2.0**20).phase == "forward"


# ---------------------------------------------------------------------------------------------- the loss
def loss_step(model, locator, x, scale=1.0, fault=1.0):
    """A step whose loss is shown to the locator before its backward (what the plugin does)."""
    model.zero_grad(set_to_none=True)
    locator.begin_step()
    loss = model(x).float().sum() * fault
    locator.note_loss(loss)
    (loss * scale).backward()
    return locator.report()


def test_a_non_finite_loss_with_the_forward_checks_off_is_a_forward_overflow_not_the_gradient_it_reached(path):
    model = half_mlp(Scale(1e6))
    locator = OverflowLocator(model, forward=False)
    report = loss_step(model, locator, X)
    # the first non-finite gradient (the last Linear's) is only where the backward carried the forward's inf
    assert (report.phase, report.module, report.tensor, report.forward_checked) == ("forward", None, "loss", False)
    assert (report.reached.phase, report.reached.module, report.reached.module_type) == ("backward", "3", "Linear")
    assert str(report).startswith(
        f"forward overflow: the loss was already {report.value}, so the forward made it; no module output was "
        "checked in this step (the forward checks were off), so the module is not named; the backward carried it "
        "to `3` (Linear) first: gradient of "
    )
    locator.check_forward = True  # armed: the module's own output is named, not the loss
    armed = loss_step(model, locator, X)
    assert (armed.phase, armed.module, armed.module_type, armed.tensor) == ("forward", "1", "Scale", "output")


def test_a_loss_made_non_finite_after_finite_module_outputs_is_named_as_the_loss(path):
    model = half_mlp(Scale(1.0))
    report = loss_step(model, OverflowLocator(model), X, fault=math.nan)
    assert (report.phase, report.module, report.tensor, report.forward_checked) == ("forward", None, "loss", True)
    assert report.name == "<loss>" and report.reached is None
    assert str(report) == (
        "forward overflow in the loss: every module's output was finite, the loss went nan (the loss function, or "
        "code outside the modules, made it)"
    )


def test_a_finite_loss_leaves_a_backward_overflow_a_backward_one(path):
    model = half_mlp(nn.Identity())
    report = loss_step(model, OverflowLocator(model, forward=False), X, scale=2.0**20)
    assert (report.phase, report.module) == ("backward", "3")


def test_the_losses_of_a_step_are_forgotten_at_the_next_and_kept_by_reference_only():
    model = half_mlp(Scale(1.0))
    locator = OverflowLocator(model, forward=False)
    loss = torch.tensor(math.inf)
    locator.note_loss(loss)
    assert locator._losses[0] is loss  # nothing copied or read
    locator.begin_step()
    assert locator.report() is None  # no gradient and no loss of this step


# ---------------------------------------------------------------------------------------------- clean steps
def test_a_clean_step_reports_none_and_begin_step_forgets_the_last_overflow(path):
    model = half_mlp(Scale(1.0))
    locator = OverflowLocator(model)
    assert step(model, locator, X) is None
    model[1].factor = 1e6
    assert step(model, locator, X) is not None
    model[1].factor = 1.0
    assert step(model, locator, X) is None


def test_fp16_tensors_whose_sum_passes_65504_are_not_mistaken_for_overflow(path):
    model = nn.Sequential(Scale(1.0)).half()
    locator = OverflowLocator(model)
    big = torch.full((4, 8), 60000.0, dtype=torch.half, requires_grad=True)  # every row sums to 480000
    assert step(model, locator, big) is None


def test_forwards_without_autograd_are_not_checked(path):
    model = half_mlp(Scale(1e6))
    locator = OverflowLocator(model)
    locator.begin_step()
    with torch.no_grad():
        model(X)
    assert locator.report() is None and not locator._records and not locator._found


def test_the_locator_changes_no_output_and_no_gradient():
    model = half_mlp(Scale(3.0))
    x = X.clone().requires_grad_()
    out = model(x)
    out.float().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    locator = OverflowLocator(model)
    locator.begin_step()
    out2 = model(x)
    out2.float().sum().backward()
    assert torch.equal(out, out2)
    for a, b in zip(grads, [p.grad for p in model.parameters()] + [x.grad]):
        assert torch.equal(a, b)


def test_remove_takes_every_hook_off():
    model = half_mlp(Scale(1e6))
    locator = OverflowLocator(model)
    locator.remove()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(not p._backward_hooks for p in model.parameters())
    assert step(model, locator, X) is None


def test_a_forgotten_begin_step_stops_recording_instead_of_growing(path, monkeypatch):
    monkeypatch.setattr(ol, "_MAX_RECORDS", 10)
    model = half_mlp(Scale(1.0))
    locator = OverflowLocator(model)
    for _ in range(5):
        model(X).float().sum().backward()
    assert len(locator._records) <= 10


def test_each_activation_is_checked_once_in_the_device_path(monkeypatch):
    monkeypatch.setattr(ol, "_EAGER_DEVICE_TYPES", frozenset())
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model = nn.Sequential(inner, nn.Linear(4, 1))  # `inner` returns its ReLU's tensor
    locator = OverflowLocator(model, input_grads=False)
    locator.begin_step()
    model(torch.ones(2, 4)).sum().backward()
    forward = [locator.module_names[r[1]] for r in locator._records if r[2] == 0 and r[4]]
    assert forward == ["0.0", "0.1", "1"]  # not "0" (same tensor as "0.1") and not "" (same as "1")


# ---------------------------------------------------------------------------------------------- skipped steps
class LinearsOutOfOrder(nn.Module):
    """Registers `late` before `early` but runs `early` first."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(4, 1)
        self.early = nn.Linear(4, 4)

    def forward(self, x):
        return self.late(self.early(x))


def nan_step(model, locator):
    model.zero_grad(set_to_none=True)
    locator.begin_step()
    (model(torch.ones(2, 4)).sum() * math.nan).backward()  # every gradient NaN: the order alone decides


def test_with_forward_checks_off_a_clean_step_installs_nothing_and_reads_nothing(monkeypatch):
    model = half_mlp(Scale(1.0))
    locator = OverflowLocator(model, forward=False)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(not p._backward_hooks for p in model.parameters())
    for module, name in ((ol, "_cpu_non_finite"), (step_report, "_first_non_finite"), (ol, "_host_amax")):
        monkeypatch.setattr(module, name, mock.Mock(side_effect=AssertionError(f"{name} on a clean step")))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        locator.begin_step()
        loss = model(X).float().sum()
        locator.note_loss(loss)  # kept, not read
        loss.backward()
    assert not locator._records and not locator._found and not locator._known


def test_armed_at_a_skip_the_forward_checks_name_the_module_from_the_next_skip(path):
    model = half_mlp(Scale(1e6))
    locator = OverflowLocator(model, forward=False)
    first = step(model, locator, X)  # no forward hook yet: the gradients say where the inf landed
    assert (first.phase, first.module, first.module_type) == ("backward", "3", "Linear")
    locator.check_forward = True
    assert all(m._forward_hooks and m._forward_pre_hooks for m in model.modules())
    report = step(model, locator, X)
    assert (report.phase, report.module) == ("forward", "1")
    locator.check_forward = False
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_backward_order_is_the_reverse_of_execution_order_once_the_forward_hooks_saw_a_forward():
    model = LinearsOutOfOrder()
    locator = OverflowLocator(model, forward=False)
    nan_step(model, locator)
    # no hook has seen a forward: registration order (`late` first), reversed, wrongly puts `early` last
    assert locator.report().module == "early"
    locator.check_forward = True
    nan_step(model, locator)
    assert locator.report() == OverflowReport("backward", "late", "Linear", "gradient of bias", "nan")


def test_gradients_handed_over_before_they_are_dropped_are_reported_after():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    locator = OverflowLocator(model, forward=False)
    nan_step(model, locator)
    named = [(n, p.grad) for n, p in model.named_parameters()]
    assert locator.locate_gradients(named[2:]).module == "1"
    model.zero_grad(set_to_none=True)  # what a skipped step does to the optimizer's gradients
    assert locator.report().module == "1"


def test_of_several_optimizers_the_gradient_earliest_in_the_backward_wins_whatever_the_call_order():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    locator = OverflowLocator(model, forward=False)
    nan_step(model, locator)
    named = [(n, p.grad) for n, p in model.named_parameters()]
    locator.locate_gradients(named[2:])  # the second optimizer steps first
    assert locator.locate_gradients(named[:2]).module == "1"
    assert locator.report().module == "1"
    locator.begin_step()
    assert locator.locate_gradients([(n, torch.zeros_like(g)) for n, g in named]) is None


def test_a_parameter_added_after_the_locator_is_named_by_its_module():
    model = nn.Sequential(nn.Linear(4, 4))
    locator = OverflowLocator(model, forward=False)
    model[0].scale = nn.Parameter(torch.ones(1))
    report = locator.locate_gradients([("0.weight", torch.ones(4, 4)), ("0.scale", torch.tensor([math.inf]))])
    assert (report.module, report.module_type, report.tensor) == ("0", "Linear", "gradient of scale")


# ---------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("bad", [None, "model", 3])
def test_model_must_be_a_module(bad):
    with pytest.raises(ValueError, match=rf"model={bad!r} is not allowed.*nn.Module"):
        OverflowLocator(bad)


@pytest.mark.parametrize("bad", [1, "yes", None])
@pytest.mark.parametrize("arg", ["input_grads", "forward"])
def test_input_grads_and_forward_must_be_bools(arg, bad):
    with pytest.raises(ValueError, match=rf"{arg}={bad!r} is not allowed: use True or False"):
        OverflowLocator(nn.Linear(2, 2), **{arg: bad})
    with pytest.raises(ValueError, match=rf"check_forward={bad!r} is not allowed"):
        OverflowLocator(nn.Linear(2, 2)).check_forward = bad


# ---------------------------------------------------------------------------------------------- CUDA
@cuda
@pytest.mark.cuda
def test_on_cuda_a_clean_step_makes_no_host_sync_and_an_overflow_is_still_named():
    model = half_mlp(Scale(1.0)).cuda()
    locator = OverflowLocator(model)
    x = X.cuda()
    step(model, locator, x)  # warm up: first-call allocations may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        locator.begin_step()
        model(x).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert locator.report() is None
    model[1].factor = 1e6
    assert step(model, locator, x).module == "1"
