"""Run by tests/test_autopilot_distributed.py as a script: ``fp32_modules="auto"`` under Lightning's "ddp" (launched
by Lightning, or by ``torchrun`` as separate nodes) or ModelParallelStrategy (FSDP2, ``fully_shard`` per layer),
gloo on the CPU.

Every rank reads its own samples; on the ranks ``--outlier-ranks`` lists, the first batch holds one outlier sample
(every feature ``OUTLIER``), which pushes ``net.2``'s fp16 output past 65504 from inputs below the calibration
threshold. The step is skipped (the loss is non-finite; the ranks agree on the skip), and from the next step on the
batches are the same whichever ranks saw the outlier.

Writes ``rank{r}.pt`` into ``--out``: the gathered full weights, the moved modules and their decisions, the
plugin's counters and the losses.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks.harness import end_worker, start_worker, worker_arguments  # noqa: E402
from lightning_mp import MixedPrecisionPlugin  # noqa: E402

OUTLIER = 3000.0  # net.0's outputs stay below fp16's calibration threshold (8188); net.2's go past 65504
BATCH, STEPS = 8, 6


class Model(L.LightningModule):
    def __init__(self, plugin, fsdp):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 1))
        with torch.no_grad():
            self.net[2].weight.mul_(100.0)  # outputs of a few hundred on ordinary samples: fp16 holds them
        self.plugin, self.fsdp, self.losses = plugin, fsdp, []

    def configure_model(self):
        if not self.fsdp:
            return
        from torch.distributed.fsdp import fully_shard

        # each Linear, then the rest of self.net (its LayerNorm): net.2's output reaches the LayerNorm in the precision
        # net.2 computed (a group of its own would cast its input to fp16: fully_shard's cast_forward_inputs)
        mesh, mp = self.device_mesh["data_parallel"], self.plugin.fsdp_mp_policy()
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(self.net, mesh=mesh, mp_policy=mp)
        fully_shard(self, mesh=mesh, mp_policy=mp)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        x, y = self.data[self.trainer.global_rank]
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=2.0**-6)


def data(world, outlier_ranks):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world, STEPS * BATCH, 4, generator=g)
    for r in outlier_ranks:
        x[r, 0] = OUTLIER  # the first sample of the first batch
    y = x.sum(dim=2, keepdim=True).clamp(-4, 4) * 0.3
    return list(zip(x, y))


def main():
    parser = worker_arguments()
    parser.add_argument("--strategy", default="ddp", help="ddp or fsdp")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--outlier-ranks", default="", help="comma-separated ranks whose first batch has the outlier")
    parser.add_argument("--calibration-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--save", help="checkpoint written after the fit")
    parser.add_argument("--resume", help="checkpoint to resume from")
    args = start_worker(parser)
    world = args.devices * args.num_nodes
    outliers = [int(r) for r in args.outlier_ranks.split(",") if r]
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8, fp32_modules="auto",
                                  calibration_steps=args.calibration_steps)
    model = Model(plugin, fsdp=args.strategy == "fsdp")
    model.data = data(world, outliers)
    if args.strategy == "fsdp":
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        strategy = "ddp" if world > 1 else "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        plugins=[plugin],
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}
    autopilot = plugin.core.autopilot
    result = {
        "state": full,
        "moved": plugin.auto_fp32_modules,
        "decisions": [(d.module, d.step, d.evidence) for d in autopilot.decisions],
        "skipped": plugin.skipped_steps,
        "scale": plugin.loss_scale,
        "losses": model.losses,
        "steps": trainer.global_step,
    }
    end_worker(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
