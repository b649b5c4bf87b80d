"""Every argument of every public class, with wrong types and values: each error names the argument."""

import math

import pytest
import torch
from torch import nn

from lightning_mp import (
    Fp32Policy,
    GradientRangeMonitor,
    LossScaleMonitor,
    LossScaler,
    MixedPrecisionPlugin,
    resolve_precision,
)
from lightning_mp.demos import GPT, StdlibTextDataModule

CASES = [
    # (callable, kwargs, argument name that the message must contain)
    (MixedPrecisionPlugin, {"precision": "fp4"}, "precision"),
    (MixedPrecisionPlugin, {"precision": 16.5}, "precision"),
    (MixedPrecisionPlugin, {"precision": True}, "precision"),
    (MixedPrecisionPlugin, {"master_weights": "yes"}, "master_weights"),
    (MixedPrecisionPlugin, {"master_weights": 1}, "master_weights"),
    (MixedPrecisionPlugin, {"loss_scale": "static"}, "loss_scale"),
    (MixedPrecisionPlugin, {"loss_scale": 0}, "loss_scale"),
    (MixedPrecisionPlugin, {"loss_scale": math.nan}, "loss_scale"),
    (MixedPrecisionPlugin, {"loss_scale": [2.0]}, "loss_scale"),
    (MixedPrecisionPlugin, {"init_scale": "big"}, "init_scale"),
    (MixedPrecisionPlugin, {"init_scale": -2.0}, "init_scale"),
    (MixedPrecisionPlugin, {"growth_factor": 1}, "growth_factor"),
    (MixedPrecisionPlugin, {"growth_factor": None}, "growth_factor"),
    (MixedPrecisionPlugin, {"backoff_factor": 0}, "backoff_factor"),
    (MixedPrecisionPlugin, {"backoff_factor": 1.5}, "backoff_factor"),
    (MixedPrecisionPlugin, {"growth_interval": 0}, "growth_interval"),
    (MixedPrecisionPlugin, {"growth_interval": "10"}, "growth_interval"),
    (MixedPrecisionPlugin, {"hysteresis": 0}, "hysteresis"),
    (MixedPrecisionPlugin, {"hysteresis": 1.5}, "hysteresis"),
    (MixedPrecisionPlugin, {"min_scale": 0.0}, "min_scale"),
    (MixedPrecisionPlugin, {"min_scale": 8.0, "max_scale": 4.0}, "min_scale"),
    (MixedPrecisionPlugin, {"max_scale": -1.0}, "max_scale"),
    (MixedPrecisionPlugin, {"max_scale": math.inf}, "max_scale"),
    (MixedPrecisionPlugin, {"precision": "fp16", "init_scale": 2.0**30}, "init_scale"),  # above max_scale 2^24
    (MixedPrecisionPlugin, {"max_consecutive_skips": 0}, "max_consecutive_skips"),
    (MixedPrecisionPlugin, {"max_consecutive_skips": 2.0}, "max_consecutive_skips"),
    (MixedPrecisionPlugin, {"fp32_ops": "softmax"}, "fp32_ops"),
    (MixedPrecisionPlugin, {"fp32_ops": {"no_such_op"}}, "fp32_ops"),
    (MixedPrecisionPlugin, {"fp32_ops": {42}}, "fp32_ops"),
    (MixedPrecisionPlugin, {"fp32_ops": 3}, "fp32_ops"),
    (MixedPrecisionPlugin, {"fp32_modules": nn.LayerNorm}, "fp32_modules"),
    (MixedPrecisionPlugin, {"fp32_modules": (int,)}, "fp32_modules"),
    (MixedPrecisionPlugin, {"fp32_modules": ("LayerNorm",)}, "fp32_modules"),
    (MixedPrecisionPlugin, {"skip_scheduler_on_overflow": "no"}, "skip_scheduler_on_overflow"),
    (LossScaler, {"mode": "auto"}, "loss_scale"),
    (LossScaler, {"mode": -1}, "loss_scale"),
    (LossScaler, {"growth_interval": -5}, "growth_interval"),
    (Fp32Policy, {"ops": "exp"}, "fp32_ops"),
    (Fp32Policy, {"ops": {"exp", "nope"}}, "fp32_ops"),
    (Fp32Policy, {"modules": [nn.Linear, "x"]}, "fp32_modules"),
    (LossScaleMonitor, {"logging_interval": 0}, "logging_interval"),
    (LossScaleMonitor, {"logging_interval": 2.5}, "logging_interval"),
    (LossScaleMonitor, {"logging_interval": True}, "logging_interval"),
    (GradientRangeMonitor, {"every_n_steps": 0}, "every_n_steps"),
    (GradientRangeMonitor, {"every_n_steps": "5"}, "every_n_steps"),
    (GradientRangeMonitor, {"per_param": "yes"}, "per_param"),
    (resolve_precision, {"precision": "float8"}, "precision"),
    (StdlibTextDataModule, {"block_size": 0}, "block_size"),
    (StdlibTextDataModule, {"batch_size": -1}, "batch_size"),
    (StdlibTextDataModule, {"val_fraction": 1.5}, "val_fraction"),
    (StdlibTextDataModule, {"max_bytes": "lots"}, "max_bytes"),
    (StdlibTextDataModule, {"num_workers": -1}, "num_workers"),
]


def _id(case):
    fn, kwargs, _ = case
    return f"{fn.__name__}-{'-'.join(f'{k}={v!r}' for k, v in kwargs.items())}"


@pytest.mark.parametrize("fn, kwargs, name", CASES, ids=[_id(c) for c in CASES])
def test_bad_argument_raises_naming_the_argument_and_value(fn, kwargs, name):
    with pytest.raises((ValueError, TypeError)) as info:
        fn(**kwargs)
    message = str(info.value)
    assert name in message
    bad = next(iter(kwargs.values())) if len(kwargs) == 1 else None
    if isinstance(bad, (int, float, str)) and not isinstance(bad, bool):
        assert repr(bad) in message or str(bad) in message


def test_gpt_rejects_heads_that_do_not_divide_the_width():
    with pytest.raises(ValueError, match="n_head"):
        GPT(n_embd=30, n_head=4)


def test_error_for_non_finite_steps_names_step_scale_and_hint():
    scaler = LossScaler(init_scale=2.0, min_scale=2.0)
    with pytest.raises(FloatingPointError) as info:
        scaler.update(True, step=123)
    assert "step 123" in str(info.value) and "loss scale 2" in str(info.value) and "HINT" in str(info.value)


def test_state_from_another_plugin_is_refused_clearly():
    plugin = MixedPrecisionPlugin("fp16")
    with pytest.raises(KeyError, match="scaler"):
        plugin.load_state_dict({"scale": 4.0})
    with pytest.raises(ValueError, match="saved loss scale"):
        plugin.core.scaler.load_state_dict(
            {"mode": "dynamic", "scale": -1.0, "growth_tracker": 0, "hysteresis_tracker": 1, "skipped_steps": 0}
        )


def test_bf16_on_cuda_without_bf16_support_would_fail_clearly(monkeypatch):
    from lightning_mp.formats import check_device_supports as _check_device_supports

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "an old GPU")
    with pytest.raises(RuntimeError, match=r"an old GPU has no bfloat16.*precision='fp16'"):
        _check_device_supports(resolve_precision("bf16"), "cuda")


@pytest.mark.parametrize(
    "spelling, hint",
    [("bf16-true", "write 'bf16'"), ("16-true", "write 'fp16'"), ("bfloat16", "write 'bf16'"),
     ("transformer-engine", "TransformerEnginePrecision"), ("64", "float64 parameters train as they are")],
)  # fmt: skip
def test_precision_spellings_from_lightning_and_torch_get_what_to_write_instead(spelling, hint):
    with pytest.raises(ValueError, match=rf"precision='{spelling}' is not supported.*HINT:.*{hint}"):
        MixedPrecisionPlugin(spelling)


def test_both_precision_and_the_plugin_name_the_plugin_in_lightnings_error():
    import lightning as L

    with pytest.raises(ValueError, match=r"Received both `precision=bf16-mixed` and `plugins=MixedPrecisionPlugin\('bf16'\)`"):
        L.Trainer(precision="bf16-mixed", plugins=[MixedPrecisionPlugin("bf16")], accelerator="cpu")


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
@pytest.mark.parametrize(
    "kwargs, hint",
    [({"device": "cuda"}, r"device='cuda' is not an argument .*HINT: the device is the Trainer's or Fabric's"),
     ({"scaler": None}, r"scaler=None is not an argument .*HINT: .*set loss_scale=.*init_scale=")],
)  # fmt: skip
def test_lightnings_mixed_precision_arguments_get_what_to_write_instead(front_end, kwargs, hint):
    # a user porting MixedPrecision("16-mixed", device="cuda", scaler=GradScaler()) gets told what each becomes
    from lightning_mp.fabric import MixedPrecisionPlugin as FabricMixedPrecisionPlugin

    cls = MixedPrecisionPlugin if front_end == "trainer" else FabricMixedPrecisionPlugin
    with pytest.raises(ValueError, match=hint):
        cls("fp16", **kwargs)
