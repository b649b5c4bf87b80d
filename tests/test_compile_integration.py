"""torch.compile(fullgraph=True) of a block with LayerNorm and attention, through the Trainer and Fabric: it compiles
under the plugin into as many graphs as without it (the copy hooks step aside under compile, the FP32 policy is
dispatcher kernels that Dynamo traces through, the FP32-module hooks are traceable)."""

import lightning as L
import pytest
import torch
import torch._dynamo as dynamo
from lightning.fabric import Fabric
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.fabric import MixedPrecisionPlugin as FabricPlugin
from tests.conftest import trainer_kwargs

pytestmark = pytest.mark.slow


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.ln = nn.LayerNorm(32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        h = self.ln(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.fc(x + a)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.compile(Block(), fullgraph=True, backend="eager")

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def data():
    return DataLoader(TensorDataset(torch.randn(16, 8, 32)), batch_size=4)


def graphs_in_a_fit(**precision):
    dynamo.reset()
    counters.clear()
    L.Trainer(**trainer_kwargs(max_steps=4, **precision)).fit(Model(), data())
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_trainer_compiles_fullgraph_into_as_many_graphs_as_lightnings_own_plugin(precision):
    # GEMM emulation is tested in eager execution only: on CPUs without fp16 arithmetic, compile with
    # gemm="native" (CUDA's "auto" is native)
    plugin = MixedPrecisionPlugin(precision, gemm="native")
    assert graphs_in_a_fit(plugins=[plugin]) == graphs_in_a_fit(precision="bf16-mixed") == 1


def test_fabric_compiles_fullgraph_into_as_many_graphs_as_without_the_plugin():
    def graphs(plugins):
        dynamo.reset()
        counters.clear()
        fabric = Fabric(accelerator="cpu", devices=1, plugins=plugins)
        block = Block()
        model, opt = fabric.setup(torch.compile(block, fullgraph=True, backend="eager"), torch.optim.SGD(block.parameters(), lr=0.01))
        for (x,) in data():
            fabric.backward(model(x).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
        return counters["stats"]["unique_graphs"]

    assert graphs([FabricPlugin("bf16")]) == graphs([]) == 1
