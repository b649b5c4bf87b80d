"""Plain torch code after a Fabric loop, with the plugin, Fabric and the model still alive, against a fresh process.

Four worker processes: a fresh one, one that has run a few steps of the demo GPT under
lightning_mp.fabric.MixedPrecisionPlugin, the same followed by ``plugin.release_kernels()``, and one after the same
loop under Fabric's own MixedPrecision. Each keeps its objects alive (a script that goes on after its loop) and times
two workloads on request: FP32 ``torch.mm`` of small matrices (where a Python kernel left at the dispatcher would show
per call: the emulated GEMMs' are out between iterations) and a small MLP forward under ``torch.autocast``, where the
FP32 policy's kernels, registered from the plugin's first forward until it goes and switched off between iterations,
cost one Python call per listed op (LayerNorm, softmax here) until ``release_kernels()``. The requests are
interleaved, so a machine that speeds up or slows down shifts every worker alike. Reported: the median time per call,
and each worker's over the fresh one.

    python benchmarks/after_fabric_benchmark.py --rounds 7
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

WORKERS = ("fresh process", "after a lightning_mp Fabric loop", "the same, then plugin.release_kernels()",
           "after a Fabric MixedPrecision loop")
WORKLOADS = ("FP32 torch.mm 64x64", "bf16 autocast MLP forward")


def fabric_loop(which: str, args) -> tuple:
    """A few Fabric steps of the demo GPT; returns what a script would still hold afterwards."""
    import lightning as L
    from lightning.fabric.plugins.precision import MixedPrecision

    from lightning_mp.demos import GPT
    from lightning_mp.fabric import MixedPrecisionPlugin

    if which in WORKERS[1:3]:
        plugin = MixedPrecisionPlugin(args.precision, gemm=args.gemm)
    else:
        plugin = MixedPrecision("bf16-mixed" if args.precision == "bf16" else "16-mixed", "cpu")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = GPT(block_size=32, n_layer=1, n_embd=64, n_head=2)
    model, optimizer = fabric.setup(model, model.configure_optimizers())
    x = torch.randint(0, 256, (4, 32))  # bytes: the demo GPT's vocabulary
    for _ in range(3):
        fabric.backward(GPT.loss_fn(model(x), x))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if which == WORKERS[2]:
        plugin.release_kernels()
    return fabric, model, optimizer, plugin


def workloads(reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 64, generator=gen), torch.randn(64, 64, generator=gen)
    nn = torch.nn
    mlp = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 64))
    x = torch.randn(32, 64, generator=gen)

    def mm():
        for _ in range(reps):
            torch.mm(a, b)

    def autocast():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(reps):
                mlp(x).softmax(-1)

    return dict(zip(WORKLOADS, (mm, autocast)))


def worker(which: str, args) -> None:
    torch.set_num_threads(1)
    held = fabric_loop(which, args) if which != WORKERS[0] else ()  # noqa: F841 (alive until the process ends)
    runs = workloads(args.reps)
    for fn in runs.values():
        fn()  # first calls pay one-time kernel selection
    print("ready", flush=True)
    for line in sys.stdin:
        start = time.perf_counter()
        runs[line.strip()]()
        print((time.perf_counter() - start) / args.reps, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=2000, help="calls per timing")
    parser.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--gemm", choices=("auto", "native", "emulated"), default="emulated",
                        help="the plugin's gemm= (emulated: its GEMM kernels are used on any CPU)")
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args)

    from lightning_mp.gemm.support import cpu_capability

    argv = [sys.executable, str(Path(__file__).resolve()), "--reps", str(args.reps), "--precision", args.precision,
            "--gemm", args.gemm]
    procs = {w: subprocess.Popen([*argv, "--worker", w], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for w in WORKERS}
    try:
        for proc in procs.values():
            assert proc.stdout.readline().strip() == "ready"
        times = {(w, load): [] for w in WORKERS for load in WORKLOADS}
        for round_ in range(args.rounds):
            order = WORKERS if round_ % 2 == 0 else WORKERS[::-1]
            for load in WORKLOADS:
                for w in order:
                    procs[w].stdin.write(load + "\n")
                    procs[w].stdin.flush()
                    times[(w, load)].append(float(procs[w].stdout.readline()))
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    print(f"CPU capability: {cpu_capability()}; torch {torch.__version__}; 1 thread per process; plugin "
          f"{args.precision}, gemm={args.gemm!r}; {args.rounds} rounds x {args.reps} calls, interleaved")
    print("\n| workload | process | median us/call | vs fresh |\n|---|---|---:|---:|")
    for load in WORKLOADS:
        fresh = statistics.median(times[(WORKERS[0], load)])
        for w in WORKERS:
            med = statistics.median(times[(w, load)])
            print(f"| {load} | {w} | {med * 1e6:.1f} | {med / fresh:.2f}x |")


if __name__ == "__main__":
    main()
