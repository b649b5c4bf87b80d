"""Lean bf16's glue without a Trainer: which parameters turn bf16, and that checkpoints and the end of a fit see the
exact FP32 masters."""

import pytest
import torch
from torch import nn

from lightning_mp import resolve_precision
from lightning_mp.numerics.lean import DRIFT_WARNING, LeanBf16, lean_bf16

BF16 = resolve_precision("bf16")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _keep_norms(module):
    return isinstance(module, nn.LayerNorm)


def _converted(state_dtype=torch.float32, parity=0.0):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lean = LeanBf16(state_dtype, parity)
    lean.convert(model, _keep_norms)
    return model, lean, before


def test_trainable_fp32_parameters_outside_kept_modules_become_bf16_and_their_masters_stay_exact():
    model, lean, before = _converted()
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16] * 2 + [torch.float32] * 2 + [torch.bfloat16] * 2
    for (name, p), value in zip(model.named_parameters(), before.values()):
        assert torch.equal(lean.master(p), value), name  # bit for bit, not the bf16 value
        assert torch.equal(p.float(), value.bfloat16().float()) or p.dtype == torch.float32


def test_state_dict_holds_the_fp32_masters_and_load_state_dict_splits_them_back_exactly():
    model, lean, before = _converted()
    state = model.state_dict()
    assert all(v.dtype == torch.float32 and torch.equal(v, before[k]) for k, v in state.items())
    shifted = {k: v + 1e-4 for k, v in state.items()}  # below a bf16 ulp at most weights: only the remainder moves
    model.load_state_dict(shifted)
    assert all(torch.equal(v, shifted[k]) for k, v in model.state_dict().items())


def test_a_bf16_checkpoint_loads_with_zero_remainders():
    model, lean, before = _converted()
    model.load_state_dict({k: v.bfloat16() for k, v in before.items()})
    assert all(torch.equal(v, before[k].bfloat16().float()) for k, v in model.state_dict().items())


def test_remove_gives_back_the_fp32_model_it_trained():
    model, lean, before = _converted()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(5):
        model.zero_grad()
        model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
        lean.step(optimizer)
    masters = [lean.master(p) for p in model.parameters()]
    assert any(not torch.equal(m, p.float()) for m, p in zip(masters, model.parameters()))  # below a bf16 ulp
    lean.remove()
    assert all(p.dtype == torch.float32 and torch.equal(p, m) for p, m in zip(model.parameters(), masters))
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())


def test_fp32_optimizer_state_survives_load_state_dict_in_fp32():
    model, lean, _ = _converted()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    lean.watch([optimizer])
    model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    lean.step(optimizer)
    saved = optimizer.state_dict()
    moments = [saved["state"][i]["exp_avg_sq"].clone() for i in range(6)]
    assert all(m.dtype == torch.float32 for m in moments)
    optimizer.load_state_dict(saved)  # torch alone casts the moments to the bf16 parameters' dtype
    restored = [optimizer.state[p]["exp_avg_sq"] for p in model.parameters()]
    assert all(r.dtype == torch.float32 and torch.equal(r, m) for r, m in zip(restored, moments))


def test_the_parity_guard_measures_zero_drift_for_exact_masters():
    model, lean, _ = _converted(parity=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    for _ in range(3):
        model.zero_grad()
        model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
        lean.step(optimizer)
    assert lean.parity == (0.0, 0.0) and DRIFT_WARNING == 2**-7


def _backward(model, seed):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    model(x).float().pow(2).sum().backward()


def test_a_second_micro_batch_sums_into_fp32_gradients_and_a_new_window_starts_in_bf16():
    model, lean, _ = _converted()
    owned = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    lean.before_backward()  # nothing to add to yet: the gradients stay absent
    _backward(model, 0)
    first = [p.grad.clone() for p in owned]
    assert all(g.dtype == torch.bfloat16 for g in first)  # one backward: 2 B per element, as before
    model.zero_grad()
    _backward(model, 1)
    second = [p.grad.clone() for p in owned]
    model.zero_grad()
    _backward(model, 0)
    lean.before_backward()  # the front ends call it before every backward: the bf16 sum becomes FP32, exactly
    assert all(p.grad.dtype == torch.float32 and torch.equal(p.grad, g.float()) for p, g in zip(owned, first))
    _backward(model, 1)
    for p, a, b in zip(owned, first, second):  # the FP32 sum of the two bf16 gradients, as FP32 masters fold them
        assert p.dtype == torch.bfloat16 and torch.equal(p.grad, a.float() + b.float())
    # 4 B per element until the step, which rounds the sums back to bf16 (2 B) for the time until zero_grad
    assert sum(p.grad.untyped_storage().nbytes() for p in owned) == 4 * sum(p.numel() for p in owned)
    sums = [p.grad.clone() for p in owned]
    lean.step(torch.optim.SGD(owned, lr=0.0))
    assert all(p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, s.bfloat16()) for p, s in zip(owned, sums))
    model.zero_grad()
    lean.before_backward()
    _backward(model, 0)  # a new window: bf16 again
    assert all(p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, g) for p, g in zip(owned, first))


def test_clipping_upcasts_only_its_optimizers_gradients_and_the_step_reads_them():
    model, lean, _ = _converted()
    first, last = model[0], model[2]
    optimizer = torch.optim.SGD(first.parameters(), lr=1.0)
    _backward(model, 0)
    grads = [p.grad.clone() for p in first.parameters()]
    before = [lean.master(p) for p in first.parameters()]
    lean.before_clipping(optimizer)
    assert all(p.grad.dtype == torch.float32 for p in first.parameters())
    assert all(p.grad.dtype == torch.bfloat16 for p in last.parameters())  # another optimizer's: left alone
    torch.nn.utils.clip_grad_norm_(first.parameters(), 1e-3)  # in FP32: no bf16 rounding of the scaled values
    clipped = [p.grad.clone() for p in first.parameters()]
    assert all(not torch.equal(c, g.float()) for c, g in zip(clipped, grads))
    assert all(not torch.equal(c, c.bfloat16().float()) for c in clipped)
    lean.step(optimizer)
    for p, m, c in zip(first.parameters(), before, clipped):
        assert torch.equal(lean.master(p), m - c)  # SGD of lr 1 read the clipped FP32 gradient
        assert p.grad.dtype == torch.bfloat16  # and rounded it back to bf16 after the step


def test_gradients_stay_bf16_where_the_ranks_reduce_them(monkeypatch):
    import lightning_mp.numerics.lean as lean_module

    monkeypatch.setattr(lean_module, "_distributed", lambda: True)  # DDP's reducer copies into bf16 buckets
    model, lean, _ = _converted()
    _backward(model, 0)
    lean.before_backward()
    lean.before_clipping(torch.optim.SGD(model.parameters(), lr=1.0))
    dtypes = [torch.bfloat16] * 2 + [torch.float32] * 2 + [torch.bfloat16] * 2  # the LayerNorm is FP32
    assert [p.grad.dtype for p in model.parameters()] == dtypes


def test_a_second_model_is_refused_clearly():
    model, lean, _ = _converted()
    with pytest.raises(ValueError, match=r"one model per plugin.*HINT"):
        lean.convert(_model(), _keep_norms)


@pytest.mark.parametrize(
    "args, match",
    [(("fp16", "compensated", None, 0.0), r"master_weights='compensated' with precision='fp16' is not allowed"),
     (("bf16", "exact", None, 0.0), r"master_weights='exact' is not allowed: use True, False, None .* or 'compensated'"),
     (("bf16", True, torch.bfloat16, 0.0), r"optimizer_state_dtype=torch.bfloat16 is not allowed without"),
     (("bf16", "compensated", torch.float16, 0.0), r"optimizer_state_dtype=torch.float16 is not allowed"),
     (("bf16", "compensated", None, 1.5), r"parity_guard=1.5 is not allowed"),
     (("bf16", None, None, 0.1), r"parity_guard=0.1 is not allowed without master_weights='compensated'")],
)  # fmt: skip
def test_bad_lean_arguments_name_the_argument(args, match):
    precision, *rest = args
    with pytest.raises(ValueError, match=match):
        lean_bf16(resolve_precision(precision), *rest)
