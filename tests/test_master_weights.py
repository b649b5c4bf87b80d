"""MasterWeights without a Trainer: the Parameters stay FP32 and in place, the forward reads 16-bit copies, their
gradients fold into the FP32 ``.grad``."""

import copy
import operator
import pickle

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_mp.numerics.master_weights import MasterWeights
from tests.conftest import inside_forward

BF16 = torch.bfloat16


def watched(model, keep=lambda m: False):
    masters = MasterWeights(BF16, keep_fp32=keep)
    masters.convert(model)
    masters.begin(force=True)
    return masters


def record_weight_dtypes(model):
    seen = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            inside_forward(m, lambda mod, args, out: seen.append((mod.weight.dtype, out.dtype)))
    return seen


def fwd(module, x):
    with torch.autocast("cpu", dtype=BF16):
        return module(x)


def step(model, masters, x, force=True):
    masters.begin(force)
    with torch.autocast("cpu", dtype=BF16):
        loss = model(x).float().sum()
    loss.backward()
    masters.fold_grads()
    return loss


def test_the_forward_reads_16_bit_copies_and_the_parameters_stay_fp32_in_place():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    seen = record_weight_dtypes(model)
    ptrs = [p.data_ptr() for p in model.parameters()]
    masters = watched(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grad_ptrs = []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        step(model, masters, torch.randn(2, 4))
        grad_ptrs.append([p.grad.data_ptr() for p in model.parameters()])
        opt.step()
        masters.mark_stale(model.parameters())
    assert set(seen) == {(BF16, BF16)}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # never re-pointed
    assert grad_ptrs[0] == grad_ptrs[1] == grad_ptrs[2]  # the FP32 gradients land in one persistent buffer
    assert all(type(m.__dict__.get("weight")) is not torch.Tensor for m in model.modules())  # nothing left behind


def test_copies_are_the_round_to_nearest_of_the_current_master_and_follow_optimizer_steps():
    lin = nn.Linear(3, 2, bias=False)
    got = []
    inside_forward(lin, lambda m, a, o: got.append(m.weight.detach().clone()))
    masters = watched(lin)
    fwd(lin, torch.ones(1, 3))
    assert torch.equal(got[-1], lin.weight.detach().to(BF16))
    with torch.no_grad():
        lin.weight.add_(1.0)  # an optimizer-style in-place update: the version counter moves
    masters.begin()
    fwd(lin, torch.ones(1, 3))
    assert torch.equal(got[-1], lin.weight.detach().to(BF16))


@pytest.mark.parametrize("force", [False, True])
def test_a_copy_a_live_graph_holds_is_refreshed_into_another_tensor_and_that_graph_backpropagates_as_built(force):
    # issue 37's GAN: a graph is built, an optimizer steps its masters, the next forward refreshes the copies; the
    # first graph's backward then reads the values it was built with (as under bf16-mixed: autocast casts a fresh
    # tensor per forward) and its gradients still reach the FP32 .grad
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    masters = watched(lin)
    x = torch.randn(5, 4, requires_grad=True)  # the weight is saved for the input's gradient; the bias is not saved
    built_on = [p.detach().to(BF16) for p in (lin.weight, lin.bias)]
    held = fwd(lin, x)
    homes = list(masters._copies)
    with torch.no_grad():
        for p in lin.parameters():
            p.add_(0.5)  # an optimizer step
    masters.mark_stale(lin.parameters())
    masters.begin(force)
    later = fwd(lin, x.detach())  # the refresh, while `held` still holds the weight's copy
    assert all(torch.equal(c, p.detach().to(BF16)) for c, p in zip(masters._copies, masters.params))
    assert masters._copies[0] is not homes[0] and masters._copies[1] is homes[1]  # only the held one moved out
    held.float().sum().backward()  # raised "modified by an inplace operation" while the refresh wrote in place
    masters.fold_grads()

    w, b = (t.clone().requires_grad_() for t in built_on)
    x_ref = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=BF16):
        nn.functional.linear(x_ref, w, b).float().sum().backward()
    assert torch.equal(x.grad, x_ref.grad)  # the backward computed with the values the forward used
    assert torch.equal(lin.weight.grad, w.grad.float()) and torch.equal(lin.bias.grad, b.grad.float())

    later.float().sum().backward()
    masters.fold_grads()
    assert torch.equal(lin.weight.grad, 2 * w.grad.float())  # both graphs' gradients, summed in FP32
    del held, later
    masters.begin(force=True)
    fwd(lin, x)
    assert all(map(torch.equal, masters._copies, [p.detach().to(BF16) for p in masters.params]))
    assert all(map(operator.is_, masters._copies, homes)) and not masters._retired  # back in the flat buffer


def test_a_steady_loop_refreshes_the_copies_in_place_in_their_flat_buffer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    masters = watched(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    copies = list(masters._copies)
    versions = [c._version for c in copies]
    for _ in range(3):
        loss = step(model, masters, torch.randn(2, 4))  # the loop keeps `loss` (and so its graph's nodes) to the step
        opt.step()
        opt.zero_grad()
        masters.mark_stale(model.parameters())
    masters.begin(force=True)
    fwd(model, torch.randn(2, 4))
    assert loss.grad_fn is not None
    assert all(map(operator.is_, masters._copies, copies)) and not masters._retired  # no tensor allocated
    assert all(c._version > v for c, v in zip(copies, versions))  # written in place
    assert all(map(torch.equal, copies, [p.detach().to(BF16) for p in masters.params]))


def test_a_lazy_module_materialized_inside_the_first_forward_keeps_the_gradients_of_the_modules_before_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LazyLinear(2))
    x = torch.randn(5, 3)
    masters = watched(model)
    grads = []
    for _ in range(2):  # the first forward rebuilds the copies when LazyLinear materializes, after Linear's ran
        step(model, masters, x)
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        masters.begin(force=True)
    assert all(map(torch.equal, *grads))


def test_a_data_write_before_the_forward_is_seen_by_a_forced_refresh():
    lin = nn.Linear(3, 2, bias=False)
    got = []
    inside_forward(lin, lambda m, a, o: got.append(m.weight.detach().clone()))
    masters = watched(lin)
    fwd(lin, torch.ones(1, 3))
    masters.begin(force=True)
    lin.weight.data.clamp_(0.0, 0.0)  # invisible to version counters
    fwd(lin, torch.ones(1, 3))
    assert torch.count_nonzero(got[-1]) == 0


def test_gradients_of_two_backwards_sum_in_fp32_and_zero_grad_clears_them():
    w = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        w.weight.fill_(1.0)
    masters = watched(w)
    x_big, x_small = torch.tensor([[256.0]]), torch.tensor([[1.0]])
    for x in (x_big, x_small):  # 256 + 1 = 257: not a bf16 number (8 significant bits)
        masters.begin()
        fwd(w, x).float().sum().backward()
        masters.fold_grads()
    assert w.weight.grad.item() == 257.0
    w.weight.grad = None  # zero_grad(set_to_none=True)
    masters.begin()
    fwd(w, x_small).float().sum().backward()
    masters.fold_grads()
    assert w.weight.grad.item() == 1.0


def test_a_kept_module_is_fp32_through_its_subtree_and_tied_weights_share_one_copy():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            return self.inner(x)

    emb = nn.Embedding(8, 4)
    head = nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"block": Block(), "emb": emb, "head": head})
    masters = watched(model, keep=lambda m: isinstance(m, Block))
    assert all(p is not model["block"].inner.weight for p in masters.params)  # under a kept module: no copy
    assert sum(p is emb.weight for p in masters.params) == 1  # one copy for the tied weight
    h = model["emb"](torch.tensor([1, 2]))
    with torch.autocast("cpu", dtype=BF16):
        out = model["head"](h)
    out.float().sum().backward()
    masters.fold_grads()
    assert emb.weight.grad.dtype == torch.float32 and emb.weight.grad.abs().sum() > 0


def test_a_frozen_bf16_parameter_stays_bf16_until_it_is_unfrozen():
    lin = nn.Linear(4, 4).to(BF16).requires_grad_(False)
    masters = watched(lin)
    fwd(lin, torch.ones(1, 4, dtype=BF16))
    assert lin.weight.dtype == BF16 and not masters.params
    lin.requires_grad_(True)  # BaseFinetuning unfreezes it mid-fit
    masters.begin()
    with pytest.warns(UserWarning, match="already in torch.bfloat16"):
        fwd(lin, torch.ones(1, 4, dtype=BF16)).float().sum().backward()
    masters.fold_grads()
    assert lin.weight.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32


def test_a_frozen_fp32_copy_is_made_once_and_refreshed_when_its_value_changes():
    lin = nn.Linear(4, 4).requires_grad_(False)
    masters = watched(lin)
    copy_ = masters._copies[0]
    fwd(lin, torch.ones(1, 4))
    version = copy_._version
    for _ in range(3):
        masters.begin(force=True)  # trainable copies are refreshed; a frozen one only when its master changed
        fwd(lin, torch.ones(1, 4))
    assert copy_._version == version
    lin.load_state_dict({k: v + 1 for k, v in lin.state_dict().items()})
    masters.begin()
    fwd(lin, torch.ones(1, 4))
    assert torch.equal(copy_, lin.weight.detach().to(BF16))


def test_a_frozen_fp32_parameter_gets_a_copy_but_no_gradient_buffer_until_it_is_unfrozen():
    model = nn.Sequential(nn.Linear(64, 64).requires_grad_(False), nn.Linear(64, 2))  # LoRA's shape: a frozen base
    masters = watched(model)
    trainable = sum(p.numel() for p in model[1].parameters())
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage() for v in masters._grad_views if v is not None}
    assert sum(s.nbytes() for s in storages.values()) == 4 * trainable  # the frozen 64x64 weight and its bias: none
    assert len(masters._copies) == 4  # a copy each, frozen ones included: they compute as trainable ones do
    step(model, masters, torch.randn(2, 64))
    assert model[0].weight.grad is None and model[1].weight.grad.dtype == torch.float32
    model[0].requires_grad_(True)  # BaseFinetuning unfreezes it mid-fit: its gradient gets a buffer then
    step(model, masters, torch.randn(2, 64))
    assert model[0].weight.grad.dtype == torch.float32 and model[0].weight.grad.abs().sum() > 0
    assert masters._grad_views[0] is model[0].weight.grad  # the view it was given, filled by the fold


def test_lazy_modules_and_pruning_after_the_build_get_copies():
    model = nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 1))
    seen = record_weight_dtypes(model)
    masters = watched(model)
    step(model, masters, torch.randn(2, 3))
    assert seen[0] == (BF16, BF16) and model[0].weight.grad.dtype == torch.float32
    nn.utils.prune.l1_unstructured(model[1], "weight", amount=0.5)
    step(model, masters, torch.randn(2, 3))
    assert model[1].weight_orig.grad.dtype == torch.float32
    assert model[1].weight_orig.dtype == torch.float32


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recomputes_on_the_same_copies(reentrant):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    x = torch.randn(3, 4, requires_grad=True)
    grads = []
    for use_checkpoint in (False, True):
        masters = watched(model)
        with torch.autocast("cpu", dtype=BF16):
            out = checkpoint(model, x, use_reentrant=reentrant) if use_checkpoint else model(x)
        out.float().pow(2).sum().backward()
        masters.fold_grads()
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        masters.remove()
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_float64_and_max_norm_embeddings_read_their_own_parameters():
    model = nn.ModuleDict({"f64": nn.Linear(2, 2).double(), "emb": nn.Embedding(4, 2, max_norm=1.0)})
    masters = watched(model)
    assert masters.params == []


def test_deep_copies_run_on_their_parameters_and_remove_leaves_the_model_as_it_was():
    model = nn.Sequential(nn.Linear(4, 4))
    masters = watched(model)
    twin = copy.deepcopy(model)  # SWA's averaged model, an EMA copy
    seen = record_weight_dtypes(twin)
    twin(torch.ones(1, 4))
    assert seen == [(torch.float32, torch.float32)]
    masters.remove()
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks
    assert model[0].weight.dtype == torch.float32


class Recurrent(nn.Linear):
    """Calls itself inside its own forward (weight sharing across time steps, written as a recursion)."""

    def forward(self, x, steps=2):
        seen = (self.weight.dtype,)
        if steps > 1:
            x, inner = self(x, steps - 1)
            seen += inner
        return super().forward(x), seen + (self.weight.dtype,)


def test_a_module_called_inside_its_own_forward_reads_its_copy_throughout_and_fp32_after():
    lin = Recurrent(3, 3)
    watched(lin)
    out, seen = fwd(lin, torch.ones(1, 3))
    assert seen == (BF16,) * 4 and out.dtype == BF16
    assert lin.weight.dtype == torch.float32 and "weight" not in lin.__dict__


def test_a_forward_that_raises_leaves_the_fp32_parameters_and_the_next_call_reads_its_copy():
    lin = nn.Linear(3, 2)
    seen = record_weight_dtypes(lin)  # records from inside the forward
    watched(lin)
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        fwd(lin, torch.ones(1, 4))  # a shape error inside forward, after the copies went in
    assert type(lin.weight) is nn.Parameter and "weight" not in lin.__dict__
    fwd(lin, torch.ones(1, 3))
    assert seen == [(BF16, BF16)]


def test_a_pickled_or_deep_copied_model_computes_on_its_own_fp32_parameters():
    model = nn.Sequential(nn.Linear(3, 2))
    masters = watched(model)
    fwd(model, torch.ones(1, 3))
    for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        with torch.no_grad():
            twin[0].weight.fill_(1.0)
        out = fwd(twin, torch.ones(1, 3))
        assert twin[0].forward.__self__ is twin[0] and out.dtype == BF16  # autocast casts its FP32 weight
        torch.testing.assert_close(out.float(), 3.0 + twin[0].bias.detach()[None], rtol=2**-8, atol=0)
    assert model[0].weight.ne(1.0).any()  # the original untouched


class Scaled(nn.Module):
    """A top module that owns a parameter itself (as a LightningModule with an ``nn.Parameter`` does)."""

    def __init__(self):
        super().__init__()
        self.lin, self.scale = nn.Linear(3, 2), nn.Parameter(torch.ones(2))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_torch_export_of_a_watched_model_exports_its_fp32_parameters():
    # the hooks leave each module's forward as it is: export reads forward's code object (an instance `forward`
    # wrapper broke it, see docs/benchmarks.md)
    net = Scaled()
    watched(net)
    fwd(net, torch.ones(1, 3))
    exported = torch.export.export(net, (torch.ones(1, 3),))
    assert set(exported.state_dict) == {"scale", "lin.weight", "lin.bias"}
    assert all(t.dtype == torch.float32 for t in exported.state_dict.values())
