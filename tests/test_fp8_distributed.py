"""``precision="fp8"`` across ranks, in real gloo processes on the CPU (tests/fp8_worker.py; torchao's FP8 emulated):
FSDP2 under Lightning's ModelParallelStrategy with every Linear in FP8 (rowwise, all-gathering bf16), and the FP8
autopilot's decisions forced by one rank's data only, under DDP and FSDP2."""

import os

import pytest
import torch

from benchmarks.harness import launch_ranks

pytest.importorskip("torchao", reason="precision='fp8' needs torchao: pip install 'lightning_mp[fp8]'")
WORKER = os.path.join(os.path.dirname(__file__), "fp8_worker.py")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
FLUSHED_INPUT = 0  # the column of the autopilot's table: (flushed, -SQNR) for input, weight, grad_output


def launch(out, *args, devices=2):
    return launch_ranks(WORKER, out, *args, devices=devices)


def same_state(a, b):
    return a["state"].keys() == b["state"].keys() and all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


@pytest.mark.slow
def test_fsdp2_on_two_ranks_trains_every_linear_in_fp8_from_fp32_shards_like_one_process(tmp_path):
    ranks = launch(tmp_path / "fsdp", "--strategy", "fsdp", "--recipe", "rowwise")
    (one,) = launch(tmp_path / "one", "--recipe", "rowwise", devices=1)  # the same global batches, unsharded
    linears = ["head", "hidden", "offender"]
    for r in ranks:
        assert r["steps"] == 8 and r["fp8_seen"] == [linears] * 8  # torchao's FP8 matmul at every step
        assert "3 of 3 Linears compute through torchao's 'rowwise' recipe" in r["describe"]
        # the masters are FSDP2's FP32 shards, with FP32 gradients (reduced in FP32)
        assert r["shard_dtypes"] == {("DTensor", "torch.float32", "torch.float32")}
        # what torchao casts to FP8: the bf16 weight FSDP2 all-gathered (a plain tensor, not a DTensor shard)
        assert {name for name, _, _ in r["weights_read"]} == set(linears)
        assert all(kind != "DTensor" and dtype == "torch.bfloat16" for _, kind, dtype in r["weights_read"])
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        assert all(v.dtype == torch.float32 for v in r["state"].values())
    assert ranks[0]["mean_losses"] == ranks[1]["mean_losses"]  # the loss of the global batch, on both ranks
    assert same_state(ranks[0], ranks[1])
    # one process on the same global batches: the same run to FP8's rounding, not bitwise (the weight gradient's
    # rowwise scales span one rank's rows under FSDP2, all rows in one process). Measured: the losses within 5e-4,
    # each parameter's update (AdamW, 8 steps) within 8% in norm; asserted with margin
    assert ranks[0]["mean_losses"] == pytest.approx(one["mean_losses"], rel=2e-3)
    start = one["start"]
    for k, v in one["state"].items():
        update, reference = ranks[0]["state"][k] - start[k], v - start[k]
        assert (update - reference).norm() <= 0.2 * reference.norm(), k


def _check_forced_on_rank_1_only(ranks):
    # the evidence: only rank 1 measured offender's input past the limit (1%), rank 0 nothing of the kind
    local = [r["local_measurements"] for r in ranks]
    assert local[0]["offender"][FLUSHED_INPUT] < 0.01 < local[1]["offender"][FLUSHED_INPUT]
    assert all(row[FLUSHED_INPUT] < 0.01 for r in local for name, row in r.items() if name != "offender")
    # the decision: taken on both ranks, the same step and evidence text
    assert [r["kept"] for r in ranks] == [["offender"], ["offender"]]
    assert ranks[0]["decisions"] == ranks[1]["decisions"]
    (module, step, evidence), = ranks[0]["decisions"]
    assert (module, step) == ("offender", 3) and "its input flushed" in evidence
    for r in ranks:  # bf16 while calibrating (4 steps), then FP8 for the two others on both ranks
        assert r["fp8_seen"] == [[]] * 4 + [["head", "hidden"]] * 4
    assert ranks[0]["mean_losses"] == ranks[1]["mean_losses"]
    assert same_state(ranks[0], ranks[1])


@pytest.mark.slow
def test_ddp_autopilot_decision_forced_on_rank_1_only_is_taken_on_both_and_checkpointed(tmp_path):
    ckpt = tmp_path / "auto.ckpt"
    ranks = launch(tmp_path / "ddp", "--strategy", "ddp", "--auto", "--outlier-ranks", "1", "--save", ckpt)
    _check_forced_on_rank_1_only(ranks)
    state = torch.load(ckpt, weights_only=False)["MixedPrecisionPlugin"]  # rank 0 writes it
    assert state["auto_fp8_modules"] == {"kept": ["offender"], "calibrated_steps": 4}


@pytest.mark.slow
def test_fsdp2_autopilot_decision_forced_on_rank_1_only_is_taken_on_both_and_checkpointed(tmp_path):
    ckpt = tmp_path / "auto.ckpt"
    ranks = launch(tmp_path / "fsdp", "--strategy", "fsdp", "--auto", "--outlier-ranks", "1", "--save", ckpt)
    _check_forced_on_rank_1_only(ranks)
    meta = torch.load(ckpt / "meta.pt", weights_only=False)["MixedPrecisionPlugin"]  # the distributed checkpoint's
    assert meta["auto_fp8_modules"] == {"kept": ["offender"], "calibrated_steps": 4}


def test_the_probe_measures_the_all_gathered_weight_under_fully_shard_not_the_shard(tmp_path):
    # one gloo rank in-process: FSDP2 reshards after each forward, so a forward hook would read this rank's DTensor
    # shard (its statistics then fail: "Redistribution from one partial type (P(max)) to another (P(sum))")
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lightning_mp.fp8.probe import Fp8Probe

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain, sharded = nn.Sequential(nn.Linear(32, 16), nn.ReLU()), nn.Sequential(nn.Linear(32, 16), nn.ReLU())
        sharded.load_state_dict(plain.state_dict())
        mesh, mp = init_device_mesh("cpu", (1,)), MixedPrecisionPolicy(torch.bfloat16)
        fully_shard(sharded[0], mesh=mesh, mp_policy=mp)  # not the root: resharded after its forward
        fully_shard(sharded, mesh=mesh, mp_policy=mp)
        x, measured = torch.randn(8, 32), []
        for module in (plain, sharded):
            probe = Fp8Probe([("linear", module[0])], "rowwise", torch.bfloat16)
            probe.arm()
            with torch.autocast("cpu", torch.bfloat16):  # the same bf16 GEMM in both: the same output gradient
                out = module(x)
            out.float().square().sum().backward()
            measured.append(probe.collect())
        assert list(measured[1]["linear"]) == ["input", "weight", "grad_output"]
        assert measured[0] == measured[1]  # the same bf16 values: FSDP2's all-gathered weight, the master's copy
    finally:
        torch.distributed.destroy_process_group()
