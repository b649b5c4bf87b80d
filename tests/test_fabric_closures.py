"""``optimizer.step(closure)`` in a Fabric loop with lightning_mp.fabric.MixedPrecisionPlugin: LBFGS and a SAM-style
optimizer that calls the closure itself; the closure's ``fabric.backward`` goes through the plugin. A dynamic scale
with several backward passes per step: every pass at the step's scale, the first decides skip-or-step, a later
non-finite one stops with a hint; LBFGS with a dynamic scale is refused, as by the Trainer plugin."""

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mp.fabric import MixedPrecisionPlugin
from tests.conftest import inside_forward


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation (Foret et al.): the gradient at ``w + rho * g / |g|`` steps ``w``; ``step`` calls
    the closure for the second point itself, as the common implementations do."""

    def __init__(self, params, lr=0.1, rho=0.05):
        super().__init__(params, dict(lr=lr, rho=rho))

    @torch.no_grad()
    def step(self, closure):
        closure = torch.enable_grad()(closure)  # as torch's LBFGS: the closure differentiates
        loss = closure()  # the gradient at w
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        moves = [p.grad * (self.defaults["rho"] / norm) for p in params]
        torch._foreach_add_(params, moves)
        closure()  # the gradient at the perturbed point
        torch._foreach_sub_(params, moves)
        torch._foreach_add_(params, [p.grad * -self.defaults["lr"] for p in params])
        return loss


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def xy():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.3


def closure_run(optimizer, plugin=None, precision=None, steps=4, fault=None, **opt_kwargs):
    """The loop: ``optimizer.step(closure)``; ``fault(step, call)`` scales the loss of that closure call."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin] if plugin else None, precision=precision)
    module = net()
    model, opt = fabric.setup(module, optimizer(module.parameters(), **opt_kwargs))
    x, y = xy()
    seen = {"calls": [], "weight_dtypes": set(), "scales": []}
    inside_forward(module[0], lambda m, args, out: seen["weight_dtypes"].add(m.weight.dtype))
    losses = []
    for step in range(steps):
        calls = [0]

        def closure():
            calls[0] += 1
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if fault is not None:
                loss = loss * fault(step, calls[0])
            if plugin is not None:
                seen["scales"].append((step, plugin.loss_scale))
            fabric.backward(loss)
            assert all(p.grad.dtype == torch.float32 for p in model.parameters())
            return loss

        loss = opt.step(closure)  # None: skipped
        losses.append(None if loss is None else float(loss.detach()))
        seen["calls"].append(calls[0])
    return model, losses, seen


def weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("precision, kwargs", [("bf16", {}), ("fp16", {"loss_scale": 2.0**8})])
def test_lbfgs_trains_through_the_plugin_as_in_fp32(precision, kwargs):
    lbfgs = dict(optimizer=torch.optim.LBFGS, lr=0.5, max_iter=5)
    model, losses, seen = closure_run(plugin=MixedPrecisionPlugin(precision, **kwargs), **lbfgs)
    plain, plain_losses, _ = closure_run(precision="32-true", **lbfgs)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    assert seen["weight_dtypes"] == {dtype}  # every evaluation, the re-evaluations too, ran on 16-bit copies
    assert min(seen["calls"]) > 1  # LBFGS re-evaluated inside step()
    # unscaled FP32 gradients each time: a scaled one (x256 under fp16) would send LBFGS elsewhere
    assert losses[-1] < 0.2 * losses[0]
    assert losses[-1] == pytest.approx(plain_losses[-1], rel=0.05, abs=1e-3)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_lbfgs_with_a_dynamic_scale_is_refused_as_by_the_trainer_plugin():
    with pytest.raises(ValueError, match=r"LBFGS re-evaluates its closure.*HINT: use a static loss_scale"):
        closure_run(torch.optim.LBFGS, plugin=MixedPrecisionPlugin("fp16"), steps=1)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_sam_calls_the_closure_twice_per_step_and_trains_as_in_fp32(precision):
    model, losses, seen = closure_run(SAM, plugin=MixedPrecisionPlugin(precision, init_scale=2.0**8), steps=6)
    plain, plain_losses, _ = closure_run(SAM, precision="32-true", steps=6)
    assert seen["calls"] == [2] * 6
    eps = 2.0**-8 if precision == "bf16" else 2.0**-11
    torch.testing.assert_close(weights(model), weights(plain), rtol=0, atol=64 * eps)
    assert losses[-1] < losses[0]


def test_a_dynamic_scale_is_one_per_step_and_the_first_evaluation_decides_the_skip():
    # fp16, dynamic: every backward of a step runs at the step's scale; an overflow in SAM's first evaluation
    # skips the step (nothing moves, the second point is never evaluated) and the scale backs off once
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8, growth_interval=1)
    clean, _, _ = closure_run(SAM, plugin=MixedPrecisionPlugin("fp16", init_scale=2.0**8, growth_interval=1), steps=1)
    model, _, seen = closure_run(SAM, plugin=plugin, steps=3, fault=lambda s, c: float("inf") if s == 1 else 1.0)
    assert seen["calls"] == [2, 1, 2]
    assert [s for _, s in seen["scales"]] == [2.0**8, 2.0**8, 2.0**9, 2.0**8, 2.0**8]  # grew, backed off, held
    assert plugin.skipped_steps == 1 and plugin.training_steps == 3
    assert not torch.equal(weights(model), weights(clean))


def test_an_overflow_in_a_later_evaluation_stops_with_the_step_the_scale_and_a_hint():
    # SAM moved the parameters before its second evaluation: the step cannot be skipped halfway
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8)
    with pytest.raises(FloatingPointError, match=r"loss scale 256 when SAM re-evaluated its closure.*HINT"):
        closure_run(SAM, plugin=plugin, steps=2, fault=lambda s, c: float("inf") if (s, c) == (1, 2) else 1.0)
