"""Several Trainer fits in one process, each of a freshly built and ``torch.compile``d (inductor) copy of the same
model, one per argument: ``bf16-mixed`` (Lightning's own) or ``lightning_mp:<precision>`` (the plugin). Prints one
JSON list: per fit, its losses and how many graphs AOTAutograd's cache served. The caches are torch's defaults,
under whatever ``TORCHINDUCTOR_CACHE_DIR`` the caller set (tests/test_compile_integration.py)."""

import json
import sys

import lightning as L
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin


class Model(L.LightningModule):
    """LayerNorm, GELU and log_softmax: ops the FP32 policy computes in FP32, which CPU autocast leaves in bf16."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.ln, self.fc2 = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 10)
        self.losses = []

    def forward(self, x):
        return torch.log_softmax(3 * self.fc2(nn.functional.gelu(self.ln(self.fc1(x)))), -1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.nll_loss(self(x).float(), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())  # outside the compiled step: no graph break in it

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(precision: str) -> dict:
    counters.clear()
    gen = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(48, 32, generator=gen), torch.randint(0, 10, (48,), generator=gen)),
                      batch_size=16)
    if precision.startswith("lightning_mp:"):
        kwargs = dict(plugins=[MixedPrecisionPlugin(precision.split(":", 1)[1])])
    else:
        kwargs = dict(precision=precision)
    model = Model()
    L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, **kwargs).fit(torch.compile(model), data)
    return {"losses": model.losses, "cache_hits": counters["aot_autograd"]["autograd_cache_hit"]}


if __name__ == "__main__":
    print(json.dumps([fit(precision) for precision in sys.argv[1:]]))
