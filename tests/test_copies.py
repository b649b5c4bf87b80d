"""The fold's C-level path, which copies a live graph holds, FP32 modules that need no hooks, batch norm's argument
check, the per-thread GEMM staging."""

import threading

import pytest
import torch
from torch import nn

from lightning_mp.gemm.staging import _Staging
from lightning_mp.numerics.copies import flat_views, held, in_a_graph, none_held
from lightning_mp.numerics.master_weights import MasterWeights
from lightning_mp.policy.mode import _native_mixed_batch_norm
from lightning_mp.policy.modules import needs_fp32_forward

BF16 = torch.bfloat16


def run(module, x):
    with torch.autocast("cpu", dtype=BF16):
        return module(x)


def test_the_fold_takes_the_c_level_path_and_the_per_parameter_path_to_the_same_sums():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    masters = MasterWeights(BF16)
    masters.convert(model)
    x = torch.randn(5, 4)
    for _ in range(2):  # the second backward accumulates: every .grad exists, the add path
        masters.begin(force=True)
        run(model, x).float().sum().backward()
        masters.fold_grads()
    both = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    masters.begin(force=True)
    run(model, x).float().sum().backward()
    model[1].bias.grad = None  # one copy's gradient held back: the per-parameter path
    masters.fold_grads()
    masters.begin(force=True)
    run(model, x).float().sum().backward()
    masters.fold_grads()
    assert all(torch.equal(a, b.grad) for a, b in zip(both[:3], list(model.parameters())[:3]))
    assert not any(c.grad is not None for c in masters._copies)


@pytest.mark.filterwarnings("ignore:Using backward.. with create_graph=True")
def test_a_backward_with_create_graph_folds_without_recording_a_graph():
    model = nn.Linear(3, 1)
    masters = MasterWeights(BF16)
    masters.convert(model)
    masters.begin(force=True)
    out = run(model, torch.randn(2, 3, requires_grad=True))
    out.float().pow(2).sum().backward(create_graph=True)
    masters.fold_grads()
    assert model.weight.grad.dtype == torch.float32 and model.weight.grad.grad_fn is None


def test_held_reads_the_references_a_live_graph_takes_on_a_copy():
    # the refresh writes a copy in place only where this says no graph saved it: a canary for torch's reference
    # counting (Tensor._use_count), on which it relies
    weight, bias = flat_views([torch.empty(3, 4), torch.empty(3)], BF16, leaf=True)
    weight.requires_grad_(), bias.requires_grad_()
    frozen = torch.zeros(3, 4, dtype=BF16)
    assert not held(weight) and not in_a_graph(weight) and none_held([weight, bias], True)
    x = torch.randn(2, 4, dtype=BF16, requires_grad=True)
    out = nn.functional.linear(x, weight, bias) + nn.functional.linear(x, frozen)  # saves weight.t() and frozen.t()
    assert held(weight) and held(frozen) and not none_held([weight, bias, frozen], False)
    assert not held(bias) and in_a_graph(bias)  # an add saves nothing, but the graph still sends it a gradient
    out.sum().backward()  # the saved tensors go; `out` keeps the graph's nodes, and so the gradient accumulators
    assert not held(weight) and not held(frozen) and in_a_graph(weight) and none_held([weight, bias], True)
    del out
    assert not in_a_graph(weight) and not in_a_graph(bias)


@pytest.mark.parametrize("module, op", [(nn.LayerNorm(4), "layer_norm"), (nn.GroupNorm(2, 4), "group_norm"),
                                        (nn.BatchNorm1d(4), "batch_norm"), (nn.RMSNorm(4), "rms_norm")])
def test_one_op_fp32_modules_need_hooks_only_where_their_op_is_not_an_active_fp32_kernel(module, op):
    assert needs_fp32_forward(module, None)  # no kernels active (a standalone install)
    assert not needs_fp32_forward(module, frozenset({op}))
    assert needs_fp32_forward(module, frozenset({"softmax"}))  # their op left out of fp32_ops: an FP32 forward
    assert not needs_fp32_forward(nn.Embedding(4, 2), frozenset())  # an FP32 table's lookup is FP32 under autocast
    assert needs_fp32_forward(nn.LSTM(4, 4), frozenset({op}))


def test_batch_norm_argument_check_takes_the_flat_path_and_agrees_with_the_walk():
    x = torch.randn(4, 3).bfloat16()
    bn = nn.BatchNorm1d(3)
    flat = (*bn._parameters.values(), *bn._buffers.values())  # num_batches_tracked: int64, ignored
    assert _native_mixed_batch_norm(x, flat) and _native_mixed_batch_norm(x, list(flat))
    half = (bn.weight.bfloat16(), bn.bias)
    assert not _native_mixed_batch_norm(x, half) and not _native_mixed_batch_norm(x, list(half))
    assert not _native_mixed_batch_norm(x.float(), flat)


def test_gemm_staging_keeps_each_threads_copies_apart():
    staging = _Staging()
    results, errors = {}, []

    def work(seed):
        try:
            torch.manual_seed(seed)
            xs = [torch.randn(512, 256).half() for _ in range(6)]  # remembered: at least MEMO_MIN elements
            for _ in range(20):
                for x in xs:
                    assert torch.equal(staging.take(x), x.float())
                    assert torch.equal(staging.take(x.t()), x.t().float())
                    staging.done(None)
            results[seed] = len(staging._memo)
            staging.clear()
        except AssertionError as err:
            errors.append(err)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == {seed: staging.MEMO for seed in range(4)}
    assert len(staging._memo) == 0  # this thread's memo: never used here


def test_a_layer_norm_without_hooks_still_computes_in_fp32_inside_a_fit_and_with_its_op_unlisted_keeps_them():
    from lightning_mp.policy.policy import BF16_FP32_OPS, Fp32Policy

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    x = torch.randn(2, 4)
    for ops, hooked in ((BF16_FP32_OPS, False), (BF16_FP32_OPS - {"layer_norm"}, True)):
        policy = Fp32Policy(ops, (nn.LayerNorm,))
        with policy.activate(), policy.install(model, "cpu", kernels_active=True):
            assert ("forward" in model[1].__dict__) is hooked
            out = run(model, x)
        assert out.dtype == torch.float32  # the kernel or the hooks: FP32 either way
        torch.testing.assert_close(out, model[1](run(model[0], x).float()), atol=1e-6, rtol=0)  # LN in FP32
