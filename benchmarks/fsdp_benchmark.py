"""Step time under FSDP2 (Lightning's ModelParallelStrategy), with and without lightning_mp, interleaved.

    python benchmarks/fsdp_benchmark.py                # 2 gloo processes on the CPU (or 2 GPUs with --accelerator cuda)

The demo GPT is sharded with ``fully_shard`` per block and at the root, as a user writes it. Variants, taking turns
round by round inside the same two processes: FSDP2 in FP32; FSDP2 with its own bf16 ``MixedPrecisionPolicy``
and no plugin (the baseline a ModelParallelStrategy user has today); lightning_mp bf16 and fp16 (the same policy
from ``plugin.fsdp_mp_policy()``, plus the guard, the FP32 op policy and loss scaling). Rank 0 prints median step
times and the ratios, all measured in this one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.demos import GPT
from lightning_mp.numerics.sharding import fsdp_mp_policy

VARIANTS = ("FSDP2 fp32", "FSDP2 bf16 policy, no plugin", "lightning_mp bf16", "lightning_mp fp16")


class ShardedGPT(GPT):
    def __init__(self, policy, **kwargs):
        super().__init__(**kwargs)
        self.policy = policy

    def configure_model(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = self.policy or MixedPrecisionPolicy()
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(self, mesh=mesh, mp_policy=mp)


class Timer(Callback):
    def __init__(self):
        self.times: list[float] = []

    def on_train_batch_start(self, *args):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args):
        self.times.append(time.perf_counter() - self._t0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tokens = torch.randint(0, 256, (8 * args.steps * 2, 129), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rank = 0
    for _ in range(args.rounds):
        for variant in VARIANTS:
            plugin = None
            policy = None
            if variant.startswith("lightning_mp"):
                plugin = MixedPrecisionPlugin(variant.split()[-1])
                policy = plugin.fsdp_mp_policy()
            elif "bf16" in variant:
                policy = fsdp_mp_policy(torch.bfloat16)
            torch.manual_seed(0)
            model = ShardedGPT(policy, n_layer=2, n_embd=256, n_head=4, block_size=128)
            timer = Timer()
            trainer = L.Trainer(
                accelerator=args.accelerator, devices=2, max_steps=args.steps,
                strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                plugins=[plugin] if plugin else [], callbacks=[timer], logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                use_distributed_sampler=False,
            )
            trainer.fit(model, data)
            rank = trainer.global_rank
            times[variant] += timer.times[args.warmup :]
    if rank != 0:
        return
    med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
    print(f"\nCPU capability {torch.backends.cpu.get_cpu_capability()}, 2 processes, GPT 2x256, batch 8x128 per rank")
    print("| variant | median step (ms) | vs FSDP2 bf16 policy without the plugin |")
    print("|---|---:|---:|")
    for v in VARIANTS:
        print(f"| {v} | {med[v]:.1f} | {med[v] / med['FSDP2 bf16 policy, no plugin']:.2f} |")


if __name__ == "__main__":
    main()
