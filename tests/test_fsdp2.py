"""FSDP2 under Lightning's ModelParallelStrategy, two real gloo processes on the CPU, the model sharded with
``fully_shard`` in ``configure_model`` (tests/fsdp_worker.py)."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.numerics.sharding import is_sharded
from tests.test_ddp import exit_abort_after_results

WORKER = os.path.join(os.path.dirname(__file__), "fsdp_worker.py")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def launch(out, *args, devices=2, ok=True):
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    env["PYTHONWARNINGS"] = "ignore"
    cmd = [sys.executable, WORKER, "--out", str(out), "--devices", str(devices), *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    if not ok:
        return proc
    assert proc.returncode == 0 or exit_abort_after_results(proc, out, devices), proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(devices)]



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
