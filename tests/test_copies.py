"""Which forward shows the 16-bit copies (the covers), the fold's C-level path, and the per-thread GEMM staging."""

import threading

import pytest
import torch
from torch import nn

from lightning_mp.gemm.staging import _Staging
from lightning_mp.numerics.copies import covers_of
from lightning_mp.numerics.master_weights import MasterWeights
from lightning_mp.policy.mode import _native_mixed_batch_norm
from lightning_mp.policy.modules import needs_hooks

BF16 = torch.bfloat16


def deep():
    """root -> body (Sequential) -> blocks (ModuleList) -> block (Sequential) -> inner (Sequential) -> Linear"""
    block = lambda: nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 4))  # noqa: E731
    root = nn.Sequential(nn.Linear(4, 4), nn.Sequential(*[block() for _ in range(2)]), nn.Linear(4, 1))
    return root


def seen_dtypes(model):
    seen = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, args, out: seen.append(mod.weight.dtype))
    return seen


def run(module, x):
    with torch.autocast("cpu", dtype=BF16):
        return module(x)


def test_covers_are_the_root_and_two_calls_below_it_with_module_lists_adding_no_level():
    net = nn.Module()
    net.layers = nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))) for _ in range(2)])
    net.head = nn.Linear(2, 2)
    covers = list(covers_of(net))
    assert covers[0] is net and net.head in covers and net.layers not in covers
    assert all(layer in covers and layer[0] in covers for layer in net.layers)  # through the list: levels 1 and 2
    assert all(layer[1][0] not in covers for layer in net.layers)  # level 3


def test_the_whole_model_forward_reads_copies_and_a_deep_module_called_alone_reads_its_fp32_parameters():
    torch.manual_seed(0)
    model = deep()
    seen = seen_dtypes(model)
    masters = MasterWeights(BF16)
    masters.convert(model)
    masters.begin(force=True)
    x = torch.randn(3, 4)
    run(model, x).float().sum().backward()
    assert seen == [BF16] * 6  # levels 3 and 4 included: the root's forward shows its whole subtree
    assert all(p.dtype == torch.float32 for p in model.parameters())
    masters.fold_grads()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())

    deepest = model[1][0][0][0]  # level 3: no hook of its own
    seen.clear()
    model.zero_grad(set_to_none=True)
    out = run(deepest, x)
    assert seen == [torch.float32] and out.dtype == BF16  # bf16-mixed semantics: autocast casts the FP32 weight
    out.float().sum().backward()
    masters.fold_grads()
    expected = torch.ones(3, 4).T @ x.bfloat16().float()  # d(sum)/dW: the bf16 GEMM of the bf16 input
    assert deepest.weight.grad.dtype == torch.float32
    torch.testing.assert_close(deepest.weight.grad, expected, atol=0, rtol=2**-8)
    assert all(p.grad is None for p in model.parameters() if p is not deepest.weight and p is not deepest.bias)


def test_covers_seen_only_inside_another_lose_their_hooks_after_the_first_step_and_the_run_is_unchanged():
    torch.manual_seed(0)
    model = deep()
    twin = deep()
    twin.load_state_dict(model.state_dict())
    masters = MasterWeights(BF16)
    masters.convert(model)
    x = torch.randn(3, 4)
    outs = []
    for _ in range(3):
        masters.begin(force=True)
        outs.append(run(model, x))
    assert model._forward_pre_hooks  # the root keeps its pair
    assert not model[1]._forward_pre_hooks and not model[1][0]._forward_pre_hooks  # seen only inside the root
    assert torch.equal(outs[0], outs[2])
    reference = MasterWeights(BF16)  # a fresh store: every cover still hooked
    reference.convert(twin)
    reference.begin(force=True)
    assert torch.equal(run(twin, x), outs[2])


def test_a_cover_called_inside_its_own_forward_and_a_sibling_called_inside_a_cover_read_copies():
    class Recursive(nn.Module):
        def __init__(self, sibling):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.sibling = [sibling]  # not a submodule: another cover's subtree

        def forward(self, x, depth=2):
            x = self.lin(x)
            x = self.sibling[0](x)
            return self(x, depth - 1) if depth else x

    root = nn.Module()
    root.b = nn.Linear(4, 4)
    root.a = Recursive(root.b)
    seen = seen_dtypes(root)
    masters = MasterWeights(BF16)
    masters.convert(root)
    masters.begin(force=True)
    run(root.a, torch.randn(2, 4))
    assert seen == [BF16] * 6
    assert "weight" not in root.a.lin.__dict__ and "weight" not in root.b.__dict__  # all taken out again
    assert root.a.lin.weight.dtype == torch.float32


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


@pytest.mark.parametrize("module, op", [(nn.LayerNorm(4), "layer_norm"), (nn.GroupNorm(2, 4), "group_norm"),
                                        (nn.BatchNorm1d(4), "batch_norm"), (nn.RMSNorm(4), "rms_norm")])
def test_one_op_fp32_modules_need_hooks_only_where_their_op_is_not_an_active_fp32_kernel(module, op):
    assert needs_hooks(module, None)  # no kernels active (a standalone install)
    assert not needs_hooks(module, frozenset({op}))
    assert needs_hooks(module, frozenset({"softmax"}))  # their op left out of fp32_ops: the hooks compute it in FP32
    assert not needs_hooks(nn.Embedding(4, 2), frozenset())  # an FP32 table's lookup is FP32 under autocast
    assert needs_hooks(nn.LSTM(4, 4), frozenset({op}))


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
            xs = [torch.randn(32, 32).half() for _ in range(6)]
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
