"""Run by tests/test_fp8_distributed.py as a script: ``precision="fp8"`` (emulated on the CPU) under Lightning's
"ddp" or ModelParallelStrategy (FSDP2, ``fully_shard`` per Linear, gathering bf16: the high-precision all-gather),
gloo; or in one process on the global batch (``--devices 1``), the reference.

The data is one global batch per step of ``2 * BATCH`` samples; rank ``r`` of 2 reads rows ``r*BATCH`` to
``(r+1)*BATCH`` of it, one process all of it. The input is 60 informative features and 4 uninformative ones, all
of order 1. On the ranks ``--outlier-ranks`` lists, while the autopilot calibrates (the first
``--calibration-steps`` steps), the informative features come in micro-units (divided by ``OUTLIER``): the 4
others are then an outlier feature of ``offender``'s input, which flushes most of each row to zero in e4m3. No
other Linear sees anything unusual, and no rank sees it after calibration.

Writes ``rank{r}.pt`` into ``--out``: the gathered full weights, the local and the rank-averaged losses, which
Linears computed through the FP8 forward, the autopilot's decisions, and the dtypes of the local shards and their
gradients at the optimizer step.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_mp.fp8.autopilot as fp8_autopilot  # noqa: E402
from benchmarks.harness import end_worker, start_worker, worker_arguments  # noqa: E402
from lightning_mp import MixedPrecisionPlugin  # noqa: E402
from lightning_mp.fp8.linears import Fp8Forward  # noqa: E402

BATCH, INFO, WIDE, CLASSES, OUTLIER = 64, 60, 64, 16, 1e6


class Net(L.LightningModule):
    def __init__(self, plugin, fsdp):
        super().__init__()
        torch.manual_seed(0)
        self.offender, self.hidden, self.head = nn.Linear(WIDE, WIDE), nn.Linear(WIDE, WIDE), nn.Linear(WIDE, CLASSES)
        self.plugin, self.fsdp = plugin, fsdp
        self.losses, self.mean_losses, self.fp8_seen, self.shard_dtypes, self.weights_read = [], [], [], set(), set()

    def configure_model(self):
        if not self.fsdp:
            return
        from torch.distributed.fsdp import fully_shard

        mesh, mp = self.device_mesh["data_parallel"], self.plugin.fsdp_mp_policy()  # bf16 gathers, FP32 reduction
        for layer in (self.offender, self.hidden, self.head):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(self, mesh=mesh, mp_policy=mp)

    def forward(self, x):
        return self.head(F.relu(self.hidden(F.relu(self.offender(x)))))

    def on_train_batch_start(self, batch, batch_idx):  # which Linears run through torchao's FP8 matmul now
        fp8 = [n for n, m in self.named_children() if isinstance(m.__dict__.get("forward"), Fp8Forward)]
        self.fp8_seen.append(sorted(fp8))

    def on_fit_start(self):  # the weight each Linear's forward reads: FSDP2's all-gathered one, or the plugin's copy
        for name, m in self.named_children():
            m.register_forward_pre_hook(lambda m, args, name=name: self.weights_read.add(
                (name, type(m.weight).__name__, str(m.weight.dtype))) if torch.is_autocast_enabled("cpu") else None)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]).float(), batch[1])
        self.losses.append(loss.item())
        self.mean_losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.shard_dtypes |= {(type(p).__name__, str(p.dtype), str(p.grad.dtype)) for p in self.parameters()}

    def train_dataloader(self):
        x, y = data(*self.data_args, self.trainer.global_rank)
        return DataLoader(TensorDataset(x, y), batch_size=len(x) // self.data_args[0], shuffle=False)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def record_local_measurements(into, plugin):
    """What this rank measured before the ranks agree: {Linear: its row of the table} (flushed, -SQNR per tensor)."""
    agree = fp8_autopilot.agree_on_decisions

    def recording(table, device):
        candidates = plugin.core.fp8.autopilot._candidates  # the table's rows, in order
        into.update({name: row for (name, _), row in zip(candidates, table.tolist())})
        return agree(table, device)

    fp8_autopilot.agree_on_decisions = recording


def data(steps, devices, outlier_ranks, calibration_steps, rank):
    """This rank's rows of every global batch (``devices=1``: all of them), step after step."""
    g = torch.Generator().manual_seed(1)
    info = torch.randn(steps, 2, BATCH, INFO, generator=g)
    y = (info @ torch.randn(INFO, CLASSES, generator=torch.Generator().manual_seed(1234))).argmax(-1)
    for r in outlier_ranks:
        info[:calibration_steps, r] /= OUTLIER
    x = torch.cat([info, torch.randn(steps, 2, BATCH, WIDE - INFO, generator=g)], -1)
    ranks = slice(None) if devices == 1 else slice(rank, rank + 1)
    return x[:, ranks].reshape(-1, WIDE), y[:, ranks].reshape(-1)


def main():
    parser = worker_arguments()
    parser.add_argument("--strategy", default="ddp", help="ddp or fsdp (with --devices 1: one plain process)")
    parser.add_argument("--precision", default="fp8")
    parser.add_argument("--recipe", default="rowwise")
    parser.add_argument("--auto", action="store_true", help="fp8_modules=[nn.Linear, 'auto']")
    parser.add_argument("--outlier-ranks", default="", help="comma-separated ranks with the outlier while calibrating")
    parser.add_argument("--calibration-steps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save", help="checkpoint written after the fit")
    args = start_worker(parser)
    local = {}
    modules = [nn.Linear, "auto"] if args.auto else [nn.Linear]
    fp8 = {"fp8_recipe": args.recipe, "fp8_modules": modules} if args.precision == "fp8" else {}
    plugin = MixedPrecisionPlugin(args.precision, calibration_steps=args.calibration_steps, **fp8)
    record_local_measurements(local, plugin)
    model = Net(plugin, fsdp=args.strategy == "fsdp" and args.devices > 1)
    if args.devices == 1:
        strategy = "auto"
    elif args.strategy == "fsdp":
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    else:
        strategy = "ddp"
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, plugins=[plugin],
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)  # fmt: skip
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    outliers = [int(r) for r in args.outlier_ranks.split(",") if r]
    model.data_args = (args.steps, args.devices, outliers, args.calibration_steps)
    trainer.fit(model)
    if args.save:
        trainer.save_checkpoint(args.save)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}
    autopilot = plugin.core.fp8.autopilot
    result = {
        "state": full,
        "start": start,
        "losses": model.losses,
        "mean_losses": model.mean_losses,
        "fp8_seen": model.fp8_seen,
        "shard_dtypes": model.shard_dtypes,
        "weights_read": model.weights_read,
        "local_measurements": local,
        "kept": autopilot.kept if autopilot is not None else None,
        "decisions": [(d.module, d.step, d.evidence) for d in autopilot.decisions] if autopilot is not None else [],
        "describe": plugin.core.fp8.describe(),
        "steps": trainer.global_step,
    }
    end_worker(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
