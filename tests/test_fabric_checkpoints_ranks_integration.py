"""lightning_mp.fabric on gloo CPU ranks (tests/fabric_checkpoint_worker.py): Fabric's default sharded checkpoint under
``ModelParallelStrategy`` (FSDP2) saved on 2 ranks and resumed in 1 process and back, exactly; and closures (LBFGS,
SAM) under Fabric's ``"ddp"``. Full-file checkpoints across world sizes: tests/test_fabric_distributed.py."""

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from benchmarks.harness import torchrun_ranks
from lightning_mp.fabric import MixedPrecisionPlugin
from tests.fabric_ddp_worker import data, micro_batch, mlp

WORKER = os.path.join(os.path.dirname(__file__), "fabric_checkpoint_worker.py")
LR = 1e-2  # the worker's AdamW
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
]


def launch(out: Path, *args, devices=2):
    """One process per rank with the environment torchrun sets; each rank's results by phase."""
    ranks = torchrun_ranks(WORKER, out, "--devices", devices, *args, devices=devices, timeout=300)
    for phase, result in ranks[0].items():
        assert phase == "compensated" or "error" not in result, f"{phase}: {result.get('error')}"
    return ranks


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """2 ranks save (folder A) -> 1 process loads A, saves B -> 2 ranks load B; each side then takes one step."""
    root = tmp_path_factory.mktemp("sharded")
    two = launch(root / "two", "--mode", "save")
    one = launch(root / "one", "--mode", "resume", "--load", root / "two", "--save",
                 "--phases", "bf16,fp16,fp16+plain", devices=1)
    back = launch(root / "back", "--mode", "resume", "--load", root / "one", "--suffix", "B", "--phases", "bf16,fp16")
    return root, two, one[0], back


def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def close_after_one_step(a, b, precision, units=4):
    # the same 32 rows on 1 or 2 ranks, but each rank's 16-bit weight gradient is rounded apart before the FP32
    # average: Adam's normalised step differs by a few units of the format's eps, times the learning rate
    eps = 2.0**-8 if precision == "bf16" else 2.0**-11
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=units * LR * eps)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_sharded_checkpoint_of_two_ranks_resumes_in_one_process_exactly(sharded, precision):
    _, (r0, r1), one, _ = sharded
    saved, loaded = r0[precision]["saved"], one[precision]["loaded"]
    assert equal(saved["state"], r1[precision]["saved"]["state"]) and saved["param_dtypes"] == {torch.float32}
    assert equal(loaded["state"], saved["state"])  # FP32 masters, resharded from 2 shards to 1
    assert equal(loaded["opt"], saved["opt"])  # Adam's FP32 moments and step counts
    # fp16: rank 1's overflow at step 1 was skipped on both, the scale backed off from 2**8
    assert (loaded["scale"], loaded["skipped"], loaded["steps"]) == (saved["scale"], saved["skipped"], 3)
    assert saved["scale"] == (2.0**7 if precision == "fp16" else 1.0)
    assert saved["skipped"] == (1 if precision == "fp16" else 0)
    if precision == "fp16":  # why lightning_mp.fabric.load: Lightning 2.6's fabric.load of a folder puts the saved
        plain = one["fp16+plain"]  # dict in state["precision"]; the model and optimizer load, the plugin does not
        assert plain["precision_entry"] == "dict"
        assert (plain["loaded"]["scale"], plain["loaded"]["skipped"]) == (2.0**8, 0)  # the initial scale, no skips
        assert equal(plain["loaded"]["state"], saved["state"]) and equal(plain["loaded"]["opt"], saved["opt"])
    assert not equal(one[precision]["next"]["state"], loaded["state"])  # the run goes on
    close_after_one_step(one[precision]["next"]["state"], r0[precision]["next"]["state"], precision)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_sharded_checkpoint_of_one_process_resumes_on_two_ranks_as_if_never_stopped(sharded, precision):
    _, (r0, _), one, (b0, b1) = sharded
    loaded = b0[precision]["loaded"]
    assert equal(loaded["state"], one[precision]["loaded"]["state"])
    assert equal(loaded["opt"], r0[precision]["saved"]["opt"])
    assert (loaded["scale"], loaded["skipped"], loaded["steps"]) == (r0[precision]["saved"]["scale"],
                                                                     r0[precision]["saved"]["skipped"], 3)
    # 2 ranks -> 1 process -> 2 ranks, then step 4 on 2 ranks: the weights, the optimizer state and the plugin's
    # counters of the 2-rank run that never stopped (the same shards, the same sums: bit for bit)
    for b in (b0, b1):
        assert equal(b[precision]["next"]["state"], r0[precision]["next"]["state"])
        assert equal(b[precision]["next"]["opt"], r0[precision]["next"]["opt"])
        assert b[precision]["next"]["scale"] == r0[precision]["next"]["scale"]
        assert b[precision]["next"]["steps"] == 4


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_consolidated_sharded_checkpoint_resumes_in_one_plain_process(sharded, precision):
    # Fabric's single-device strategy reads files only: Lightning's `fabric consolidate FOLDER` (the function
    # below) turns the folder into one file, which a plain Fabric with the plugin loads, the plugin's state included
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    root, (r0, _), *_ = sharded
    with pytest.raises(IsADirectoryError):
        _one_process(precision, root / "two" / f"{precision}-A")
    path = root / f"{precision}.consolidated"
    torch.save(_load_distributed_checkpoint(root / "two" / f"{precision}-A"), path)
    fabric, model, opt, plugin, state = _one_process(precision, path)
    saved = r0[precision]["saved"]
    assert equal({k: v.detach() for k, v in model.state_dict().items()}, saved["state"])
    names = list(saved["state"])  # the optimizer's state keyed by parameter name, in the parameters' order
    assert equal({f"{names[i]}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items()},
                 saved["opt"])
    assert state["precision"] is plugin and (plugin.loss_scale, plugin.skipped_steps) == (saved["scale"],
                                                                                           saved["skipped"])
    x, y = data()
    for micro in range(2):  # the worker's step 4, in one process
        xb, yb = micro_batch(x, y, state["step"], micro, 0, 1, 16)
        fabric.backward(nn.functional.mse_loss(model(xb), yb) / 2)
    opt.step()
    # and a forward of another path: the plugin's own 16-bit copies, LayerNorm in FP32 (its policy), not FSDP2's
    close_after_one_step({k: v.detach() for k, v in model.state_dict().items()}, r0[precision]["next"]["state"],
                         precision, units=8)


def _one_process(precision, path):
    plugin = MixedPrecisionPlugin(precision, **({"init_scale": 2.0**8} if precision == "fp16" else {}))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = mlp()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=LR))
    state = {"model": model, "optimizer": opt, "precision": plugin, "step": 0}
    fabric.load(path, state)
    return fabric, model, opt, plugin, state


def test_lean_bf16_under_fsdp2_is_refused_at_the_first_forward_not_saved_stale(sharded):
    # converted at fabric.setup, before fully_shard replaced the Parameters: without the refusal the optimizer
    # stepped the bf16 shards without remainders and fabric.save wrote the weights of fabric.setup, silently
    _, (r0, r1), *_ = sharded
    for r in (r0, r1):
        assert r["compensated"]["error"].startswith("NotImplementedError")
        assert "master_weights='compensated') under ModelParallelStrategy" in r["compensated"]["error"]
        assert "HINT: under ModelParallelStrategy use the default master_weights=True" in r["compensated"]["error"]


@pytest.fixture(scope="module")
def closures(tmp_path_factory):
    phases = "lbfgs-bf16,lbfgs-bf16-mixed,lbfgs-32-true,sam-bf16,sam-32-true"
    return launch(tmp_path_factory.mktemp("closures"), "--mode", "closures", "--phases", phases)


def test_lbfgs_under_ddp_reevaluates_through_the_plugin_and_matches_fabrics_bf16_mixed(closures):
    r0, r1 = closures
    ours = r0["lbfgs-bf16"]
    assert ours["calls"] == [5] * 4  # LBFGS evaluated its closure 5 times per step (max_iter=5): 4 re-evaluations
    assert ours["weight_dtypes"] == {torch.bfloat16} and ours["dtypes"] == {torch.float32}  # bf16 copies, FP32 masters
    assert ours["skipped"] == 0
    for phase in ("lbfgs-bf16", "lbfgs-bf16-mixed", "lbfgs-32-true"):
        assert torch.equal(r0[phase]["weights"], r1[phase]["weights"])  # every re-evaluation's gradient averaged
    # the same bf16 forwards as Fabric's bf16-mixed (FP32 weights cast to bf16, FP32 gradients averaged by DDP)
    torch.testing.assert_close(ours["weights"], r0["lbfgs-bf16-mixed"]["weights"], rtol=2.0**-20, atol=0)
    plain = r0["lbfgs-32-true"]["losses"]
    assert ours["losses"][-1] < 0.2 * ours["losses"][0]
    assert ours["losses"][-1] == pytest.approx(plain[-1], rel=0.05, abs=1e-3)


def test_sam_under_ddp_calls_the_closure_twice_and_trains_as_in_32_true(closures):
    r0, r1 = closures
    ours, plain = r0["sam-bf16"], r0["sam-32-true"]
    assert ours["calls"] == [2] * 4 and ours["weight_dtypes"] == {torch.bfloat16}
    assert torch.equal(ours["weights"], r1["sam-bf16"]["weights"])
    torch.testing.assert_close(ours["weights"], plain["weights"], rtol=0, atol=64 * 2.0**-8)
