"""MixedPrecisionStep with plain optimizers: no Trainer, no plugin."""

import pickle
import warnings
from unittest import mock

import pytest
import torch
from torch import nn

from lightning_mp.numerics.grad_layout import GradLayout
from lightning_mp.numerics.loss_scaler import LossScaler
from lightning_mp.numerics.step import MixedPrecisionStep
from lightning_mp.numerics.step_grads import SHARDED_CHECK, SMALL_CHECK
from tests.conftest import cuda


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
    # the gradients are left for the loop's zero_grad (as GradScaler leaves them), unscaled
    assert p1.grad.isinf().all() and torch.equal(p2.grad, torch.ones(3))
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
        "lightning_mp.numerics.grad_layout.non_finite_flag", side_effect=AssertionError("pass over the gradients")
    ):
        assert step.unscale_(opt) is False
        step.step(opt)
    assert p.detach().isnan().all()  # the user's choice: nothing stops the NaN (as in bf16-mixed)


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


def test_replay_gives_the_deciding_evaluation_first_and_unscales_each_re_evaluation():
    step = MixedPrecisionStep(LossScaler("dynamic", init_scale=4.0))
    p, opt = sgd(grad=4.0)  # the evaluation the front end ran: a scaled gradient of 1
    assert step.unscale_(opt) is False
    evaluations, hooks = [], []

    def evaluate():  # a fresh forward and backward at the current parameters, with the loss scaled by 4
        evaluations.append(p.detach().clone())
        p.grad = torch.full((3,), 8.0)
        return torch.tensor(2.0)

    closure = step.replay(opt, torch.tensor(1.0), evaluate, lambda: hooks.append(p.grad.clone()), step=5)
    assert closure() == 1.0 and evaluations == []  # no second forward for what already ran
    assert closure() == 2.0 and len(evaluations) == 1
    assert torch.equal(hooks[0], torch.full((3,), 2.0))  # the hook after a closure sees it unscaled
    p.grad = None

    def overflow():
        p.grad = torch.full((3,), float("inf"))

    closure = step.replay(opt, None, overflow, lambda: None, step=5)
    closure()
    with pytest.raises(FloatingPointError, match=r"step 5 with loss scale 4 when SGD re-evaluated.*HINT: "):
        closure()


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


@pytest.mark.parametrize("version", ["2", 2.0, True, None, 0, -1])
def test_a_version_that_is_no_known_integer_is_a_foreign_state_not_a_newer_one(version):
    step = MixedPrecisionStep(LossScaler("dynamic"))
    state = {**step.state_dict(), "version": version}
    with pytest.raises(ValueError) as err:
        step.load_state_dict(state)
    message = str(err.value)
    assert f"version={version!r}: allowed is an integer from 1 to 2. HINT: the checkpoint is corrupt" in message
    assert "newer" not in message and "upgrade" not in message  # upgrading lightning_mp would not help


# ---------------------------------------------------------------------------------------------- gradient layout
def flat_model(n_tiled=3, n_loose=2):
    """Parameters as master weights leave them: the first ``n_tiled`` gradients are views of one flat FP32 buffer
    (laid out in reverse, so the optimizer's order is not the buffer's), the rest ordinary tensors, interleaved."""
    tiled = [nn.Parameter(torch.ones(2, 2)) for _ in range(n_tiled)]
    loose = [nn.Parameter(torch.ones(3)) for _ in range(n_loose)]
    flat = torch.zeros(4 * n_tiled)
    for p, view in zip(reversed(tiled), flat.split(4)):
        p.grad = view.view(2, 2)
    for p in loose:
        p.grad = torch.zeros(3)
    params = [p for pair in zip(tiled, loose) for p in pair] + tiled[len(loose) :]
    return params, tiled, loose, flat


def fresh_loose_grads(loose, value=0.0):
    for p in loose:  # what autograd does for kept-FP32 parameters after zero_grad(set_to_none=True)
        p.grad = torch.full((3,), value)


def test_a_flat_buffer_is_read_as_one_view_whatever_the_parameter_order():
    params, tiled, loose, flat = flat_model()
    grads = GradLayout(params).read(params)
    runs, rest, large, _ = grads.groups[(torch.device("cpu"), torch.float32)]
    assert len(runs) == 1 and runs[0].data_ptr() == flat.data_ptr() and runs[0].numel() == flat.numel() and not large
    assert [g is p.grad for g, p in zip(rest, loose)] == [True, True]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["flat buffer", "loose gradient"])
def test_the_read_only_check_finds_every_non_finite_value_in_the_buffer_and_outside_it(value, where):
    params, tiled, loose, flat = flat_model()
    step = MixedPrecisionStep(LossScaler(None))
    opt = torch.optim.SGD(params, lr=1.0)
    assert step.unscale_(opt) is False
    step.end_training_step()
    (flat if where == "flat buffer" else loose[1].grad)[-1] = value
    versions = [p.grad._version for p in params]
    assert step.unscale_(opt) is True
    assert [p.grad._version for p in params] == versions  # read-only: nothing rewritten


@pytest.mark.parametrize("shapes", [[(3,), (5,)], [(2, 3), (4,)], [(5000,), (3,)], [(70, 70)]])
def test_small_loose_gradients_are_read_together_and_large_ones_alone_each_checked(shapes):
    # small ones (<= 4096 elements) are concatenated for one CPU sum (1-D: cat; else flattened), large ones summed
    params = [nn.Parameter(torch.ones(shape)) for shape in shapes]
    step = MixedPrecisionStep(LossScaler(None))
    opt = torch.optim.SGD(params, lr=1.0)
    for target in params:
        for p in params:
            p.grad = torch.zeros_like(p)
        assert step.unscale_(opt) is False
        step.end_training_step()
        target.grad.view(-1)[-1] = float("-inf")
        assert step.unscale_(opt) is True
        step.end_training_step()


def test_the_scaler_unscales_the_flat_buffer_through_its_view_and_the_loose_gradients():
    params, tiled, loose, flat = flat_model()
    flat.fill_(8.0)
    fresh_loose_grads(loose, 8.0)
    step = MixedPrecisionStep(LossScaler("dynamic", init_scale=8.0))
    assert step.unscale_(torch.optim.SGD(params, lr=1.0)) is False
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)


def test_the_layout_is_kept_across_steps_and_rebuilt_only_when_gradients_or_groups_move():
    params, tiled, loose, flat = flat_model()
    opt = torch.optim.SGD(params, lr=1.0)
    step = MixedPrecisionStep(LossScaler(None))

    def builds():  # the layout's path, as for more than SMALL_CHECK elements or on a GPU
        with mock.patch("lightning_mp.numerics.step_grads.GradLayout", wraps=GradLayout) as built, mock.patch(
            "lightning_mp.numerics.step.few_cpu_grads", return_value=None
        ):
            step.unscale_(opt)
            step.end_training_step()
        return built.call_count

    assert builds() == 1
    fresh_loose_grads(loose)  # new loose tensors every step: re-read, not rebuilt
    assert builds() == 0
    tiled[0].grad = torch.zeros(2, 2)  # the buffer moved
    assert builds() == 1
    extra = nn.Parameter(torch.ones(1))
    opt.add_param_group({"params": [extra]})
    assert builds() == 1
    extra.grad = torch.zeros(1)  # a gradient appeared
    assert builds() == 1
    loose[0].grad = None  # one went away
    assert builds() == 1
    loose[0].grad = torch.zeros(3, dtype=torch.float32).to_sparse()  # a loose gradient turned sparse
    assert builds() == 1


@pytest.mark.parametrize("scale", [None, 1024.0])
def test_a_small_cpu_models_gradients_are_checked_and_unscaled_as_they_are_without_a_layout(scale):
    """Up to SMALL_CHECK FP32 elements on the CPU: one fused pass over the gradients themselves (validating a layout
    cost more than the check on a tiny MLP); an inf or NaN anywhere is still found, and a scale divided out exactly."""
    params, tiled, loose, flat = flat_model()
    opt = torch.optim.SGD(params, lr=1.0)
    step = MixedPrecisionStep(LossScaler("dynamic" if scale else None, init_scale=scale or 1.0))
    for p in params:
        p.grad.fill_(3.0 * (scale or 1.0))
    with mock.patch("lightning_mp.numerics.step_grads.GradLayout", side_effect=AssertionError("a layout")):
        assert step.unscale_(opt) is False
        assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in params)
        step.end_training_step()
        for bad in (tiled[1], loose[0]):
            bad.grad.view(-1)[1] = float("nan")
            assert step.unscale_(opt) is True
            step.end_training_step()
            bad.grad.zero_()


def test_a_new_loose_gradient_is_checked_in_the_cached_layout():
    params, tiled, loose, flat = flat_model()
    opt = torch.optim.SGD(params, lr=1.0)
    step = MixedPrecisionStep(LossScaler(None))
    assert step.unscale_(opt) is False
    step.end_training_step()
    fresh_loose_grads(loose, float("nan"))
    assert step.unscale_(opt) is True


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_gradients_whose_sum_passes_65504_are_finite(dtype):
    # no master weights: 16-bit gradients reach the check; a 16-bit sum or norm of these rounds to inf
    p = nn.Parameter(torch.ones(1000, dtype=dtype))
    p.grad = torch.full((1000,), 60000.0, dtype=dtype)
    step = MixedPrecisionStep(LossScaler(None))
    assert step.unscale_(torch.optim.SGD([p], lr=1.0)) is False
    step.end_training_step()
    p.grad[3] = float("-inf")
    assert step.unscale_(torch.optim.SGD([p], lr=1.0)) is True


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_master_weight_guard_refuses_16_bit_gradients(dtype):
    p = nn.Parameter(torch.ones(3, dtype=dtype))
    p.grad = torch.ones(3, dtype=dtype)
    with pytest.raises(RuntimeError, match=rf"{dtype} gradient.*must not read 16-bit.*HINT"):
        MixedPrecisionStep(LossScaler(None), fp32_grads=True).unscale_(torch.optim.SGD([p], lr=1.0))


def test_the_master_weight_guard_lets_float64_gradients_through_and_checks_them():
    p = nn.Parameter(torch.ones(3, dtype=torch.float64))
    p.grad = torch.ones(3, dtype=torch.float64)
    step = MixedPrecisionStep(LossScaler("dynamic", init_scale=2.0), fp32_grads=True)
    opt = torch.optim.SGD([p], lr=1.0)
    assert step.unscale_(opt) is False and torch.equal(p.grad, torch.full((3,), 0.5, dtype=torch.float64))
    step.end_training_step()
    p.grad[0] = float("inf")
    assert step.unscale_(opt) is True


def test_under_reduce_a_missing_gradient_reuses_one_zeroed_buffer():
    step = MixedPrecisionStep(LossScaler(None), reduce_=lambda grads: None)
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([a, b], lr=1.0)
    a.grad = torch.ones(2)
    step.unscale_(opt)
    step.end_training_step()
    buffer = b.grad
    buffer.fill_(7.0)  # written since (by the user, say): zeroed again when reused
    opt.zero_grad(set_to_none=True)
    a.grad = torch.ones(2)
    step.unscale_(opt)
    assert b.grad is buffer and torch.equal(buffer, torch.zeros(3))


def test_on_overflow_runs_only_on_a_skip_while_the_gradients_are_still_there():
    seen = []
    p, opt = sgd(grad=1.0)
    step = MixedPrecisionStep(LossScaler(None), on_overflow=lambda optimizer: seen.append((optimizer, p.grad)))
    step.step(opt)
    step.end_training_step()
    assert seen == []
    p.grad = torch.full((3,), float("nan"))
    assert step.step(opt) is None
    assert len(seen) == 1 and seen[0][0] is opt and seen[0][1].isnan().all()


def test_a_step_with_cached_layouts_pickles_and_works_after():
    params, tiled, loose, flat = flat_model()
    step = MixedPrecisionStep(LossScaler(None), reduce_=None)
    step.unscale_(torch.optim.SGD(params, lr=1.0))
    step.end_training_step()
    copy = pickle.loads(pickle.dumps(step))  # ddp_spawn sends the plugin to each process
    p, opt = sgd(grad=float("nan"))
    assert copy.unscale_(opt) is True


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("scale", [None, "dynamic"])
def test_on_cuda_the_step_makes_one_host_sync(scale):
    params, tiled, loose, flat = flat_model()
    params = [nn.Parameter(p.detach().cuda()) for p in params]
    flat = torch.zeros(sum(p.numel() for p in params[:3]), device="cuda")
    for p, view in zip(params[:3], flat.split(4)):
        p.grad = view.view_as(p)
    for p in params[3:]:
        p.grad = torch.zeros_like(p)
    step = MixedPrecisionStep(LossScaler(scale))
    opt = torch.optim.SGD(params, lr=1.0)
    for _ in range(2):  # the second step runs on the cached layout
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert step.unscale_(opt) is False
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1
        step.end_training_step()
    flat[5] = float("nan")
    assert step.unscale_(opt) is True


def test_a_skip_leaves_the_gradients_to_the_loop_and_kept_ones_skip_again_until_zeroed():
    """Issue 45: the step calls no ``zero_grad`` of its own (Lightning's loop, or a Fabric loop, zeroes); gradients a
    loop keeps after a skip hold the inf again at the next check, so they never reach an update."""
    step = MixedPrecisionStep(LossScaler("dynamic", init_scale=8.0))
    p, opt = sgd(grad=float("inf"))
    with mock.patch.object(opt, "zero_grad", wraps=opt.zero_grad) as zero_grad:
        assert step.step(opt) is None
        step.end_training_step()
        p.grad += 4.0  # a loop that never zeroes: the next micro-batch adds to them
        assert step.step(opt) is None and torch.equal(p.detach(), torch.ones(3))  # skipped again: no update
        step.end_training_step()
        assert zero_grad.call_count == 0
        opt.zero_grad()  # the loop's
        p.grad = torch.full((3,), 2.0)  # scale 2 after two backoffs: a true gradient of 1
        step.step(opt)
    assert torch.equal(p.detach(), torch.zeros(3)) and step.scaler.skipped_steps == 2


def test_fsdp2_shards_past_the_sharded_bound_are_checked_read_only_through_the_layout(tmp_path):
    """Past SHARDED_CHECK local elements the layout's read-only sums beat the fused pass's write (from ~10M): the
    layout's path, which still finds an inf in a shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(str(tmp_path / "s"), 1), rank=0,
                                         world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = nn.Parameter(distribute_tensor(torch.zeros(SHARDED_CHECK + 2), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.ones(SHARDED_CHECK + 2), mesh, [Shard(0)])
        p.grad.to_local()[-1] = float("inf")
        step = MixedPrecisionStep(LossScaler(None))
        with mock.patch("lightning_mp.numerics.step_grads.GradLayout", wraps=GradLayout) as layout:
            assert step.unscale_(torch.optim.SGD([p], lr=1.0)) is True
        assert layout.call_count == 1
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("rows", [4, SMALL_CHECK // 2])  # 16 elements in all; 2^17: past the unsharded bound
@pytest.mark.parametrize("scale", [None, 64.0])
def test_fsdp2_shards_are_checked_as_local_views_with_no_layout_rebuilt_each_step(tmp_path, scale, rows):
    """DTensor gradients made the layout irregular, rebuilt at every step with a to_local() each (~90 us of a tiny
    MLP's FSDP2 step, ~0.15 ms of a small GPT's): shards of up to a few million local elements are checked (and
    unscaled, in place) as this rank's local views."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(str(tmp_path / "s"), 1), rank=0,
                                         world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        params = [nn.Parameter(distribute_tensor(torch.ones(rows, 2), mesh, [Shard(0)])) for _ in range(2)]
        for p in params:
            p.grad = distribute_tensor(torch.full((rows, 2), 2.0 * (scale or 1.0)), mesh, [Shard(0)])
        opt = torch.optim.SGD(params, lr=1.0)
        step = MixedPrecisionStep(LossScaler("dynamic" if scale else None, init_scale=scale or 1.0))
        with mock.patch("lightning_mp.numerics.step_grads.GradLayout", side_effect=AssertionError("a layout")):
            assert step.unscale_(opt) is False
            assert all(torch.equal(p.grad.to_local(), torch.full((rows, 2), 2.0)) for p in params)
            step.end_training_step()
            params[1].grad.to_local()[rows - 1, 1] = float("inf")
            assert step.unscale_(opt) is True
    finally:
        torch.distributed.destroy_process_group()
