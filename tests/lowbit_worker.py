"""Run by tests/test_lean_lowbit_integration.py as a script: lean bf16 (or FP32 masters) with torchao's AdamW8bit or
AdamW4bit under FSDP2 (Lightning's ModelParallelStrategy, gloo, CPU), the model sharded with ``fully_shard`` in
``configure_model``; ``--no-shard`` is one plain process, the unsharded reference.

Writes ``rank{r}.pt`` into ``--out``: the gathered full weights (FP32 masters after the fit), the losses, the type of
each optimizer state tensor (its local shard's under FSDP2), or the error the set-up raised.
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


class Model(L.LightningModule):
    """Two Linears whose weights (64 x 128) shard into 4096-element halves: torchao quantizes a state tensor only
    from 4096 elements on (smaller ones, the biases, stay plain FP32 tensors)."""

    def __init__(self, plugin, optimizer, shard, reduce_bf16=False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.plugin, self.optimizer, self.shard, self.losses = plugin, optimizer, shard, []
        self.reduce_bf16 = reduce_bf16

    def configure_model(self):
        if not self.shard:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = self.plugin.fsdp_mp_policy()
        if self.reduce_bf16:  # gradients reduced in bf16: the same bf16 values for FP32 masters and lean bf16
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(self, mesh=mesh, mp_policy=mp)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = (self.net(x).float() - x.sin()).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 64, generator=g)
        r, w = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(TensorDataset(x[r::w]), batch_size=16 // w, shuffle=False)

    def configure_optimizers(self):
        from torchao.optim import AdamW4bit, AdamW8bit

        return {"8bit": AdamW8bit, "4bit": AdamW4bit}[self.optimizer](self.parameters(), lr=1e-3)


def main():
    parser = worker_arguments(__doc__)
    parser.add_argument("--optimizer", choices=["8bit", "4bit"], default="8bit")
    parser.add_argument("--compensated", action="store_true", help="master_weights='compensated' (lean bf16)")
    parser.add_argument("--no-shard", action="store_true", help="one plain process: the unsharded reference")
    parser.add_argument("--reduce-bf16", action="store_true", help="fully_shard reduces gradients in bf16")
    parser.add_argument("--epochs", type=int, default=2)
    args = start_worker(parser)
    plugin = MixedPrecisionPlugin("bf16", master_weights="compensated" if args.compensated else None)
    model = Model(plugin, args.optimizer, shard=not args.no_shard, reduce_bf16=args.reduce_bf16)
    strategy = "auto" if args.no_shard else ModelParallelStrategy(data_parallel_size=args.devices,
                                                                   tensor_parallel_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, plugins=[plugin],
                        max_epochs=args.epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    result = {}
    try:
        trainer.fit(model)
    except Exception as error:  # noqa: BLE001 (the test reads the refusal's message)
        result["error"] = f"{type(error).__name__}: {error}"
    else:
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        state = trainer.optimizers[0].state[model.net[0].weight]
        result["state_types"] = {k: type(local(v)).__name__ for k, v in state.items()}
        result["state"] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                           for k, v in model.state_dict().items()}
        result["losses"] = model.losses
    end_worker(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
