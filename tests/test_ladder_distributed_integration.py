"""The precision ``schedule`` on two gloo CPU ranks (tests/ladder_worker.py): Fabric and the Trainer, DDP and FSDP2
(``fully_shard`` per Linear and at the root). Every rank switches at the same step, computes each step in the same
format and ends with the same FP32 weights; an overflow on one rank before the switch is skipped on both, so the
switch stays aligned; into and out of master weights under DDP the gradients stay averaged (before: the ranks
drifted apart from the switch on, DDP's own sync left off, or never turned off); a checkpoint saved on both ranks
before or after the switch resumes bit for bit in the right format; FSDP2 refuses a change of the compute dtype by
name. One launch runs every phase in the same two processes (each phase with a Fabric or a Trainer of its own)."""

import os

import pytest
import torch

from benchmarks.harness import torchrun_ranks
from tests.ladder_worker import STEPS, SWITCH

WORKER = os.path.join(os.path.dirname(__file__), "ladder_worker.py")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
]

SWITCHED = ["fabric-ddp-fp16-bf16", "trainer-ddp-fp16-bf16", "fabric-fsdp2-fp8-bf16", "trainer-fsdp2-fp8-bf16",
            "trainer-fsdp2-lean-masters"]  # lean bf16 under Fabric's ModelParallelStrategy: refused, schedule or not
# under DDP, into and out of master weights: who averages the gradients changes (DDP's reducer, or the step)
AVERAGED = [f"{front}-ddp-{first}-{then}" for front in ("fabric", "trainer")
            for first, then in (("bf16", "fp32"), ("fp32", "bf16"), ("bf16", "lean"), ("lean", "masters"))]
# 2 micro-batches a step: the switch falls inside Lightning's no_sync block (the first micro-batch's)
AVERAGED += ["trainer-ddp-bf16-fp32-accumulate2", "trainer-ddp-bf16-lean-accumulate2"]
# saved after step 2 or 4 (before or after the switch), loaded by a new Fabric and plugin; FSDP2: sharded folders
RESUMED = [f"fabric-{strategy}-{first}-{then}-resume{at}" for at in (2, 4) for strategy, first, then in (
    ("ddp", "fp16", "bf16"), ("ddp", "fp32", "bf16"), ("ddp", "lean", "masters"), ("fsdp2", "fp8", "bf16"))]
REFUSED = ["fabric-fsdp2-bf16-fp16", "trainer-fsdp2-bf16-fp16"]


def launch(out, phases, devices=2):
    return torchrun_ranks(WORKER, out, "--phases", ",".join(phases), devices=devices)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("ladder"), SWITCHED + AVERAGED + RESUMED + REFUSED)


# per rung: (format, the first Linear's output dtype, FP8 forward, masters)
RUNGS = {"fp16": ("fp16", "torch.float16", False, "fp32"), "fp8": ("fp8", "torch.bfloat16", True, "fp32"),
         "bf16": ("bf16", "torch.bfloat16", False, "fp32"), "masters": ("bf16", "torch.bfloat16", False, "fp32"),
         "lean": ("bf16", "torch.bfloat16", False, "lean"), "fp32": ("fp32", "torch.float32", False, "none")}


def expected(phase):
    """Per step: (step, format, the first Linear's output dtype, FP8 forward, masters, loss scale)."""
    _, _, first, then, *_ = phase.split("-")
    # fp16: the scale 2^8 halves at rank 1's overflow (step 1) and retires at the switch
    scales = [2.0**8, 2.0**8, 2.0**7] if first == "fp16" else [1.0] * SWITCH
    return [(s, *RUNGS[first], scales[s]) if s < SWITCH else (s, *RUNGS[then], 1.0) for s in range(STEPS)]


@pytest.mark.parametrize("phase", SWITCHED + AVERAGED + RESUMED)
def test_both_ranks_switch_at_the_same_step_and_end_with_equal_fp32_weights(ranks, phase):
    r0, r1 = (r[phase] for r in ranks)
    assert "error" not in r0 and "error" not in r1, r0.get("error") or r1.get("error")
    assert r0["rows"] == r1["rows"] == expected(phase)  # each step in the same format on both ranks
    assert r0["starts"] == r1["starts"] == [SWITCH] and r0["rung"] == r1["rung"] == 1
    assert r0["state"].keys() == r1["state"].keys()
    for k in r0["state"]:
        assert r0["state"][k].dtype == torch.float32, k
        assert torch.isfinite(r0["state"][k]).all(), k
        assert torch.equal(r0["state"][k], r1["state"][k]), k
    if phase.startswith("trainer"):
        assert r0["global_step"] == r1["global_step"] == STEPS


@pytest.mark.parametrize("phase", [p for p in SWITCHED + RESUMED if "fp16" in p])
def test_an_overflow_on_one_rank_before_the_switch_is_skipped_on_both_and_the_scale_retires(ranks, phase):
    r0, r1 = (r[phase] for r in ranks)
    assert r0["skipped"] == r1["skipped"] == 1  # rank 1's overflow at step 1, skipped on both
    assert r0["scale"] == r1["scale"] == 1.0 and not r0["scaler"] and not r1["scaler"]  # retired at the switch


@pytest.mark.parametrize("phase", RESUMED)
def test_a_checkpoint_saved_on_two_ranks_before_or_after_the_switch_resumes_bit_for_bit(ranks, phase):
    # a new Fabric and plugin load it on both ranks: each step in the uninterrupted run's format (the rows above),
    # the same FP32 weights bit for bit
    straight = ranks[0][phase.rsplit("-", 1)[0]]
    for r in ranks:
        assert r[phase]["state"].keys() == straight["state"].keys()
        assert all(torch.equal(r[phase]["state"][k], straight["state"][k]) for k in straight["state"])


@pytest.mark.parametrize("phase", REFUSED)
def test_fsdp2_refuses_a_schedule_that_changes_the_gathered_dtype_on_both_ranks(ranks, phase):
    messages = [r[phase].get("error", "") for r in ranks]
    assert messages[0] == messages[1]
    assert "rung 1 computes in 'fp16' (torch.float16) and the model is sharded by fully_shard" in messages[0]
    assert "HINT: under FSDP2 schedule changes that keep the compute dtype: 'fp8' <-> 'bf16'" in messages[0]
    # before step 0 computes: Fabric at its first forward (it was at the first optimizer.step(), after step 0), the
    # Trainer in step 0's training-step context
    where = [r[phase]["raised_in"] for r in ranks]
    if phase.startswith("fabric"):
        assert all("__enter__" in frames and "optimizer_step" not in frames for frames in where)
    else:
        assert all("train_step_context" in frames for frames in where)


@pytest.mark.parametrize("phase", [p for p in AVERAGED if p.startswith("fabric")])
def test_fabric_and_the_trainer_end_bit_for_bit_equal_into_and_out_of_master_weights(ranks, phase):
    # the same data, model and steps: the Trainer averages through the wrapper it connects, Fabric through the one its
    # first call shows (measured: bit for bit equal); gradients summed, or averaged on one side only, would differ
    fabric, trainer = ranks[0][phase]["state"], ranks[0][phase.replace("fabric", "trainer", 1)]["state"]
    assert fabric.keys() == trainer.keys() and all(torch.equal(fabric[k], trainer[k]) for k in fabric)
