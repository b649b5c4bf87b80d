"""Run by tests/test_ddp.py as a script: Lightning's "ddp" strategy re-launches this file once per rank.

Writes ``rank{r}.pt`` into ``--out`` with the final weights and the plugin's counters.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks.harness import end_worker, start_worker, worker_arguments  # noqa: E402
from lightning_mp import MixedPrecisionPlugin  # noqa: E402


class Model(L.LightningModule):
    def __init__(self, poison_rank, poison_step, exact=False, manual=False):
        super().__init__()
        self.automatic_optimization = not manual
        if exact:
            # small integers and dyadic fractions: every bf16 product and sum is exact, so the only difference
            # between one process and two is the FP32 summation order
            self.net = nn.Linear(4, 1, bias=False)
            with torch.no_grad():
                self.net.weight.copy_(torch.tensor([[1.0, 2.0, -1.0, 0.5]]))
        else:
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.poison_rank, self.poison_step = poison_rank, poison_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def on_after_backward(self):
        # a NaN that appears on one rank only, after DDP's all-reduce would have run: only an explicit
        # agreement on the overflow flag keeps the ranks in step
        if self.global_rank == self.poison_rank and self.trainer.global_step == self.poison_step:
            next(self.net.parameters()).grad.view(-1)[0] = float("nan")

    def train_dataloader(self):
        # rank r reads samples r, r + W, r + 2W, ... in order (Lightning's automatic sampler would shuffle)
        r, w = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(TensorDataset(self.x[r::w], self.y[r::w]), batch_size=self.batch_size, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=2.0**-6)


def main():
    parser = worker_arguments()
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--poison-rank", type=int, default=-1)
    parser.add_argument("--poison-step", type=int, default=-1)
    parser.add_argument("--exact", action="store_true", help="integer data and weights (exact in bf16)")
    parser.add_argument("--manual", action="store_true", help="manual optimization: manual_backward, opt.step")
    parser.add_argument("--native", default="", help="Lightning's own precision instead of the plugin")
    parser.add_argument("--compensated", action="store_true", help="master_weights='compensated' (lean bf16)")
    args = start_worker(parser)
    g = torch.Generator().manual_seed(1)
    if args.exact:
        x = torch.randint(-2, 3, (64, 4), generator=g).float()
        y = torch.randint(-4, 5, (64, 1), generator=g).float()
    else:
        x = torch.randn(64, 4, generator=g)
        y = x.sum(dim=1, keepdim=True) * 0.3
    plugin = MixedPrecisionPlugin(
        args.precision, init_scale=2.0**8, **({"master_weights": "compensated"} if args.compensated else {})
    )
    model = Model(args.poison_rank, args.poison_step, exact=args.exact, manual=args.manual)
    model.x, model.y, model.batch_size = x, y, 32 // (args.devices * args.accumulate)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        plugins=[] if args.native else [plugin],
        precision=args.native or None,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result = {"state": state, "scale": plugin.loss_scale, "skipped": plugin.skipped_steps, "steps": trainer.global_step}
    end_worker(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
