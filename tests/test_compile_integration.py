"""torch.compile(fullgraph=True) of a block with LayerNorm and attention, through the Trainer and Fabric: it compiles
under the plugin into as many graphs as without it (the copy hooks step aside under compile, the FP32 policy is
dispatcher kernels that Dynamo traces through, the FP32-module hooks are traceable). Emulated 16-bit GEMMs (the default
on CPUs without 16-bit arithmetic) compile too, and compute what they compute in eager execution. Inductor's caches on
disk never serve a graph traced under another precision plugin (fresh processes: tests/compile_cache_worker.py)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

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
from tests.conftest import cpu_only, device, trainer_kwargs

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
# gemm="auto" emulates only on a CPU without the 16-bit arithmetic; on CUDA it is always native
EMULATED = pytest.param("emulated", marks=cpu_only("emulated GEMMs are the CPU's stand-in; CUDA runs them natively"))


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


@pytest.mark.on_device
@pytest.mark.parametrize("gemm", ["native", EMULATED])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_trainer_compiles_fullgraph_into_as_many_graphs_as_lightnings_own_plugin(precision, gemm):
    # gemm="emulated" is what "auto" picks on a CPU without that 16-bit arithmetic (every fp16 run on a CPU here)
    plugin = MixedPrecisionPlugin(precision, gemm=gemm)
    assert graphs_in_a_fit(plugins=[plugin]) == graphs_in_a_fit(precision="bf16-mixed") == 1


def fabric_losses(plugins, compile_backend=None):
    """Four Fabric steps of the attention block; the losses and how many graphs Dynamo compiled."""
    dynamo.reset()
    counters.clear()
    fabric = Fabric(accelerator=device(), devices=1, plugins=plugins)
    block = Block()
    net = block if compile_backend is None else torch.compile(block, fullgraph=True, backend=compile_backend)
    model, opt = fabric.setup(net, torch.optim.SGD(block.parameters(), lr=0.01))
    losses = []
    for (x,) in data():
        loss = model(x.to(fabric.device)).float().pow(2).mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, counters["stats"]["unique_graphs"]


@pytest.mark.on_device
@pytest.mark.parametrize("gemm", ["native", EMULATED])
def test_fabric_compiles_fullgraph_into_as_many_graphs_as_without_the_plugin(gemm):
    assert fabric_losses([FabricPlugin("bf16", gemm=gemm)], "eager")[1] == fabric_losses([], "eager")[1] == 1


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_compiled_emulated_gemms_compute_what_eager_emulation_computes(precision):
    # Dynamo (fake tensors) and AOTAutograd (functional tensors, the joint forward-backward graph) trace the emulated
    # kernels: the graph holds the upcast, the FP32 GEMM and the rounding, so the losses are eager emulation's, bit for
    # bit, and not the native 16-bit kernels' (which accumulate in another order: 1 ulp apart on some elements)
    eager, _ = fabric_losses([FabricPlugin(precision, gemm="emulated")])
    compiled, graphs = fabric_losses([FabricPlugin(precision, gemm="emulated")], "aot_eager")
    assert graphs == 1
    assert compiled == eager


def _compiled_fits(cache_dir, *precisions, caches=True):
    """The fits of ``precisions`` in one fresh process, compiled by inductor with torch's default caches under
    ``cache_dir`` (a test never reads the user's cache), or with every compile cache off."""
    if not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
        pytest.skip("inductor compiles C++ on the CPU: no C++ compiler (g++, c++, clang++) on the PATH")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "PYTHONWARNINGS": "ignore"}
    if not caches:
        env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    done = subprocess.run([sys.executable, "-m", "tests.compile_cache_worker", *precisions], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_compile_caches_never_serve_a_graph_traced_under_another_precision_plugin(tmp_path):
    # AOTAutograd traces through the FP32 policy's kernels, but its on-disk cache keyed a graph by what Dynamo saw,
    # the same under both plugins: the second of two runs got the first one's graphs (its losses, bit for bit). The
    # plugin's kernel state is part of the key now (lightning_mp.compile_key).
    ours, lightnings = "lightning_mp:bf16", "bf16-mixed"
    alone = _compiled_fits(tmp_path / "off", ours, lightnings, caches=False)
    after_lightning = _compiled_fits(tmp_path / "a", lightnings, ours)
    after_ours = _compiled_fits(tmp_path / "b", ours, lightnings)
    assert alone[0]["losses"] != alone[1]["losses"]  # the policy shows in this model's losses
    assert after_lightning[0]["losses"] == alone[1]["losses"] and after_lightning[1]["losses"] == alone[0]["losses"]
    assert after_ours[0]["losses"] == alone[0]["losses"] and after_ours[1]["losses"] == alone[1]["losses"]
    # runs in the same state share the cache: another process's run of ours is served the graphs saved above
    again = _compiled_fits(tmp_path / "a", ours)
    assert again[0]["cache_hits"] > 0 and again[0]["losses"] == alone[0]["losses"]
