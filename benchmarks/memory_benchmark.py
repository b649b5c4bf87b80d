"""Training memory: lightning_mp against plain FP32 and Lightning's own mixed precision, one subprocess per row.

    python benchmarks/memory_benchmark.py                  # GPT 8x512 (~25M parameters), Adam, 4 steps
    python benchmarks/memory_benchmark.py --n-layer 2 --n-embd 128 --steps 2   # a quick look

Two figures per variant, both measured from outside the package:

* model-state bytes per parameter: after the last step, every live tensor storage in the process (found through
  the garbage collector, each storage counted once) divided by the parameter count. Parameters, gradients, FP32
  copies and optimizer state are all in there; the data batch is a few KB.
* peak training memory: the process's peak resident set size (``ru_maxrss``) over the whole ``fit``, minus the
  peak before ``fit`` (imports, model built in FP32, data). It includes the step's transient buffers: 16-bit
  copies, 16-bit and FP32 gradients, activations, autocast's weight cache.

Each row runs in a fresh process, so one variant's freed memory cannot hide another's peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

try:
    import resource  # POSIX only: the process's peak RSS
except ImportError:  # e.g. Windows: the peak RSS columns stay empty
    resource = None

VARIANTS = [
    "plain fp32", "native bf16-mixed", "lightning_mp bf16", "native 16-mixed", "lightning_mp fp16",
    "lightning_mp bf16 compensated", "lightning_mp bf16 compensated + bf16 state",
]


def worker(variant: str, args: argparse.Namespace) -> dict:
    import lightning as L
    import torch
    from harness import live_storage_bytes  # the count tests/test_memory_integration.py makes too
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_mp import MixedPrecisionPlugin
    from lightning_mp.demos import GPT

    torch.manual_seed(0)

    class Adam(GPT):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

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
    }[variant]
    result: dict = {"variant": variant, "params": sum(p.numel() for p in model.parameters())}

    class Measure(Callback):
        def on_train_batch_end(self, trainer, pl_module, *rest):
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
    return result


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
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return []

    import torch

    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "worker"]
    from harness import worker_row

    rows = [worker_row(__file__, "--worker", variant, *forwarded) for variant in VARIANTS]
    base = next(r for r in rows if r["variant"] == "native bf16-mixed")["peak_mib"]
    print(f"GPT {args.n_layer}x{args.n_embd}, {rows[0]['params'] / 1e6:.1f}M parameters, Adam, batch "
          f"{args.batch_size}x{args.block_size}, {args.steps} steps\n")
    print("| variant | model-state bytes/param | peak training memory (MiB) | vs bf16-mixed |")
    print("|---|---:|---:|---:|")
    for r in rows:
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        ratio = "-" if r["peak_mib"] is None or not base else f"{r['peak_mib'] / base:.2f}"
        print(f"| {r['variant']} | {r['state_bytes_per_param']:.2f} | {peak} | {ratio} |")
    return rows


if __name__ == "__main__":
    main()
