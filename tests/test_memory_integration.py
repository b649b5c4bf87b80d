"""What a run holds between steps, against Lightning's ``bf16-mixed``: the documented 16-bit copies and nothing more.
Counted from outside the package with ``benchmarks/memory_benchmark.py``'s count (``benchmarks/harness.py``): every
live tensor storage in the process, each once."""

import gc

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from benchmarks.harness import live_storages
from tests.conftest import trainer_kwargs

pytestmark = pytest.mark.slow


class LoRALinear(nn.Module):
    """A frozen FP32 Linear plus a trainable rank-``r`` update ``B @ A``, as peft's ``LoraLayer`` computes it."""

    def __init__(self, width: int, r: int):
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.lora_a = nn.Linear(width, r, bias=False)
        self.lora_b = nn.Linear(r, width, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoRA(L.LightningModule):
    def __init__(self, width=256, depth=4, r=8):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*(LoRALinear(width, r) for _ in range(depth)))
        self.held = []

    def training_step(self, batch, batch_idx):
        return self.layers(batch[0]).float().square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)  # no optimizer state


class BytesBetweenSteps(Callback):
    """Live bytes at the end of each step in storages made since the first one began (not the model and the data).
    Storages of earlier tests that go during the fit are not subtracted (a plain difference of totals once read
    -64 KB at step 0 of the bf16-mixed run, after the whole suite before it)."""

    def on_train_start(self, trainer, pl_module):
        gc.collect()
        self.start = set(live_storages())

    def on_train_batch_end(self, trainer, pl_module, *rest):
        gc.collect()
        pl_module.held.append(sum(n for ptr, n in live_storages().items() if ptr not in self.start))


def bytes_held(precision):
    model = LoRA()
    data = DataLoader(TensorDataset(torch.randn(24, 256, generator=torch.Generator().manual_seed(1))), batch_size=8)
    kwargs = dict(plugins=[precision]) if isinstance(precision, MixedPrecisionPlugin) else dict(precision=precision)
    L.Trainer(**trainer_kwargs(max_steps=3, callbacks=[BytesBetweenSteps()], **kwargs)).fit(model, data)
    return model


def test_lora_on_an_fp32_base_holds_bf16_mixeds_bytes_plus_the_copies_and_no_gradient_for_frozen_parameters():
    # frozen FP32 parameters get their 16-bit copy (2 B: the forward reads them as it reads trainable ones) and no
    # FP32 gradient buffer (it was 4 B each, zeros that frozen parameters never used)
    native, ours = bytes_held("bf16-mixed"), bytes_held(MixedPrecisionPlugin("bf16"))
    frozen = sum(p.numel() for p in ours.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    assert frozen > 10 * trainable
    copies = 2 * (frozen + trainable)
    for step, (theirs, mine) in enumerate(zip(native.held, ours.held)):
        assert abs(mine - (theirs + copies)) <= 0.5 * frozen, (step, (mine - theirs) / frozen)
