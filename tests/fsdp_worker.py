"""Run by tests/test_fsdp2.py as a script: Lightning's ModelParallelStrategy (FSDP2, gloo, CPU) re-launches this
file once per rank; the model is sharded with ``fully_shard`` in ``configure_model``, as a user writes it.

Writes ``rank{r}.pt`` into ``--out``: the gathered full weights, the plugin's counters, the losses and what the
monitors logged.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks.harness import end_worker, start_worker, worker_arguments  # noqa: E402
from lightning_mp import GradientRangeMonitor, LossScaleMonitor, MixedPrecisionPlugin  # noqa: E402


class Recorder(Logger):
    def __init__(self):
        super().__init__()
        self.rows = []

    name, version = "recorder", 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs):
        pass


class SaveAfterFirstEpoch(L.Callback):
    def __init__(self, path):
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


class Model(L.LightningModule):
    def __init__(self, plugin, poison_rank, poison_step, shard=True, partial=False, adamw=False, reduce_bf16=False,
                 layer_norm=False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8) if layer_norm else nn.Tanh(), nn.Linear(8, 1))
        with torch.no_grad():  # dyadic weights and integer data: every product and sum below is exact
            self.net[0].weight.copy_(torch.arange(32.0).reshape(8, 4).remainder(5).sub(2).div(4))
            self.net[0].bias.zero_()
            self.net[2].weight.copy_(torch.arange(8.0).reshape(1, 8).remainder(3).sub(1).div(2))
            self.net[2].bias.zero_()
        self.plugin, self.poison_rank, self.poison_step, self.shard = plugin, poison_rank, poison_step, shard
        self.partial, self.adamw, self.reduce_bf16 = partial, adamw, reduce_bf16
        self.losses, self.shard_dtypes = [], set()

    def configure_model(self):
        if not self.shard:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = self.plugin.fsdp_mp_policy() if self.plugin is not None else MixedPrecisionPolicy()
        if self.reduce_bf16:  # gradients reduced in bf16: the same bf16 values for FP32 masters and compensated
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        mesh = self.device_mesh["data_parallel"]
        if self.partial:  # a user who shards one layer and forgets the rest
            fully_shard(self.net[0], mesh=mesh, mp_policy=mp)
            return
        for layer in self.net:
            if isinstance(layer, (nn.Linear, nn.LayerNorm)):
                fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(self, mesh=mesh, mp_policy=mp)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):  # resharded: the local shards and their gradients
        self.shard_dtypes |= {(str(p.dtype), str(p.grad.dtype)) for p in self.parameters()}

    def on_after_backward(self):
        # a NaN in one rank's shard only: only the agreed flag keeps the ranks skipping the same step
        if self.global_rank == self.poison_rank and self.trainer.global_step == self.poison_step:
            grad = self.net[0].weight.grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")

    def train_dataloader(self):
        r, w = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(TensorDataset(self.x[r::w], self.y[r::w]), batch_size=self.batch_size, shuffle=False)

    def configure_optimizers(self):
        if self.adamw:
            return torch.optim.AdamW(self.parameters(), lr=2.0**-6, weight_decay=0.1)
        return torch.optim.SGD(self.parameters(), lr=2.0**-6)


def main():
    parser = worker_arguments()
    parser.add_argument("--precision", default="bf16", help="fp16, bf16, or none (no plugin)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--poison-rank", type=int, default=-1)
    parser.add_argument("--poison-step", type=int, default=-1)
    parser.add_argument("--save", help="distributed checkpoint written at the end")
    parser.add_argument("--save-in-fit", help="distributed checkpoint written inside the fit, after epoch 0")
    parser.add_argument("--resume", help="distributed checkpoint to resume from")
    parser.add_argument("--no-shard", action="store_true", help="one plain process: the unsharded reference")
    parser.add_argument("--partial", action="store_true", help="fully_shard on the first layer only")
    parser.add_argument("--compensated", action="store_true", help="master_weights='compensated' (lean bf16)")
    parser.add_argument("--state-bf16", action="store_true", help="with --compensated: bf16 optimizer state")
    parser.add_argument("--parity-guard", type=float, default=0.0, help="with --compensated: the guard's fraction")
    parser.add_argument("--adamw", action="store_true", help="AdamW instead of SGD")
    parser.add_argument("--reduce-bf16", action="store_true", help="fully_shard reduces gradients in bf16")
    parser.add_argument("--layer-norm", action="store_true", help="a LayerNorm (an FP32 module) instead of the Tanh")
    args = start_worker(parser)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-2, 3, (64, 4), generator=g).float()
    y = torch.randint(-4, 5, (64, 1), generator=g).float()
    lean = {}
    if args.compensated:
        lean = {"master_weights": "compensated", "parity_guard": args.parity_guard,
                "optimizer_state_dtype": torch.bfloat16 if args.state_bf16 else None}
    plugin = None if args.precision == "none" else MixedPrecisionPlugin(args.precision, init_scale=2.0**8, **lean)
    model = Model(plugin, args.poison_rank, args.poison_step, shard=not args.no_shard, partial=args.partial,
                  adamw=args.adamw, reduce_bf16=args.reduce_bf16, layer_norm=args.layer_norm)
    model.x, model.y, model.batch_size = x, y, 16 // args.devices
    logger = Recorder()
    callbacks = [LossScaleMonitor(), GradientRangeMonitor(every_n_steps=1)] if plugin is not None else []
    if args.save_in_fit:
        callbacks.append(SaveAfterFirstEpoch(args.save_in_fit))
    strategy = (
        "auto" if args.no_shard else ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        plugins=[plugin] if plugin is not None else [],
        max_epochs=args.epochs,
        logger=logger,
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}
    result = {"state": full, "losses": model.losses, "steps": trainer.global_step, "logged": logger.rows,
              "shard_dtypes": model.shard_dtypes, "after_fit": {str(p.dtype) for p in model.parameters()}}
    if plugin is not None:
        result.update(scale=plugin.loss_scale, skipped=plugin.skipped_steps, scaler=plugin.core.scaler.state_dict())
    end_worker(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
