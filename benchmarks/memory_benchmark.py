"""Training memory: lightning_mp against plain FP32 and Lightning's own mixed precision, one subprocess per row.

    python benchmarks/memory_benchmark.py                  # GPT 8x512 (~25M parameters), Adam, 4 steps
    python benchmarks/memory_benchmark.py --n-layer 2 --n-embd 128 --steps 2   # a quick look
    python benchmarks/memory_benchmark.py --only 8bit 4bit true --rounds 3      # the low-bit rows, step time over 3 rounds

Three figures per variant, all measured from outside the package:

* model-state bytes per parameter: after the last step, every live tensor storage in the process (found through
  the garbage collector, each storage counted once) divided by the parameter count. Parameters, gradients, FP32
  copies and optimizer state are all in there; the data batch is a few KB.
* peak training memory: the process's peak resident set size (``ru_maxrss``) over the whole ``fit``, minus the
  peak before ``fit`` (imports, model built in FP32, data). It includes the step's transient buffers: 16-bit
  copies, 16-bit and FP32 gradients, activations, autocast's weight cache.
* step time: the median CPU time of the training thread (one torch thread) per step, the first step (state
  allocation, torchao's compilation) left out, over every round; the rounds run the variants in alternating order
  (interleaved), so load from other processes falls on all of them alike. Ratios, not seconds, carry over.

Each row runs in a fresh process, so one variant's freed memory cannot hide another's peak.

The low-bit rows use torchao's ``AdamW8bit`` and ``AdamW4bit`` (8- and 4-bit moments in blocks of 256 and 128, each
block with an FP32 scale; tensors under 4096 elements keep FP32 moments); the other rows use torch's Adam, and
``bf16-true`` its AdamW on bf16 parameters (no masters: the 8 B/param reference). torchao compiles its step once per
parameter shape (about 20 s a shape on one core, then cached on disk): each low-bit row compiles it on dummy
parameters before ``fit``, so the compiler's memory stays out of the peak and its time out of the steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

try:
    import resource  # POSIX only: the process's peak RSS
except ImportError:  # e.g. Windows: the peak RSS columns stay empty
    resource = None

VARIANTS = [
    "plain fp32", "native bf16-mixed", "lightning_mp bf16", "native 16-mixed", "lightning_mp fp16",
    "lightning_mp bf16 compensated", "lightning_mp bf16 compensated + bf16 state",
    "native bf16-true + AdamW", "lightning_mp bf16 + AdamW8bit", "lightning_mp bf16 compensated + AdamW8bit",
    "lightning_mp bf16 compensated + AdamW4bit",
]


def worker(variant: str, args: argparse.Namespace) -> dict:
    import lightning as L
    import torch
    from harness import live_storage_bytes  # the count tests/test_memory_integration.py makes too
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

    from lightning_mp import MixedPrecisionPlugin
    from lightning_mp.demos import GPT

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the step times are one thread's CPU time
    optimizer_class = _optimizer_class(variant)

    class Adam(GPT):
        def configure_optimizers(self):
            return optimizer_class(self.parameters(), lr=1e-4)

    model = Adam(n_layer=args.n_layer, n_embd=args.n_embd, n_head=8, block_size=args.block_size)
    tokens = torch.randint(0, 256, (args.batch_size * args.steps, args.block_size + 1))
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    data = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size)
    plugins = {
        "plain fp32": [],
        "native bf16-mixed": [MixedPrecision("bf16-mixed", "cpu")],
        "lightning_mp bf16": [MixedPrecisionPlugin("bf16")],
        "native 16-mixed": [MixedPrecision("16-mixed", "cpu")],
        "lightning_mp fp16": [MixedPrecisionPlugin("fp16")],
        "lightning_mp bf16 compensated": [MixedPrecisionPlugin("bf16", master_weights="compensated")],
        "lightning_mp bf16 compensated + bf16 state": [
            MixedPrecisionPlugin("bf16", master_weights="compensated", optimizer_state_dtype=torch.bfloat16)
        ],
        "native bf16-true + AdamW": [HalfPrecision("bf16-true")],
        "lightning_mp bf16 + AdamW8bit": [MixedPrecisionPlugin("bf16")],
        "lightning_mp bf16 compensated + AdamW8bit": [MixedPrecisionPlugin("bf16", master_weights="compensated")],
        "lightning_mp bf16 compensated + AdamW4bit": [MixedPrecisionPlugin("bf16", master_weights="compensated")],
    }[variant]
    if optimizer_class.__module__.startswith("torchao"):
        _compile_step(optimizer_class, model)
    result: dict = {"variant": variant, "params": sum(p.numel() for p in model.parameters())}

    times: list[float] = []

    class Measure(Callback):
        def on_train_batch_start(self, *args):
            self.start = time.thread_time()

        def on_train_batch_end(self, trainer, pl_module, *rest):
            times.append(time.thread_time() - self.start)
            if trainer.global_step == args.steps:
                gc.collect()
                result["state_bytes_per_param"] = live_storage_bytes() / result["params"]

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=args.steps, plugins=plugins, callbacks=[Measure()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    gc.collect()
    before = _maxrss_mib()
    trainer.fit(model, data)
    result["peak_mib"] = _maxrss_mib() - before if resource is not None else None
    result["step_times"] = times[1:]  # the first step allocates the state (and compiles, where nothing was cached)
    return result


def _optimizer_class(variant: str):
    import torch

    if variant.endswith("bit"):
        import torchao.optim

        return getattr(torchao.optim, variant.rsplit(" ", 1)[1])
    return torch.optim.AdamW if variant.endswith("AdamW") else torch.optim.Adam


def _compile_step(optimizer_class, model) -> None:
    """One step of ``optimizer_class`` on FP32 dummies of each parameter shape: torchao compiles its step per shape
    on first use, and its compiler's memory and time belong to no training step."""
    import torch

    dummies = [torch.nn.Parameter(torch.ones(shape)) for shape in {tuple(p.shape) for p in model.parameters()}]
    for d in dummies:
        d.grad = torch.ones_like(d)
    optimizer_class(dummies, lr=1e-4).step()


def _maxrss_mib() -> float:
    if resource is None:
        return 0.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="runs of every variant, in alternating order")
    parser.add_argument("--only", nargs="+", metavar="WORD",
                        help="the variants whose name contains one of these words (and bf16-mixed, the baseline)")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return []

    import torch

    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("n_layer", "n_embd", "block_size", "batch_size", "steps")]
    from harness import worker_row

    variants = [v for v in VARIANTS if args.only is None or v == "native bf16-mixed" or any(w in v for w in args.only)]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for i in range(args.rounds):  # interleaved: every round runs every variant, in alternating order
        for variant in variants if i % 2 == 0 else variants[::-1]:
            runs[variant].append(worker_row(__file__, "--worker", variant, *forwarded))
    rows = [{**r[0], "step_times": [t for run in r for t in run["step_times"]],
             "peak_mib": None if r[0]["peak_mib"] is None else statistics.median(x["peak_mib"] for x in r)}
            for r in runs.values()]
    for r in rows:
        r["step_ms"] = 1e3 * statistics.median(r["step_times"]) if r["step_times"] else None
    base = next(r for r in rows if r["variant"] == "native bf16-mixed")
    print(f"GPT {args.n_layer}x{args.n_embd}, {rows[0]['params'] / 1e6:.1f}M parameters, Adam (or the optimizer "
          f"named), batch {args.batch_size}x{args.block_size}, {args.steps} steps, {args.rounds} round(s); step time: "
          "median CPU time of one thread per step\n")
    print("| variant | model-state bytes/param | peak training memory (MiB) | vs bf16-mixed | step time (ms) "
          "| vs bf16-mixed |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        ratio = "-" if r["peak_mib"] is None or not base["peak_mib"] else f"{r['peak_mib'] / base['peak_mib']:.2f}"
        step = "-" if r["step_ms"] is None else f"{r['step_ms']:.0f}"
        speed = "-" if r["step_ms"] is None or not base["step_ms"] else f"{r['step_ms'] / base['step_ms']:.2f}"
        print(f"| {r['variant']} | {r['state_bytes_per_param']:.2f} | {peak} | {ratio} | {step} | {speed} |")
    return rows


if __name__ == "__main__":
    main()
