"""Two real processes under Lightning's "ddp" strategy (gloo, CPU): overflow agreement and FP32 accumulation."""

import os

import pytest
import torch

from benchmarks.harness import launch_ranks

WORKER = os.path.join(os.path.dirname(__file__), "ddp_worker.py")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
]


def launch(out, *args, devices=2):
    return launch_ranks(WORKER, out, *args, devices=devices)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_overflow_on_one_rank_only_is_skipped_on_both(tmp_path, precision):
    r0, r1 = launch(tmp_path, "--precision", precision, "--poison-rank", "1", "--poison-step", "2", "--steps", "5")
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["scale"] == r1["scale"] == (2.0**7 if precision == "fp16" else 1.0)
    for k in r0["state"]:
        assert torch.equal(r0["state"][k], r1["state"][k]), k


def test_accumulation_under_ddp_equals_one_process_on_the_same_global_batch(tmp_path):
    # one step on exact data: each rank sums 2 micro-batches in FP32, the ranks average in FP32; one process
    # sums the same 32 samples as 4 micro-batches. Averaging only the last micro-batch would be off by ~50%.
    (tmp_path / "ddp").mkdir()
    (tmp_path / "one").mkdir()
    ddp = launch(tmp_path / "ddp", "--precision", "bf16", "--exact", "--accumulate", "2", "--steps", "1")
    (one,) = launch(tmp_path / "one", "--precision", "bf16", "--exact", "--accumulate", "4", "--steps", "1", devices=1)
    for k in one["state"]:
        assert not torch.equal(one["state"][k], torch.tensor([[1.0, 2.0, -1.0, 0.5]]))  # it moved
        torch.testing.assert_close(ddp[0]["state"][k], one["state"][k], rtol=2**-20, atol=0)
        assert torch.equal(ddp[0]["state"][k], ddp[1]["state"][k])


def test_lean_bf16_under_ddp_keeps_the_ranks_identical_and_matches_one_process(tmp_path):
    # master_weights="compensated": DDP averages the bf16 gradients of the bf16 parameters (as under bf16-true); the
    # optimizer steps on the rebuilt FP32 masters on each rank, identically
    (tmp_path / "ddp").mkdir()
    (tmp_path / "one").mkdir()
    ddp = launch(tmp_path / "ddp", "--precision", "bf16", "--compensated", "--exact", "--steps", "3")
    (one,) = launch(tmp_path / "one", "--precision", "bf16", "--compensated", "--exact", "--steps", "3", devices=1)
    for k in one["state"]:
        assert ddp[0]["state"][k].dtype == torch.float32  # the FP32 model again after the fit
        assert torch.equal(ddp[0]["state"][k], ddp[1]["state"][k])
        torch.testing.assert_close(ddp[0]["state"][k], one["state"][k], rtol=2**-8, atol=0)
