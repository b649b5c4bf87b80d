"""fp32_modules="auto" across ranks, in real gloo processes on the CPU (tests/autopilot_worker.py): an outlier in
one rank's batch moves the module on every rank, and the run trains bit for bit as the one where every rank saw it.

DDP runs as two nodes, each its own ``torchrun`` launcher with one process (a static rendezvous on 127.0.0.1);
FSDP2 as two ranks under Lightning's ModelParallelStrategy. In both, rank 1's first batch alone holds the outlier
(the reference run: both ranks' first batches), the step is skipped, and the batches after it are the same in the
two runs, so the weights must end bitwise equal. Before the ranks agreed, DDP aborted at the next gradient
all-reduce (gloo: "Received data size doesn't match expected size. Is there a distributed collective mismatch"),
and FSDP2 ran rank 0's copy of the module in fp16 and wrote a checkpoint without it.
"""

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from benchmarks.harness import clean_env, launch_ranks

WORKER = os.path.join(os.path.dirname(__file__), "autopilot_worker.py")
TIMEOUT = 240  # seconds per launch: a collective mismatch on gloo can also hang rather than abort
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
]


def launch(out, *args, devices=2):
    """One command; Lightning launches the other rank."""
    return launch_ranks(WORKER, out, *args, devices=devices, timeout=TIMEOUT)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(out, *args, nodes=2):
    """``nodes`` torchrun launchers, one process each, as ``nodes`` machines would start them (loopback only)."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    procs = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node_rank={node}",
               "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
               WORKER, "--out", str(out), "--devices", "1", "--num-nodes", str(nodes), *map(str, args)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))  # fmt: skip
    errors = []
    try:
        for proc in procs:
            errors.append(proc.communicate(timeout=TIMEOUT)[1])
    finally:
        for proc in procs:
            if proc.poll() is None:  # a hung rank: its launcher and the worker it started
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for proc, err in zip(procs, errors):
        assert proc.returncode == 0 or all((out / f"rank{r}.pt").exists() for r in range(nodes)), err[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(nodes)]


def same_state(a, b):
    return a["state"].keys() == b["state"].keys() and all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


def _check_trains_as_the_outlier_on_both(one, both):
    for run in (one, both):
        assert [r["moved"] for r in run] == [["net.2"], ["net.2"]]  # every rank moved it, rank 0 included
        assert [r["skipped"] for r in run] == [1, 1]  # the outlier's step, on both ranks
        assert run[0]["decisions"] == run[1]["decisions"]  # the same decision, step and evidence
        assert same_state(run[0], run[1])
    (module, step, evidence), = one[0]["decisions"]
    assert (module, step) == ("net.2", 0) and evidence.endswith("(rank 1 of 2)")
    assert "its output went non-finite" in evidence
    assert both[0]["decisions"][0][2].endswith("(ranks 0 to 1 of 2: the largest values measured)")
    # from the step after the outlier's, the same batches on the same weights in the same precisions
    assert same_state(one[0], both[0])
    assert [r["losses"][1:] for r in one] == [r["losses"][1:] for r in both]


def test_ddp_on_two_nodes_outlier_on_one_node_moves_the_module_on_both_and_trains_as_the_outlier_on_both(tmp_path):
    one = launch_nodes(tmp_path / "one", "--outlier-ranks", "1", "--save", tmp_path / "one.ckpt")
    both = launch_nodes(tmp_path / "both", "--outlier-ranks", "0,1")
    _check_trains_as_the_outlier_on_both(one, both)
    # the checkpoint (rank 0 writes it) holds the agreed list
    plugin_state = torch.load(tmp_path / "one.ckpt", weights_only=False)["MixedPrecisionPlugin"]
    assert plugin_state["auto_fp32_modules"]["modules"] == ["net.2"]


def test_fsdp2_outlier_on_one_rank_moves_the_module_on_both_and_a_resume_keeps_it(tmp_path):
    ckpt = tmp_path / "one.ckpt"
    one = launch(tmp_path / "one", "--strategy", "fsdp", "--outlier-ranks", "1", "--save", ckpt)
    both = launch(tmp_path / "both", "--strategy", "fsdp", "--outlier-ranks", "0,1")
    _check_trains_as_the_outlier_on_both(one, both)
    # the distributed checkpoint's plugin state (rank 0's) holds rank 1's decision; a resume without calibration
    # moves it on both ranks before its first step
    meta = torch.load(ckpt / "meta.pt", weights_only=False)["MixedPrecisionPlugin"]
    assert meta["auto_fp32_modules"]["modules"] == ["net.2"]
    resumed = launch(tmp_path / "resumed", "--strategy", "fsdp", "--calibration-steps", "0", "--steps", "8",
                     "--resume", ckpt)  # fmt: skip
    assert [r["moved"] for r in resumed] == [["net.2"], ["net.2"]] and [r["steps"] for r in resumed] == [8, 8]
    assert all(r["decisions"][0][2] == "decided by the run this checkpoint comes from" for r in resumed)
    assert same_state(resumed[0], resumed[1])
