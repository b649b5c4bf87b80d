"""fp32_modules="auto" in real fits: against FP32 and plain fp16 on the same code, seeds, resume, TensorBoard, Fabric."""

import logging

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_mp import LossScaleMonitor, MixedPrecisionPlugin
from lightning_mp.demos import GPT, StdlibTextDataModule
from lightning_mp.fabric import MixedPrecisionPlugin as FabricPlugin
from tests.conftest import device

pytestmark = pytest.mark.on_device  # every test here is a Trainer or Fabric run


class Recorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


class Hot(L.LightningModule):
    """A Linear whose outputs sit near 1e5 (past fp16's 65504), followed by a LayerNorm."""

    def __init__(self, seed=0, factor=5e5):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1))
        with torch.no_grad():
            self.net[2].weight.mul_(factor)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.net(x).float() - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def hot_data(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 16, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1].sin()), batch_size=32)


def fit(model, plugin, data, steps=60, **kwargs):
    recorder = Recorder()
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = L.Trainer(
        max_steps=steps, plugins=[plugin] if plugin else None, accelerator=device(), devices=1,
        logger=kwargs.pop("logger", False),
        enable_checkpointing=kwargs.pop("enable_checkpointing", False), enable_model_summary=False,
        enable_progress_bar=False, callbacks=[recorder, *kwargs.pop("callbacks", [])], **kwargs,
    )  # fmt: skip
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return recorder.losses


def tail(losses, n=10):
    return sum(losses[-n:]) / n


@pytest.mark.parametrize("seed", [0, 1])
def test_the_overflowing_module_moves_to_fp32_where_plain_fp16_stops(seed, caplog):
    reference = tail(fit(Hot(seed), None, hot_data(seed)))
    with pytest.raises(FloatingPointError, match=r"forward overflow in `net.2` \(Linear\)"):
        fit(Hot(seed), MixedPrecisionPlugin("fp16"), hot_data(seed))
    plugin = MixedPrecisionPlugin("fp16", fp32_modules="auto")
    with caplog.at_level(logging.WARNING, logger="lightning_mp"):
        losses = fit(Hot(seed), plugin, hot_data(seed))
    assert plugin.auto_fp32_modules == ["net.2"]  # exactly that module, none other
    assert plugin.skipped_steps <= 2
    assert abs(tail(losses) - reference) <= 0.05 * reference
    decision = [r.getMessage() for r in caplog.records if "fp32_modules='auto'" in r.getMessage()]
    assert decision == [f"fp32_modules='auto': `net.2` to FP32 at step 0: {plugin.core.autopilot.decisions[0].evidence}"]
    assert "net.2" in plugin.describe()


def test_a_model_that_fits_fp16_moves_nothing_and_trains_bit_for_bit_as_plain_fp16():
    plain = fit(Hot(0, factor=1.0), MixedPrecisionPlugin("fp16"), hot_data(0), steps=20)
    plugin = MixedPrecisionPlugin("fp16", fp32_modules="auto")
    assert fit(Hot(0, factor=1.0), plugin, hot_data(0), steps=20) == plain
    assert plugin.auto_fp32_modules == []


def test_a_resumed_run_keeps_the_decisions_from_its_first_step(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = MixedPrecisionPlugin("fp16", fp32_modules="auto")
    fit(Hot(0), first, hot_data(0), steps=32, enable_checkpointing=True, callbacks=[ckpt])
    assert first.auto_fp32_modules == ["net.2"]
    last = str(tmp_path / "last.ckpt")
    # without calibration, only the restored decision keeps net.2 in FP32: no new skip, and the same decision listed
    resumed = MixedPrecisionPlugin("fp16", fp32_modules="auto", calibration_steps=0)
    rest = fit(Hot(0), resumed, hot_data(0), steps=48, enable_checkpointing=True, ckpt_path=last)
    assert resumed.auto_fp32_modules == ["net.2"] and resumed.skipped_steps == first.skipped_steps
    assert "decided by the run this checkpoint comes from" in resumed.describe()
    reference = fit(Hot(0), None, hot_data(0), steps=48, enable_checkpointing=True, ckpt_path=last)
    assert abs(tail(rest) - tail(reference)) <= 0.05 * tail(reference)  # resumed under FP32 from the same point
    # the same checkpoint resumed by plain fp16 overflows in net.2 again, and the plugin says what it dropped
    with pytest.raises(FloatingPointError, match=r"forward overflow in `net.2`"):
        fit(Hot(0), MixedPrecisionPlugin("fp16"), hot_data(0), steps=48, enable_checkpointing=True, ckpt_path=last)


def test_the_decisions_are_in_the_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="", version="")
    fit(Hot(0), MixedPrecisionPlugin("fp16", fp32_modules="auto"), hot_data(0), steps=10, logger=logger,
        callbacks=[LossScaleMonitor(logging_interval=1)])  # fmt: skip
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0, "scalars": 0}).Reload()
    assert [e.value for e in acc.Scalars("precision/auto_fp32_modules")][-1] == 1.0
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("precision/auto_fp32_decisions/text_summary")]
    assert len(texts) == 1 and texts[0].startswith("`net.2` to FP32 at step 0")


def test_fabric_moves_the_module_too():
    fabric = Fabric(accelerator=device(), devices=1, plugins=[FabricPlugin("fp16", fp32_modules="auto")])
    model = Hot(0)
    net, optimizer = fabric.setup(model.net, torch.optim.Adam(model.parameters(), lr=1e-3))
    for x, y in list(hot_data(0))[:8]:
        x, y = x.to(fabric.device), y.to(fabric.device)
        optimizer.zero_grad()
        fabric.backward((net(x).float() - y).pow(2).mean())
        optimizer.step()
    plugin = fabric.strategy.precision
    assert plugin.auto_fp32_modules == ["2"] and plugin.skipped_steps <= 2
    assert net(x).isfinite().all()


def _outlier_gpt(seed):
    """The demo GPT with an outlier feature: one MLP writes 7e4 into channel 0 of the residual stream, past fp16's
    65504 from the first forward (as large LLMs' massive activations do), so plain fp16 stops at step 0.

    Where the outlier sits is numerics, not taste: FP32 training must not be chaotic, or comparing fp16 with FP32
    measures luck. The outlier is the bias (7e4, a constant); the weight row that makes it vary by token is scaled
    by only 3e3 (norm ~460). With the outlier in the weights instead (row x3e5, norm 4.6e4, bias 3e4: the old test),
    a small change in block 0's MLP activations is multiplied into channel 0; FP32 itself, with every weight
    multiplied at init by (1 + 2^-11 N(0, 1)) (one fp16 ulp of noise), ended 5.5% off on 1 seed of 16, the rate
    at which fp16 did. With the row x3e4 and this bias, FP32 under that noise moved up to 1.7% and the fp16
    autopilot spiked to +35% on 1 run of 12. With the row x3e3, FP32 under that noise moves under 0.03% on
    seeds 0-5 (AVX512 and AVX2 kernels). The cost: channel 0 dominates the downstream LayerNorms, which squash
    every other feature by ~1e-4, so 300 steps learn the byte statistics (val loss ~3.16, from 5.5); what is
    measured is that fp16 with the autopilot gets there as FP32 does, where plain fp16 cannot start."""
    L.seed_everything(seed, verbose=False)
    model = GPT(n_layer=2, n_embd=64, n_head=4, block_size=64, lr=1e-3, warmup_steps=40)
    with torch.no_grad():
        out = model.blocks[0].mlp[2]
        out.weight[0].mul_(3e3)
        out.bias[0] = 7e4  # past 65504: inf once cast to fp16
    return model


def _val_loss(model, dm):
    dm.setup("validate")
    with torch.no_grad():
        batches = list(dm.val_dataloader())[:8]
        return sum(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in batches) / 8


@pytest.mark.slow  # 3 fits of 300 steps per seed
@pytest.mark.parametrize("seed", range(6))  # per seed: one seed measures luck, a mean hides a bad seed
def test_an_outlier_feature_in_the_demo_gpt_trains_in_fp16_within_2_percent_of_fp32(seed):
    data = lambda: StdlibTextDataModule(block_size=64, batch_size=8, max_bytes=256 * 1024, seed=seed)  # noqa: E731
    model, dm = _outlier_gpt(seed), data()
    fit(model, None, dm, steps=300, limit_val_batches=0)
    reference = _val_loss(model, dm)
    with pytest.raises(FloatingPointError, match=r"forward overflow in `blocks.0.mlp.2`"):
        fit(_outlier_gpt(seed), MixedPrecisionPlugin("fp16"), data(), steps=300, limit_val_batches=0)
    model, dm, plugin = _outlier_gpt(seed), data(), MixedPrecisionPlugin("fp16", fp32_modules="auto")
    fit(model, plugin, dm, steps=300, limit_val_batches=0)
    assert plugin.auto_fp32_modules == ["blocks.0.mlp.2"]
    ours = _val_loss(model, dm)
    assert abs(ours - reference) <= 0.02 * reference, (ours, reference)
