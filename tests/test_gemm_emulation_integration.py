"""Trainer-level runs with emulated 16-bit GEMMs: 16-bit activations and gradients, FP32 kernels in forward and
backward, the run trains, the setup line, the warning, and emulated against native numerics."""

from __future__ import annotations

import logging
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp.gemm.ops as go
import lightning_mp.gemm.support as gs
from lightning_mp import MixedPrecisionPlugin
from lightning_mp.gemm.ops import FAMILIES
from tests.conftest import cuda, trainer_kwargs


pytestmark = pytest.mark.usefixtures("fresh_gemm_detection")


@pytest.fixture
def emulated_calls(monkeypatch):
    """Names of the aten ops the emulation computed in FP32, in order."""
    calls: list[str] = []
    real = go._emulate

    def spy(func, *rest, **below):
        calls.append(func.overloadpacket.__name__)
        return real(func, *rest, **below)

    monkeypatch.setattr(go, "_emulate", spy)
    return calls


@pytest.fixture
def info_lines():
    """Lightning's own console lines (its logger does not propagate to pytest's caplog)."""
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


class ConvAttention(L.LightningModule):
    """Conv1d -> self-attention (fused SDPA) -> Linear: a convnet's and a transformer's GEMMs in one small model.
    Records the dtypes of its activations in the forward and of their gradients in the backward."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 16, 3, padding=1)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 1)
        self.activation_dtypes: set[torch.dtype] = set()
        self.gradient_dtypes: set[torch.dtype] = set()
        self.losses: list[float] = []

    def _watch(self, t):
        self.activation_dtypes.add(t.dtype)
        if t.requires_grad:
            t.register_hook(lambda g: self.gradient_dtypes.add(g.dtype))
        return t

    def forward(self, x):  # x: (B, 4, T)
        h = self._watch(self.conv(x)).transpose(1, 2)  # (B, T, 16)
        B, T, _ = h.shape
        q, k, v = (t.view(B, T, 2, 8).transpose(1, 2) for t in self._watch(self.qkv(h)).chunk(3, dim=-1))
        a = self._watch(F.scaled_dot_product_attention(q, k, v, is_causal=True))  # 4-D: the fused kernel
        return self._watch(self.head(a.transpose(1, 2).reshape(B, T, 16))).mean(dim=1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def data(n=64, batch_size=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, 12, generator=g)
    y = x[:, :2].mean(dim=(1, 2)).unsqueeze(1) * 2.0
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def fit(plugin, epochs=6):
    L.seed_everything(0, verbose=False)
    model = ConvAttention()
    trainer = L.Trainer(**trainer_kwargs(max_epochs=epochs, plugins=[plugin]))
    trainer.fit(model, data())
    return model


@pytest.mark.parametrize("precision, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_emulated_run_keeps_16_bit_activations_and_gradients_and_trains(emulated_calls, precision, dtype):
    model = fit(MixedPrecisionPlugin(precision, gemm="emulated"))
    assert model.activation_dtypes == {dtype} and model.gradient_dtypes == {dtype}
    # every GEMM kind ran in FP32, in the forward and in the backward
    for name in ("convolution", "addmm", "_scaled_dot_product_flash_attention_for_cpu",
                 "convolution_backward", "mm", "_scaled_dot_product_flash_attention_for_cpu_backward"):
        assert name in emulated_calls
    first, last = sum(model.losses[:4]) / 4, sum(model.losses[-4:]) / 4
    assert last < 0.7 * first
    assert all(p.dtype == torch.float32 for p in model.parameters())  # FP32 values after the run, as always


class ConvAttentionWithEval(ConvAttention):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self(batch[0]).float(), batch[1]))


def test_validate_under_inference_mode_still_emulates_every_gemm(emulated_calls):
    """Lightning validates under torch.inference_mode, where conv2d and linear reach the mode whole: they are
    decomposed there, so validation runs the same FP32 GEMMs as training (not torch's slow 16-bit fallback)."""
    model = ConvAttentionWithEval()
    trainer = L.Trainer(**trainer_kwargs(plugins=[MixedPrecisionPlugin("fp16", gemm="emulated")]))
    loss = trainer.validate(model, data(), verbose=False)[0]["val_loss"]
    assert {"convolution", "addmm", "_scaled_dot_product_flash_attention_for_cpu"} <= set(emulated_calls)
    assert torch.isfinite(torch.tensor(loss)) and model.activation_dtypes == {torch.float16}


def test_native_run_enters_no_emulation(emulated_calls):
    fit(MixedPrecisionPlugin("bf16", gemm="native"), epochs=1)
    assert emulated_calls == []


def test_auto_emulates_where_the_format_is_slow_and_says_so_at_setup(monkeypatch, emulated_calls, info_lines):
    monkeypatch.setattr(gs, "_torch_reports_native", lambda dtype: dtype == torch.bfloat16)
    monkeypatch.setattr(gs, "_probe", lambda dtype: dict.fromkeys(FAMILIES, 1.0 if dtype == torch.bfloat16 else 25.0))
    fp16 = MixedPrecisionPlugin("fp16")
    fit(fp16, epochs=1)
    assert fp16.gemm.emulated and emulated_calls
    assert [line for line in info_lines if line.startswith("16-bit GEMMs: emulated") and "25.0x" in line]
    assert "16-bit GEMMs: emulated" in fp16.describe()

    emulated_calls.clear()
    bf16 = MixedPrecisionPlugin("bf16")
    fit(bf16, epochs=1)
    assert not bf16.gemm.emulated and emulated_calls == []
    assert [line for line in info_lines if line.startswith("16-bit GEMMs: native bf16 kernels")]


def test_fp16_on_a_xeon_with_avx512_fp16_emulates_only_the_convolution_weight_gradient(monkeypatch, emulated_calls,
                                                                                       info_lines):
    """The probe's figures of an Intel Xeon with AVX512-FP16 (oneDNN runs the fp16 weight gradient in its reference
    kernel, 30-80x FP32): a fit emulates that gradient alone, says so in its one line, and trains in fp16."""
    figures = {"matmul": 1.2, "conv forward": 1.6, "conv input grad": 1.5, "conv weight grad": 31.0}
    monkeypatch.setattr(gs, "_torch_reports_native", lambda dtype: True)
    monkeypatch.setattr(gs, "_probe", lambda dtype: dict(figures))
    plugin = MixedPrecisionPlugin("fp16")
    model = fit(plugin, epochs=2)
    assert set(emulated_calls) == {"convolution_backward"}  # only the weight gradient's half of it
    assert model.activation_dtypes == {torch.float16} and model.gradient_dtypes == {torch.float16}
    line = ("16-bit GEMMs: native fp16 kernels for matmul, conv forward, conv input grad; emulated (FP32 GEMMs on fp16 "
            "operands, results rounded to fp16) for conv weight grad; gemm='auto': ")
    assert [x for x in info_lines if x.startswith(line) and "conv weight grad 31.0x" in x]
    assert line in plugin.describe()


def test_slow_native_kernels_warn_once_at_setup(monkeypatch):
    monkeypatch.setattr(gs, "_torch_reports_native", lambda dtype: False)
    monkeypatch.setattr(gs, "_probe", lambda dtype: dict.fromkeys(FAMILIES, 25.0))
    with pytest.warns(UserWarning, match=r"25x the FP32 time.*HINT: gemm='auto'"):
        fit(MixedPrecisionPlugin("bf16", gemm="native"), epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*(does not have many workers|GPU available|LeafSpec).*")
        fit(MixedPrecisionPlugin("bf16", gemm="native"), epochs=1)


def test_bad_gemm_value_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"gemm='fast' is not allowed\. Allowed: 'auto', 'native', 'emulated'"):
        MixedPrecisionPlugin("fp16", gemm="fast")


def test_fp32_runs_ignore_the_knob(emulated_calls):
    plugin = MixedPrecisionPlugin("fp32", gemm="emulated")
    fit(plugin, epochs=1)
    assert emulated_calls == [] and "16-bit GEMMs" not in plugin.describe()


def test_emulated_and_native_bf16_train_to_the_same_loss():
    """bf16 has a native kernel on this CPU (and a slow fallback elsewhere): both paths, same run, same numerics."""
    native = fit(MixedPrecisionPlugin("bf16", gemm="native"))
    emulated = fit(MixedPrecisionPlugin("bf16", gemm="emulated"))
    assert emulated.losses[0] == pytest.approx(native.losses[0], rel=1e-2)
    assert emulated.losses[-1] == pytest.approx(native.losses[-1], rel=0.05)


@cuda
@pytest.mark.cuda
def test_cuda_runs_native_under_auto(emulated_calls):
    L.seed_everything(0, verbose=False)
    plugin = MixedPrecisionPlugin("bf16")
    trainer = L.Trainer(**trainer_kwargs(accelerator="cuda", max_steps=2, plugins=[plugin]))
    trainer.fit(ConvAttention(), data())
    assert not plugin.gemm.emulated and emulated_calls == []


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_ddp_ranks_with_different_probe_figures_emulate_the_same_families(tmp_path):
    """Two gloo ranks whose probes land on either side of the line for the conv forward (1.9x and 2.1x) both emulate
    it, with the same verdict line, and end with the same weights."""
    import os

    from benchmarks.harness import launch_ranks

    worker = os.path.join(os.path.dirname(__file__), "gemm_worker.py")
    r0, r1 = launch_ranks(worker, tmp_path, "--figures", "1.2,1.9,1.5,31", "1.3,2.1,1.4,29")
    assert r0["families"] == r1["families"] == ["conv forward", "conv weight grad"]
    assert r0["line"] == r1["line"] and "conv forward 2.1x" in r0["line"] and "matmul 1.3x" in r0["line"]
    for k in r0["state"]:
        assert torch.equal(r0["state"][k], r1["state"][k]), k
