"""What the benchmarks and the tests share: counting the live tensor memory of a process, and launching worker
processes (a benchmark's rows, a test's ranks) with a clean environment, with the worker's side of that protocol
(its ``--out`` and ``--devices`` arguments, one thread, one seed, a result file per rank).

The benchmarks import it as ``harness`` (their folder is the script's), the tests as ``benchmarks.harness``.
torch is imported inside the functions: a benchmark's ``--help`` and its parent process stay light.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# a launcher's rank variables: a worker started from inside a torchrun or a Lightning DDP rank would join that group
LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_", "RANK", "GROUP_RANK", "TORCHELASTIC")


def live_storage_bytes() -> int:
    """Every live tensor storage in this process, each counted once (found through the garbage collector), in
    bytes: what a run holds, counted from outside the package. Meta tensors hold nothing."""
    return sum(live_storages().values())


def live_storages() -> dict[int, int]:
    """Every live tensor storage in this process: its address and its bytes (:func:`live_storage_bytes`)."""
    import torch

    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on torch.distributed.reduce_op warns that it is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                    storage = obj.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
            except Exception:  # noqa: BLE001 (objects the collector hands out can be half-built)
                continue
    return seen


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without a launcher's rank variables, warnings off, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    return {**env, "PYTHONWARNINGS": "ignore", **extra}


def launch(script: str | Path, *args: Any, env: dict[str, str] | None = None,
           timeout: float | None = None) -> subprocess.CompletedProcess:
    """``python script *args`` in a fresh process (:func:`clean_env` unless ``env``), its output captured."""
    cmd = [sys.executable, str(script), *map(str, args)]
    return subprocess.run(cmd, env=clean_env() if env is None else env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def worker_row(script: str | Path, *args: Any, timeout: float | None = None) -> dict:
    """A benchmark's row measured in a fresh process (one row's freed memory cannot hide another's peak): the
    worker prints its result as JSON on its last line of output."""
    done = launch(script, *args, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"{Path(script).name} {' '.join(map(str, args))} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def launch_ranks(worker: str | Path, out: Path, *args: Any, devices: int = 2, timeout: float = 240,
                 env: dict[str, str] | None = None) -> list[Any]:
    """A test's worker run on ``devices`` ranks (``--out OUT --devices N``; Lightning launches the other ranks):
    each rank's result, ``torch.load``-ed from ``OUT/rank<r>.pt``. A failed run raises with its stderr's end."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(worker), "--out", str(out), "--devices", str(devices), *map(str, args)]
    popen = subprocess.Popen(cmd, env=clean_env() if env is None else env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)  # its ranks: one group
    (proc,), hung_after_results = _wait_for_results([popen], out, devices, timeout)
    if not _ended_well(proc, hung_after_results, out, devices):
        raise AssertionError(f"{Path(worker).name} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [torch.load(out / f"rank{r}.pt") for r in range(devices)]


def _wait_for_results(procs: list[subprocess.Popen], out: Path, devices: int, timeout: float,
                      grace: float = 60.0) -> tuple[list[subprocess.CompletedProcess], bool]:
    """The launched processes' ends, and whether they were killed ``grace`` s after every rank had written its
    result: gloo's teardown now and then leaves rank 0 waiting in ``destroy_process_group`` after rank 1 has exited
    (seen twice in ~20 runs of benchmarks/fabric_benchmark.py, which waited out its 30-minute timeout). Past
    ``timeout`` with a result missing: every process group killed, ``TimeoutExpired`` naming the missing results.
    Each process leads a session of its own (``start_new_session``): killing its group ends the ranks it started."""
    start, written, ended = time.monotonic(), None, {}
    while True:
        for i, proc in enumerate(procs):
            if i in ended:
                continue
            try:
                stdout, stderr = proc.communicate(timeout=1)
                ended[i] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
            except subprocess.TimeoutExpired:
                pass
        if len(ended) == len(procs):
            return [ended[i] for i in range(len(procs))], False
        now = time.monotonic()
        if written is None and all((out / f"rank{r}.pt").exists() for r in range(devices)):
            written = now
        if (written is None or now - written < grace) and now - start < timeout:
            continue
        for i, proc in enumerate(procs):
            if i not in ended:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
                ended[i] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        if written is None:
            missing = [f"rank{r}.pt" for r in range(devices) if not (out / f"rank{r}.pt").exists()]
            tails = "".join(f"\n--- process {i}:\n{(d.stdout or '')[-1500:]}{(d.stderr or '')[-1500:]}"
                            for i, d in sorted(ended.items()))
            report = f"{', '.join(missing)} missing after {timeout} s; every rank killed{tails}"
            raise subprocess.TimeoutExpired(procs[0].args, timeout, output=report)
        return [ended[i] for i in range(len(procs))], True


def _ended_well(done: subprocess.CompletedProcess, hung_after_results: bool, out: Path, devices: int) -> bool:
    """A launched process that did its part: exit 0, killed by :func:`_wait_for_results` after every result was on
    disk, or gloo's abort at exit after the results (:func:`exit_abort_after_results`)."""
    killed = hung_after_results and done.returncode == -signal.SIGKILL
    return done.returncode == 0 or killed or exit_abort_after_results(done, out, devices)


def torchrun_ranks(worker: str | Path, out: Path, *args: Any, devices: int = 2, timeout: float = 420) -> list[Any]:
    """A test's worker as ``torchrun`` starts it: one process per rank with the environment torchrun sets (so Fabric
    and the Trainer launch nothing), ``--out OUT`` and ``args``; each rank's result from ``OUT/rank<r>.pt``. A rank
    left waiting in gloo's teardown after every result is written is ended (:func:`_wait_for_results`)."""
    import socket

    import torch

    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(devices), NODE_RANK="0")
    cmd = [sys.executable, str(worker), "--out", str(out), *map(str, args)]
    procs = [subprocess.Popen(cmd, env={**env, "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for r in range(devices)]
    try:
        ended, hung_after_results = _wait_for_results(procs, out, devices, timeout)
    except subprocess.TimeoutExpired as err:  # a rank left waiting in a collective: none outlives the test
        raise AssertionError(f"{Path(worker).name}: {err.output}") from None
    for done in ended:
        done = subprocess.CompletedProcess(cmd, done.returncode, done.stdout, done.stdout)  # stderr went to stdout
        assert _ended_well(done, hung_after_results, out, devices), done.stdout[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)]


# how torch.multiprocessing (Fabric's "ddp_spawn") reports a child that died of SIGABRT
_SPAWNED_CHILD_ABORTED = re.compile(r"ProcessExitedException: process \d+ terminated with signal SIGABRT")


def teardown_abort(proc: subprocess.CompletedProcess) -> bool:
    """Whether ``proc`` died of gloo's abort at interpreter exit: SIGABRT with the C++ runtime's "terminate called
    without an active exception". gloo's worker threads can still be releasing a finished collective's tensors when
    Python's finalization begins; a thread that then needs the GIL is ended, and the C++ runtime aborts (torch's
    proposed fix, an exit handler that destroys the process groups, was withdrawn; Lightning destroys them at exit
    for NCCL only). The process launched is the one aborted (-6), or, under Fabric's ``"ddp_spawn"``, the parent
    reports its child's abort through ``torch.multiprocessing`` and exits 1 (torch 2.11: ~1 run in 6 of
    tests/fabric_ddp_worker.py --spawn)."""
    child_aborted = proc.returncode == 1 and _SPAWNED_CHILD_ABORTED.search(proc.stderr) is not None
    return (proc.returncode == -6 or child_aborted) and "terminate called without an active exception" in proc.stderr


def exit_abort_after_results(proc: subprocess.CompletedProcess, out: Path, devices: int) -> bool:
    """:func:`teardown_abort` after everything the run had to do is done and written: every rank's result on disk.
    The results are what the tests judge; any other failure still fails."""
    return teardown_abort(proc) and all((out / f"rank{r}.pt").exists() for r in range(devices))


def worker_arguments(doc: str | None = None) -> argparse.ArgumentParser:
    """A test worker's parser with the two arguments :func:`launch_ranks` passes: ``--out`` (the folder each rank
    writes ``rank<r>.pt`` into, :func:`end_worker`) and ``--devices``."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--out", required=True, help="each rank writes rank<r>.pt here")
    parser.add_argument("--devices", type=int, default=2)
    return parser


def start_worker(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The worker's arguments; one torch thread per rank (two ranks share the cores), seed 0 on every rank."""
    import lightning as L
    import torch

    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    return args


def end_worker(out: str | Path, rank: int, result: dict) -> None:
    """One rank's result, where :func:`launch_ranks` reads it; then the process group ends."""
    import torch

    os.makedirs(out, exist_ok=True)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # gloo's threads must stop before the interpreter does: left to exit, they sometimes abort the process
        # ("terminate called without an active exception") after the results are written
        torch.distributed.destroy_process_group()
