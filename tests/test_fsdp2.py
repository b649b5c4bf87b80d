"""FSDP2 under Lightning's ModelParallelStrategy, two real gloo processes on the CPU, the model sharded with
``fully_shard`` in ``configure_model`` (tests/fsdp_worker.py)."""

import copy
import os

import pytest
import torch
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.numerics.lean import DRIFT_WARNING, LeanBf16
from lightning_mp.numerics.sharding import DTensor, is_sharded
from benchmarks.harness import launch as launch_script
from benchmarks.harness import launch_ranks

WORKER = os.path.join(os.path.dirname(__file__), "fsdp_worker.py")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def launch(out, *args, devices=2, ok=True):
    """The worker's ranks' results; ``ok=False``: the finished process, for a run expected to fail."""
    if not ok:
        out.mkdir(parents=True, exist_ok=True)
        return launch_script(WORKER, "--out", out, "--devices", devices, *args, timeout=240)
    return launch_ranks(WORKER, out, *args, devices=devices)



def same_state(a, b):
    return all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


FAULT = ("--poison-rank", "0", "--poison-step", "1")  # a NaN in rank 0's shard at step 1


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """fp16, two epochs (8 steps), the fault on one rank: shared by the tests below."""
    return launch(tmp_path_factory.mktemp("straight"), "--precision", "fp16", *FAULT)


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_only_is_skipped_on_both(straight):
    r0, r1 = straight
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["scale"] == r1["scale"] == 2.0**7
    assert same_state(r0, r1)  # gathered weights equal on both ranks


@pytest.mark.slow
def test_bf16_ends_within_2_percent_of_the_same_run_without_the_plugin(tmp_path):
    (ours, _), (plain, _) = launch(tmp_path / "bf16", "--precision", "bf16"), launch(tmp_path / "fp32", "--precision", "none")
    last = lambda r: sum(r["losses"][-4:]) / 4  # noqa: E731 (the last epoch)
    assert last(ours) == pytest.approx(last(plain), rel=0.02)


@pytest.mark.slow
def test_gradient_range_monitor_counts_the_whole_model_not_one_shard(straight, tmp_path):
    (one,) = launch(tmp_path, "--precision", "fp16", "--no-shard", *FAULT, devices=1)
    fractions = lambda r: [row for row in r["logged"] if any(k.startswith("precision/grad_") for k in row[1])]  # noqa: E731
    assert len(fractions(one)) == 8 and any(row[1]["precision/grad_overflow_fraction"] > 0 for row in fractions(one))
    # exact data: the counts of the full gradients, summed over the ranks' shards
    assert fractions(straight[0]) == fractions(one)


@pytest.mark.slow
def test_distributed_checkpoint_resumes_bit_for_bit(straight, tmp_path):
    ckpt = tmp_path / "ckpt"
    launch(tmp_path / "first", "--precision", "fp16", "--epochs", "1", "--save", ckpt, *FAULT)
    resumed, _ = launch(tmp_path / "resumed", "--precision", "fp16", "--epochs", "2", "--resume", ckpt, *FAULT)
    assert resumed["steps"] == straight[0]["steps"] == 8
    assert same_state(resumed, straight[0])
    assert resumed["scaler"] == straight[0]["scaler"]  # scale, trackers and the skip count came back


@pytest.mark.slow
def test_parameters_left_out_of_fully_shard_are_refused_with_a_hint(tmp_path):
    proc = launch(tmp_path, "--precision", "bf16", "--partial", ok=False)
    assert proc.returncode != 0
    assert "not sharded by fully_shard" in proc.stderr and "HINT" in proc.stderr


def test_tensor_parallel_placements_are_refused(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1))
        layer = nn.Linear(4, 4)
        layer.weight = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Shard(0)]))
        layer.bias = nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate(), Shard(0)]))
        with pytest.raises(ValueError, match=r"placements .* on a 2-D mesh.*HINT"):
            is_sharded(layer)
        assert not is_sharded(nn.Linear(2, 2))
    finally:
        torch.distributed.destroy_process_group()


def test_the_fsdp_policy_computes_in_the_format_and_reduces_in_fp32():
    policy = MixedPrecisionPlugin("fp16").fsdp_mp_policy()
    assert policy.param_dtype == torch.float16 and policy.reduce_dtype == torch.float32
    assert MixedPrecisionPlugin("bf16").fsdp_mp_policy().param_dtype == torch.bfloat16


def test_compensated_shards_step_like_the_unsharded_model_and_come_back_fp32(tmp_path):
    # one gloo rank: fully_shard's own paths (DTensor shards, its lazy init, the dtypes it derives) in-process
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
        sharded, start = copy.deepcopy(plain), copy.deepcopy(plain)
        mp, mesh = MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16), init_device_mesh("cpu", (1,))
        for layer in sharded:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(sharded, mesh=mesh, mp_policy=mp)
        leans = [LeanBf16(torch.bfloat16, 0.0) for _ in range(2)]
        odd = nn.Linear(4, 4)  # gathering FP32 (no param_dtype): after the fit FSDP2 would still gather into bf16
        fully_shard(odd, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=None))
        with pytest.raises(ValueError, match=r"param_dtype=None.*HINT: fully_shard\(\.\.\., mp_policy=plugin"):
            LeanBf16(torch.bfloat16, 0.0).convert(odd, lambda m: False, sharded=True)
        assert odd.weight.to_local().dtype == torch.float32  # refused before anything changed
        leans[0].convert(plain, lambda m: False)
        leans[1].convert(sharded, lambda m: False, sharded=True)
        for p, q in zip(start.parameters(), sharded.parameters()):  # the split is exact: the masters are the start
            assert q.to_local().dtype == torch.bfloat16 and torch.equal(leans[1].master(q).full_tensor(), p.detach())
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, sharded)]
        x = torch.randn(16, 4)
        for step in range(3):
            for model, lean, opt in zip((plain, sharded), leans, opts):
                with torch.autocast("cpu", torch.bfloat16):
                    model(x).float().square().mean().backward()
                torch.manual_seed(step)  # the same draws for the bf16 state's stochastic rounding
                lean.step(opt)
                opt.zero_grad()
        for p, q in zip(plain.parameters(), sharded.parameters()):
            assert torch.equal(leans[1].master(q).full_tensor(), leans[0].master(p))
        moments = [v for state in opts[1].state.values() for k, v in state.items() if k != "step"]
        assert len(moments) == 12 and all(isinstance(v, DTensor) and v.dtype == torch.bfloat16 for v in moments)
        shards = [q.to_local() for q in sharded.parameters()]
        held = sum(t.nbytes for t in [*shards, *leans[1].steps.remainders.values(), *(v.to_local() for v in moments)])
        assert held / sum(t.numel() for t in shards) == 8.0  # shard 2 + remainder 2 + moments 4; a bf16 gradient +2
        masters = [leans[1].master(q).full_tensor() for q in sharded.parameters()]
        leans[1].remove()  # the end of a fit: FP32 shards again, and fully_shard gathers them
        assert all(q.to_local().dtype == torch.float32 and torch.equal(q.full_tensor(), m)
                   for q, m in zip(sharded.parameters(), masters))
        with torch.no_grad():
            for q in sharded.parameters():
                q.zero_()
            assert not sharded(x).any()  # the forward reads the live FP32 shards, not the last bf16 ones
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_compensated_under_fsdp2_keeps_bf16_shards_and_matches_fp32_masters_bit_for_bit(tmp_path):
    # the same bf16 gradients (reduced in bf16) for both: the rebuilt masters step exactly as FSDP2's FP32 shards
    common = ("--precision", "bf16", "--adamw", "--reduce-bf16")
    lean, fp32 = launch(tmp_path / "lean", *common, "--compensated"), launch(tmp_path / "fp32", *common)
    assert same_state(lean[0], fp32[0]) and same_state(lean[0], lean[1])
    assert lean[0]["losses"] == fp32[0]["losses"]
    assert lean[0]["shard_dtypes"] == {("torch.bfloat16", "torch.bfloat16")}  # half the bytes of FP32 shards
    assert fp32[0]["shard_dtypes"] == {("torch.float32", "torch.float32")}
    assert lean[0]["after_fit"] == {"torch.float32"}


@pytest.mark.slow
def test_compensated_with_bf16_state_and_the_parity_guard_under_fsdp2(tmp_path):
    # with a LayerNorm: an FP32 module, whose parameters are bf16 shards too (one dtype per fully_shard group)
    lean = launch(tmp_path / "lean", "--precision", "bf16", "--adamw", "--layer-norm", "--compensated", "--state-bf16",
                  "--parity-guard", "1")
    (plain, _) = launch(tmp_path / "fp32", "--precision", "none", "--adamw", "--layer-norm")
    drift = [row[1]["precision/parity_drift"] for row in lean[0]["logged"] if "precision/parity_drift" in row[1]]
    assert len(drift) == 8 and 0 < max(drift) < DRIFT_WARNING  # the whole sample's drift, summed over the shards
    assert same_state(lean[0], lean[1])
    last = lambda r: sum(r["losses"][-4:]) / 4  # noqa: E731 (the last epoch)
    assert last(lean[0]) == pytest.approx(last(plain), rel=0.02)


@pytest.mark.slow
def test_compensated_distributed_checkpoint_written_inside_the_fit_resumes_bit_for_bit(tmp_path):
    # written mid-fit: the parameters are bf16 then; the checkpoint holds the rebuilt FP32 masters and FP32 moments
    args, ckpt = ("--precision", "bf16", "--adamw", "--compensated"), tmp_path / "ckpt"
    straight, _ = launch(tmp_path / "straight", *args, "--save-in-fit", ckpt)
    resumed, _ = launch(tmp_path / "resumed", *args, "--epochs", "2", "--resume", ckpt)
    assert resumed["steps"] == straight["steps"] == 8
    assert same_state(resumed, straight) and resumed["losses"] == straight["losses"][4:]
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    dtypes = {k: m.properties.dtype for k, m in stored.items() if "net." in k and hasattr(m, "properties")}
    assert len(dtypes) == 16 and set(dtypes.values()) == {torch.float32}  # 4 masters, 8 moments, 4 step counts
