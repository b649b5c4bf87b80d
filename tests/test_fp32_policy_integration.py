"""The FP32 policy inside real Trainer steps: which ops compute in FP32, custom lists, Lightning's demo models."""

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.demos.lstm import LightningLSTM
from lightning.pytorch.demos.transformer import LightningTransformer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_mp import DEFAULT_FP32_OPS, MixedPrecisionPlugin
from lightning_mp.demos import StdlibTextDataModule
from tests.conftest import cpu_only, device, regression_data, trainer_kwargs

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}

pytestmark = pytest.mark.on_device  # every test here is a Trainer run


class Probe(L.LightningModule):
    """Records the dtype each op returns inside training and validation steps."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.dtypes = {}

    def _probe(self, stage, x):
        h = self.lin(x)
        target = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
        self.dtypes[stage] = {
            "linear": h.dtype,
            "softmax": F.softmax(h, dim=-1).dtype,
            "tensor.softmax": h.softmax(-1).dtype,
            "log_softmax": F.log_softmax(h, dim=-1).dtype,
            "layer_norm": F.layer_norm(h, (16,)).dtype,
            "cross_entropy": F.cross_entropy(h, target).dtype,
            "sum": h.sum().dtype,
            "tanh": torch.tanh(h).dtype,
        }
        return F.cross_entropy(h, target)

    def training_step(self, batch, batch_idx):
        return self._probe("train", batch[0])

    def validation_step(self, batch, batch_idx):
        self._probe("val", batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def run_probe(plugin):
    model = Probe()
    trainer = L.Trainer(plugins=[plugin], max_steps=1, limit_val_batches=1, **trainer_kwargs())
    trainer.fit(model, regression_data())
    trainer.validate(model, regression_data(), verbose=False)
    return model.dtypes


@pytest.mark.parametrize("master_weights", [True, False])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_sensitive_ops_return_fp32_inside_steps_and_nothing_leaks_outside(precision, master_weights):
    dtypes = run_probe(MixedPrecisionPlugin(precision, master_weights=master_weights, init_scale=2.0**8))
    half = HALF[precision]
    for stage in ("train", "val"):
        d = dtypes[stage]
        assert d["linear"] == half and d["tanh"] == half
        for op in ("softmax", "tensor.softmax", "log_softmax", "layer_norm", "cross_entropy", "sum"):
            assert d[op] == torch.float32, (stage, op)
    x = torch.randn(4, 4, dtype=half, device=device())
    assert F.softmax(x, dim=-1).dtype == half and x.sum().dtype == half  # outside the steps: untouched


def test_removing_softmax_makes_it_16_bit_and_adding_a_callable_makes_it_fp32():
    # on CUDA too, where autocast's own list runs softmax in FP32: an op left out of the policy is 16-bit everywhere
    dtypes = run_probe(MixedPrecisionPlugin("bf16", fp32_ops=(DEFAULT_FP32_OPS - {"softmax"}) | {torch.tanh}))
    d = dtypes["train"]
    assert d["softmax"] == d["tensor.softmax"] == torch.bfloat16
    assert d["tanh"] == torch.float32
    assert d["log_softmax"] == torch.float32  # the rest of the default list stays


def test_fp32_precision_changes_nothing():
    d = run_probe(MixedPrecisionPlugin("fp32"))["train"]
    assert set(d.values()) == {torch.float32}


# ---------------------------------------------------------------------------------------------- Lightning's demos
class LocalText(Dataset):
    """WikiText2's (inputs, target) windows, over stdlib source bytes instead of a download."""

    def __init__(self, block_size=35, max_bytes=20_000):
        dm = StdlibTextDataModule(block_size=block_size, max_bytes=max_bytes)
        dm.setup("fit")
        self.data, self.block_size = dm.train_data.long(), block_size

    def __len__(self):
        return len(self.data) // self.block_size - 1

    def __getitem__(self, i):
        s = i * self.block_size
        return self.data[s : s + self.block_size], self.data[s + 1 : s + self.block_size + 1]


class LocalTransformer(LightningTransformer):
    def prepare_data(self):
        pass  # no download

    def train_dataloader(self):
        return DataLoader(LocalText(), batch_size=8)


class LocalLSTM(LightningLSTM):
    def __init__(self):
        super().__init__(vocab_size=256)
        self.model = type(self.model)(vocab_size=256, ninp=64, nhid=64, nlayers=2)

    def prepare_data(self):
        pass

    def train_dataloader(self):
        return DataLoader(LocalText(), batch_size=8, drop_last=True)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("demo", [LocalTransformer, LocalLSTM])
def test_lightnings_demo_models_train_in_16_bits_on_the_cpu(demo, precision):  # and on the GPU (--device cuda)
    L.seed_everything(0)
    model = demo() if demo is LocalLSTM else demo(vocab_size=256)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    plugin = MixedPrecisionPlugin(precision)
    trainer = L.Trainer(plugins=[plugin], max_steps=6, callbacks=[Record()], **trainer_kwargs())
    trainer.fit(model)
    applied = [loss for loss in losses if torch.isfinite(torch.tensor(loss))]
    assert len(losses) == 6 and applied
    assert plugin.skipped_steps < 6  # it trained, not only skipped


@cpu_only("the crash is oneDNN's fp16 LSTM on a CPU; on CUDA cuDNN runs Lightning's 16-mixed LSTM")
def test_lstm_that_crashes_lightnings_16_mixed_on_this_cpu_trains_with_the_plugin():
    class EmbedNormLSTM(LocalLSTM):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(64)

        def training_step(self, batch, batch_idx):
            x, y = batch
            emb = self.norm(self.model.encoder(x))
            out, _ = self.model.rnn(emb)
            return F.cross_entropy(self.model.decoder(out).reshape(-1, 256), y.reshape(-1))

    try:
        L.Trainer(plugins=[MixedPrecision("16-mixed", "cpu")], max_steps=1, **trainer_kwargs()).fit(EmbedNormLSTM())
        native_crashed = False
    except RuntimeError:
        native_crashed = True
    plugin = MixedPrecisionPlugin("fp16")
    L.Trainer(plugins=[plugin], max_steps=3, **trainer_kwargs()).fit(EmbedNormLSTM())
    assert plugin.optimizer_steps == 3
    if not native_crashed:  # oneDNN builds differ; ours must train either way
        pytest.skip("this CPU's oneDNN has an FP16 LSTM: Lightning's 16-mixed did not crash here")


class BatchNormRegressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.net(batch[0]).float(), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit_batch_norm(plugin):
    torch.manual_seed(0)
    model = BatchNormRegressor()
    L.Trainer(plugins=plugin, max_epochs=3, **trainer_kwargs()).fit(model, regression_data())
    return model


@pytest.mark.parametrize("master_weights", [True, "compensated"])
def test_batch_norm_left_16_bit_by_both_lists_is_refused_at_setup_with_the_two_fixes(master_weights):
    """16-bit BatchNorm weights beside FP32 running statistics crash inside torch's batch_norm on the first forward;
    the plugin says so before training, and either documented fix trains as FP32 does."""
    with pytest.raises(ValueError, match=r"BatchNorm1d 'net.1' would run with 16-bit weights and FP32 running "
                                         r"statistics.*HINT: keep 'batch_norm' in fp32_ops"):
        _fit_batch_norm(MixedPrecisionPlugin("bf16", master_weights=master_weights, fp32_ops=(), fp32_modules=()))
    reference = _fit_batch_norm([])  # FP32
    for fixed in (dict(fp32_ops=("batch_norm",), fp32_modules=()), dict(fp32_ops=())):
        losses = _fit_batch_norm(MixedPrecisionPlugin("bf16", master_weights=master_weights, **fixed)).losses
        assert losses[-1] < 0.5 * losses[0]
        # the same training as FP32, to bf16's rounding of the activations and weights
        assert abs(losses[-1] - reference.losses[-1]) <= 0.1 * reference.losses[-1] + 2**-8
