"""Run by tests/test_gemm_emulation_integration.py as a script: Lightning's "ddp" strategy re-launches this file once
per rank. Each rank's GEMM probe is given its own figures (``--figures``: one comma-separated list per rank, in
``lightning_mp.gemm.ops.FAMILIES`` order), as two machines' timings would differ; an fp16 Conv2d + Linear fits.

Writes ``rank{r}.pt`` into ``--out`` with the plugin's GEMM verdict line, the emulated families and the final weights.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_mp.gemm.support as gs  # noqa: E402
from benchmarks.harness import end_worker, start_worker, worker_arguments  # noqa: E402
from lightning_mp import MixedPrecisionPlugin  # noqa: E402
from lightning_mp.gemm.ops import FAMILIES  # noqa: E402


class ConvNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(32, 2, 4, 4, generator=g)
        r, w = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(TensorDataset(x[r::w], x.mean(dim=(1, 2, 3))[r::w, None]), batch_size=8, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    parser = worker_arguments()
    parser.add_argument("--figures", nargs="+", required=True, help="per rank: the probe's 16-bit/FP32 times")
    args = start_worker(parser)
    rank = int(os.environ.get("LOCAL_RANK", 0))  # set in the ranks Lightning launches; rank 0 is this process
    figures = dict(zip(FAMILIES, map(float, args.figures[rank].split(","))))
    gs._probe = lambda dtype: dict(figures)
    plugin = MixedPrecisionPlugin("fp16")
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp", plugins=[plugin], max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    model = ConvNet()
    trainer.fit(model)
    result = {"line": plugin.gemm.describe(), "families": sorted(plugin.gemm.families),
              "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    end_worker(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
