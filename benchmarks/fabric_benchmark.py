"""Fabric loop step time: lightning_mp.fabric.MixedPrecisionPlugin against Fabric's own MixedPrecision, bf16 and fp16.

One process, the demo GPT, the same loop for every row (forward, FP32 loss, fabric.backward, fabric.clip_gradients,
optimizer.step, zero_grad). The rows are interleaved: each round runs a few steps of every row in turn, so a
machine that speeds up or slows down (other jobs, turbo) shifts every row alike. Reported: the median step time.

    python benchmarks/fabric_benchmark.py --rounds 5 --steps 4
"""

import argparse
import statistics
import time

import lightning as L
import torch
from lightning.fabric.plugins.precision import MixedPrecision

from lightning_mp.demos import GPT, StdlibTextDataModule
from lightning_mp.fabric import MixedPrecisionPlugin
from lightning_mp.gemm.emulation import cpu_capability

ROWS = {
    "fp32 (Fabric 32-true)": lambda: None,
    "lightning_mp bf16": lambda: MixedPrecisionPlugin("bf16"),
    "Fabric bf16-mixed": lambda: MixedPrecision("bf16-mixed", "cpu"),
    "lightning_mp fp16": lambda: MixedPrecisionPlugin("fp16"),  # gemm="auto": emulated where fp16 is not native
    "lightning_mp fp16, gemm=native": lambda: MixedPrecisionPlugin("fp16", gemm="native"),
    # passed as a plugin: Fabric(precision="16-mixed") on a CPU silently becomes bf16-mixed
    "Fabric 16-mixed": lambda: MixedPrecision("16-mixed", "cpu"),
}


def build(make_plugin, args):
    plugin = make_plugin()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin] if plugin is not None else None)
    torch.manual_seed(0)
    model = GPT(block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd)
    model, optimizer = fabric.setup(model, model.configure_optimizers())
    return fabric, model, optimizer


def run_steps(fabric, model, optimizer, batches):
    times = []
    for x, y in batches:
        start = time.perf_counter()
        fabric.backward(GPT.loss_fn(model(x), y))
        # error_if_nonfinite=False: Fabric's own 16-mixed would raise on its first (overflowing) steps
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)  # CPU kernels are synchronous: no device sync needed
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per row per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per row before the first round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    data = StdlibTextDataModule(block_size=args.block_size, batch_size=args.batch_size, max_bytes=2**20, seed=0)
    loader = iter(data.train_dataloader())
    batches = [next(loader) for _ in range(args.warmup + args.steps)]
    runs = {name: build(make, args) for name, make in ROWS.items()}
    times = {name: [] for name in ROWS}
    for name, run in runs.items():
        run_steps(*run, batches[: args.warmup])
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name] += run_steps(*run, batches[args.warmup :])

    print(f"CPU capability: {cpu_capability()}; torch {torch.__version__}; {args.threads} thread(s); GPT "
          f"n_layer={args.n_layer} n_embd={args.n_embd} block={args.block_size} batch={args.batch_size}; "
          f"{args.rounds} rounds x {args.steps} steps, interleaved")  # fmt: skip
    base = statistics.median(times["fp32 (Fabric 32-true)"])
    print("\n| row | median ms/step | min ms/step | vs fp32 |\n|---|---:|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f} | {base / med:.2f}x |")


if __name__ == "__main__":
    main()
