"""The plugin's forward compiled whole: inductor with ``fullgraph=True`` on the demo GPT at a tiny size, with a
user-listed FP32 module of two ops (so the policy's FP32 forward, not one kernel, computes it), in bf16, fp16 and fp8.
One graph over the steps (no break, no recompile: FP8 is only fast compiled), and the losses those steps report are
eager ones within one unit of the format's epsilon. Torch 2.11's Dynamo traces no autocast setter: the FP32 forward
switches autocast off with a ``with torch.autocast`` block when compiled (``lightning_mp.policy.modules``)."""

import shutil

import pytest
import torch
import torch._dynamo as dynamo
from lightning.fabric import Fabric
from torch import nn
from torch._dynamo.utils import counters

from lightning_mp import DEFAULT_FP32_MODULES
from lightning_mp.demos.gpt import GPT
from lightning_mp.fabric import MixedPrecisionPlugin as FabricPlugin

pytestmark = pytest.mark.slow  # inductor compiles each precision's forward and backward: about a minute apiece on a CPU
# the 16-bit format of the activations; fp8 is bf16 with its Linears' GEMMs in FP8 (casts done alike in both runs)
EPS = {name: torch.finfo(dtype).eps for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                                                        ("fp8", torch.bfloat16))}  # fmt: skip


class Gate(nn.Module):
    """``x * sigmoid(x)``: two ops, listed in ``fp32_modules`` by the user."""

    def forward(self, x):
        return x * torch.sigmoid(x)


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    for block in model.blocks:
        block.mlp[1] = Gate()  # in place of the GELU
    return model


def losses(precision: str, compiled: bool, steps: int = 3) -> tuple[list[float], int]:
    """``steps`` AdamW steps of the tiny GPT under Fabric and the plugin; the losses and how many graphs compiled."""
    dynamo.reset()
    counters.clear()
    fp8 = {"fp8_modules": ["blocks"]} if precision == "fp8" else {}  # torchao's size rule takes no Linear this small
    plugin = FabricPlugin(precision, fp32_modules=DEFAULT_FP32_MODULES + (Gate,), **fp8)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = tiny_gpt()
    net = torch.compile(model, fullgraph=True) if compiled else model  # inductor
    module, opt = fabric.setup(net, torch.optim.AdamW(model.parameters(), lr=1e-2))
    tokens = torch.randint(0, 64, (steps, 4, 17), generator=torch.Generator().manual_seed(1))
    out = []
    try:
        for batch in tokens.unbind(0):
            loss = GPT.loss_fn(module(batch[:, :-1].contiguous()), batch[:, 1:].contiguous())
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
    finally:  # the compiled graph keeps the plugin alive: its FP32 kernels go now, not when it is collected
        plugin.release_kernels()
    return out, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8"])
def test_a_gpt_with_a_listed_fp32_module_compiles_whole_and_trains_as_eager(precision):
    if not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
        pytest.skip("inductor compiles C++ on the CPU: no C++ compiler (g++, c++, clang++) on the PATH")
    if precision == "fp8":
        pytest.importorskip("torchao", reason="precision='fp8' computes through torchao")
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # torchao's compiled FP8 model alone fails there too
            pytest.skip("inductor's FP8 GEMMs on a CPU need bf16 arithmetic (oneDNN refuses them on AVX2)")
    eager, _ = losses(precision, compiled=False)
    compiled, graphs = losses(precision, compiled=True)  # before the FP32 forward, torch 2.11 raised here
    assert graphs == 1
    # inductor fuses the 16-bit elementwise ops (one rounding where eager rounds after each): within one epsilon.
    # Measured (torch 2.11 and 2.13, AVX512): bf16 1e-6, fp16 2e-5, fp8 7e-4 relative.
    torch.testing.assert_close(compiled, eager, rtol=EPS[precision], atol=0)
