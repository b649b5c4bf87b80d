"""Trainer-level tests of MixedPrecisionPlugin: master weights, loss scaling, clipping, checkpoints, resume."""

import copy
import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import HalfPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from tests.conftest import TinyRegressor, TwoOptimizers, inside_forward, regression_data, trainer_kwargs

FP16_SAFE = dict(init_scale=2.0**8)  # a start scale at which the tiny regressor does not overflow


def fit(model, plugin=None, data=None, **kwargs):
    plugins = [plugin] if plugin is not None else []
    trainer = L.Trainer(plugins=plugins, **trainer_kwargs(**kwargs))
    trainer.fit(model, data if data is not None else regression_data())
    return trainer


def master_values(trainer):
    return {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}


# ---------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "alias, name", [("16", "fp16"), ("16-mixed", "fp16"), ("bf16-mixed", "bf16"), ("32", "fp32"), ("32-true", "fp32")]
)
def test_aliases_resolve_to_one_format(alias, name):
    assert MixedPrecisionPlugin(alias).format.name == name


@pytest.mark.parametrize("bad", ["fp4", "64", "half", None, 16.0])
def test_unknown_precision_lists_the_valid_names(bad):
    with pytest.raises(ValueError, match=r"precision=.*'fp16'.*'bf16'.*'fp8'"):
        MixedPrecisionPlugin(bad)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"backoff_factor": 2.0}, "backoff_factor"),
        ({"init_scale": 0}, "init_scale"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"min_scale": 4.0, "max_scale": 2.0}, "min_scale"),
        ({"loss_scale": "static"}, "loss_scale"),
        ({"master_weights": "yes"}, "master_weights"),
    ],
)
def test_invalid_plugin_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        MixedPrecisionPlugin("fp16", **kwargs)


def test_defaults_per_format():
    assert MixedPrecisionPlugin("fp16").core.scaler.dynamic
    assert MixedPrecisionPlugin("fp16").loss_scale == 2.0**16
    assert MixedPrecisionPlugin("bf16").loss_scale == 1.0 and MixedPrecisionPlugin("bf16").scaler is None
    assert MixedPrecisionPlugin("bf16").master_weights and not MixedPrecisionPlugin("fp32").master_weights


# ---------------------------------------------------------------------------------------------- master weights
class Inspect(Callback):
    def __init__(self):
        self.param_dtypes, self.optim_dtypes, self.between_dtypes = set(), set(), set()
        self.forward_dtypes = set()

    def on_train_start(self, trainer, pl_module):
        def seen_by_forward(module, args, output):  # runs inside the module's forward, where the copies are
            self.forward_dtypes |= {module.weight.dtype, output.dtype}

        inside_forward(pl_module.net[0], seen_by_forward)

    def on_before_backward(self, trainer, pl_module, loss):  # after the forward, before the backward
        self.param_dtypes |= {p.dtype for p in pl_module.parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.optim_dtypes |= {p.dtype for g in optimizer.param_groups for p in g["params"]}
        self.optim_dtypes |= {p.grad.dtype for g in optimizer.param_groups for p in g["params"]}

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.between_dtypes |= {p.dtype for p in pl_module.parameters()}


@pytest.mark.on_device
@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_forward_and_backward_run_in_16_bits_while_parameters_and_optimizer_hold_fp32(precision, dtype):
    model, spy = TinyRegressor(), Inspect()
    fit(model, MixedPrecisionPlugin(precision, **FP16_SAFE), max_steps=3, callbacks=[spy])
    assert spy.forward_dtypes == {dtype}  # the module's forward reads its 16-bit copy
    assert spy.param_dtypes == {torch.float32}  # everything outside the forward sees the FP32 masters
    assert spy.optim_dtypes == {torch.float32}  # parameters and gradients the optimizer reads
    assert spy.between_dtypes == {torch.float32}  # what callbacks see between steps: the masters
    assert {p.dtype for p in model.parameters()} == {torch.float32}


class Summaries(Callback):
    """What a user's code sees of the model's classes during the fit: Lightning's model summary and the layers."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        from lightning.pytorch.utilities.model_summary import ModelSummary

        self.types = ModelSummary(pl_module, max_depth=-1).layer_types
        self.first = pl_module.net[0]


@pytest.mark.on_device
def test_the_model_keeps_its_class_names_and_gets_its_own_classes_back_after_fit():
    # the modules that own parameters are bracketed by a subclass of their class during the fit (bracket.py)
    ours, native = Summaries(), Summaries()
    model = TinyRegressor(norm=True)
    fit(model, MixedPrecisionPlugin("bf16"), max_steps=2, callbacks=[ours])
    fit(TinyRegressor(norm=True), None, max_steps=2, callbacks=[native], precision="bf16-mixed")
    assert ours.types == native.types == ["Sequential", "Linear", "ReLU", "LayerNorm", "Linear"]
    assert isinstance(ours.first, nn.Linear) and type(ours.first).__name__ == "Linear"
    assert [type(m) for m in model.net] == [nn.Linear, nn.ReLU, nn.LayerNorm, nn.Linear]  # after the fit
    assert type(model) is TinyRegressor


class SampleAtEpochEnd(Callback):
    """A callback that runs the model on FP32 inputs at each epoch's end, outside the step's autocast."""

    def on_train_epoch_end(self, trainer, pl_module):
        self.out = pl_module(torch.ones(2, 8, device=pl_module.device))


@pytest.mark.on_device
def test_a_callback_calling_the_model_at_an_epochs_end_gets_what_bf16_mixed_gives():
    ours, native = SampleAtEpochEnd(), SampleAtEpochEnd()
    torch.manual_seed(0)
    fit(TinyRegressor(), MixedPrecisionPlugin("bf16"), max_epochs=1, callbacks=[ours])
    torch.manual_seed(0)
    fit(TinyRegressor(), None, max_epochs=1, callbacks=[native], precision="bf16-mixed")
    assert ours.out.dtype == native.out.dtype == torch.float32  # FP32 Parameters, no dtype mismatch
    torch.testing.assert_close(ours.out, native.out, rtol=2**-6, atol=2**-6)  # a bf16 run's weights apart


@pytest.mark.on_device
def test_frozen_and_unoptimized_params_are_never_rounded():
    class Partly(TinyRegressor):
        def __init__(self):
            super().__init__()
            self.extra = nn.Parameter(torch.full((3,), 1.0 + 2**-12))  # not in the optimizer
            self.net[0].bias.requires_grad_(False)

        def training_step(self, batch, batch_idx):
            seen.add(self.extra.dtype)
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            return torch.optim.SGD([p for n, p in self.net.named_parameters() if p.requires_grad], lr=0.1)

    seen = set()
    model = Partly()
    frozen_before = model.net[0].bias.detach().clone()
    fit(model, MixedPrecisionPlugin("bf16"), max_steps=2)
    assert seen == {torch.float32}  # training_step is not a forward: the Parameter itself (autocast casts per op)
    assert torch.equal(model.net[0].bias, frozen_before)  # ...and keeps its exact FP32 value, not the rounding
    assert torch.equal(model.extra, torch.full((3,), 1.0 + 2**-12))


class OneWeight(L.LightningModule):
    """loss = w * c, so every step's gradient is exactly ``c`` and SGD moves w by lr * c."""

    def __init__(self, c=1.0, lr=1e-4, w0=1.0):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w0]))
        self.c, self.lr = c, lr

    def training_step(self, batch, batch_idx):
        return (self.w * self.c).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def ones(n):
    return DataLoader(TensorDataset(torch.zeros(n, 1)), batch_size=1)


@pytest.mark.on_device
def test_update_far_below_a_bf16_ulp_is_kept_by_master_weights_and_lost_in_pure_bf16(tmp_path):
    steps = 10
    reference = torch.tensor([1.0])
    for _ in range(steps):
        reference -= 1e-4  # FP32 SGD, the same arithmetic the optimizer does on the master

    model = OneWeight()
    trainer = fit(model, MixedPrecisionPlugin("bf16"), data=ones(steps), max_steps=steps)
    trainer.save_checkpoint(tmp_path / "mp.ckpt")
    saved = torch.load(tmp_path / "mp.ckpt", weights_only=False)["state_dict"]["w"]
    assert saved.dtype == torch.float32
    assert torch.equal(saved, reference)  # moved by exactly the sum of the updates
    assert torch.equal(model.w.detach(), reference)

    # Lightning's bf16-true: 1.0 - 1e-4 rounds back to 1.0 in bf16 (half-ulp at 1.0 is 2^-8), every step
    native = OneWeight()
    fit(native, HalfPrecision("bf16-true"), data=ones(steps), max_steps=steps)
    assert native.w.item() == 1.0


@pytest.mark.on_device
def test_gradient_accumulation_sums_micro_batches_in_fp32():
    class TwoMicro(OneWeight):
        def training_step(self, batch, batch_idx):
            c = 1.0 if batch_idx % 2 == 0 else 2.0**-9  # 1 + 2^-9 is not representable in bf16
            return (self.w * c).sum()

    model = TwoMicro(lr=1.0, w0=0.0)
    fit(model, MixedPrecisionPlugin("bf16"), data=ones(2), max_steps=1, accumulate_grad_batches=2)
    assert model.w.item() == -(1.0 + 2.0**-9) / 2  # Lightning averages the micro-batch losses

    native = TwoMicro(lr=1.0, w0=0.0)
    fit(native, HalfPrecision("bf16-true"), data=ones(2), max_steps=1, accumulate_grad_batches=2)
    assert native.w.float().item() == -0.5  # the small micro-batch vanished in the bf16 sum


# ---------------------------------------------------------------------------------------------- loss scaling
class TinyGrad(L.LightningModule):
    """A gradient of 1e-8 for ``w``: below FP16's smallest subnormal (2^-24 ~ 6e-8)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.grads = []

    def forward(self, x):
        return self.w * x  # inside the forward, self.w is the FP16 copy: the product and its gradient are FP16

    def training_step(self, batch, batch_idx):
        x = torch.full((4,), 1e-4, dtype=torch.float16, device=self.device)  # normal in fp16 (2^-14 ~ 6.1e-5)
        # the product and its sum are FP16 (where 1e-8 gradients die); the loss itself is FP32, as autocast and
        # the FP32 policy make it: an FP16 loss could not even hold the backward seed, which equals the scale
        return self(x).sum().float() * 1e-4

    def on_before_optimizer_step(self, optimizer):
        self.grads.append(dict(self.trainer.precision_plugin.named_grads())["w"].clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.on_device
def test_gradients_around_1e_8_flush_to_zero_in_fp16_without_scaling_and_survive_with_it():
    unscaled = TinyGrad()
    fit(unscaled, MixedPrecisionPlugin("fp16", loss_scale=None), data=ones(1), max_steps=1)
    assert torch.count_nonzero(unscaled.grads[0]) == 0

    scaled = TinyGrad()
    fit(scaled, MixedPrecisionPlugin("fp16"), data=ones(1), max_steps=1)
    g = scaled.grads[0].cpu()  # taken during the fit, on the device
    assert g.dtype == torch.float32
    torch.testing.assert_close(g, torch.full((4,), 1e-8), rtol=2**-10, atol=0)


class Snapshot(Callback):
    """Masters and optimizer state at the end of every training batch."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plugin = trainer.precision_plugin
        opt = trainer.optimizers[0]
        state = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
        self.rows.append(
            dict(
                weights=copy.deepcopy(pl_module.state_dict()),
                opt_state=state,
                scale=plugin.loss_scale,
                skipped=plugin.skipped_steps,
                last=plugin.last_step_skipped,
            )
        )


def same_tree(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.on_device
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("fault", [float("inf"), float("nan")])
def test_overflow_step_is_skipped_weights_and_optimizer_state_unchanged_scale_backs_off(precision, fault):
    snap = Snapshot()
    plugin = MixedPrecisionPlugin(precision, **FP16_SAFE)
    fit(TinyRegressor(fault_at={3}, fault=fault), plugin, max_steps=6, callbacks=[snap])
    before, at = snap.rows[2], snap.rows[3]
    assert at["last"] and at["skipped"] == 1 and not before["last"]
    assert same_tree(before["weights"], at["weights"])
    assert same_tree(before["opt_state"], at["opt_state"])
    if precision == "fp16":
        assert at["scale"] == before["scale"] / 2
    else:
        assert at["scale"] == 1.0
    assert not same_tree(at["weights"], snap.rows[4]["weights"])  # training goes on
    assert plugin.skipped_steps == 1 and not plugin.last_step_skipped


@pytest.mark.on_device
def test_nan_at_every_step_stops_with_step_scale_and_hint():
    plugin = MixedPrecisionPlugin("bf16", max_consecutive_skips=5)
    with pytest.raises(FloatingPointError, match=r"step \d+ with loss scale 1.*5 optimizer steps in a row.*HINT"):
        fit(TinyRegressor(fault_at=set(range(100)), fault=float("nan")), plugin, max_steps=50)


@pytest.mark.on_device
def test_fp16_persistent_overflow_stops_at_min_scale():
    plugin = MixedPrecisionPlugin("fp16", init_scale=8.0, min_scale=1.0)
    with pytest.raises(FloatingPointError, match="below min_scale=1"):
        fit(TinyRegressor(fault_at=set(range(100))), plugin, max_steps=50)
    assert plugin.skipped_steps == 4  # 8 -> 4 -> 2 -> 1 -> (0.5 refused)


@pytest.mark.on_device
def test_the_stop_after_max_consecutive_skips_names_the_scale_of_the_skip_line_and_last_step_scale(caplog):
    # issue 37: the stop said 2048 where the skip line, last_step_scale and TensorBoard said 4096
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**13, max_consecutive_skips=2)
    with caplog.at_level(logging.WARNING, logger="lightning_mp.plugin"), pytest.raises(FloatingPointError) as err:
        fit(TinyRegressor(fault_at=set(range(100))), plugin, max_steps=10)
    skip_lines = [r.getMessage() for r in caplog.records if " skipped (loss scale " in r.getMessage()]
    assert [line.split(":")[0] for line in skip_lines] == ["step 0 skipped (loss scale 8192)",
                                                           "step 1 skipped (loss scale 4096)"]
    assert plugin.last_step_scale == 4096.0  # what LossScaleMonitor logs as precision/loss_scale
    assert str(err.value).startswith(
        "Non-finite gradients at step 1 with loss scale 4096 (backed off to 2048 after it): 2 optimizer steps in a "
        "row were skipped"
    )


@pytest.mark.on_device
@pytest.mark.parametrize(
    "where, key, value, allowed",
    [(("MixedPrecisionPlugin",), "version", "2", "allowed is an integer from 1 to 2"),
     (("MixedPrecisionPlugin", "scaler"), "mode", "static", "allowed are 'dynamic', a positive finite number")],
)
def test_resuming_a_foreign_plugin_state_stops_naming_the_key_its_value_and_what_is_allowed(
    tmp_path, where, key, value, allowed
):
    trainer = fit(TinyRegressor(), MixedPrecisionPlugin("fp16", init_scale=2.0**7), max_steps=2)
    trainer.save_checkpoint(tmp_path / "saved.ckpt")
    checkpoint = torch.load(tmp_path / "saved.ckpt", weights_only=False)
    state = checkpoint
    for k in where:
        state = state[k]
    state[key] = value
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    trainer = L.Trainer(plugins=[MixedPrecisionPlugin("fp16")], max_steps=4, **trainer_kwargs())
    with pytest.raises(ValueError, match=rf"{key}='{value}'.*{allowed}.*HINT") as err:
        trainer.fit(TinyRegressor(), regression_data(), ckpt_path=tmp_path / "edited.ckpt")
    assert "upgrade" not in str(err.value)  # a damaged state is not a newer one


@pytest.mark.on_device
def test_dynamic_scale_grows_after_clean_interval():
    plugin = MixedPrecisionPlugin("fp16", init_scale=4.0, growth_interval=2)
    fit(TinyRegressor(), plugin, max_steps=6)
    assert plugin.loss_scale == 32.0 and plugin.skipped_steps == 0


# ---------------------------------------------------------------------------------------------- clipping
def sgd_update(plugin, clip_val, algorithm):
    L.seed_everything(0)
    model = TinyRegressor(optimizer="sgd", lr=1.0)
    before = {k: v.clone().float() for k, v in model.state_dict().items()}
    fit(model, plugin, max_steps=1, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)
    return {k: before[k] - v.float() for k, v in model.state_dict().items()}


@pytest.mark.on_device
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipping_acts_on_unscaled_fp32_master_gradients(algorithm):
    clip = 0.05
    ours = sgd_update(MixedPrecisionPlugin("fp16", init_scale=2.0**10), clip, algorithm)
    ref = sgd_update(None, clip, algorithm)
    if algorithm == "norm":
        total = torch.linalg.vector_norm(torch.cat([u.flatten() for u in ours.values()]))
        assert total == pytest.approx(clip, rel=1e-3)
    else:
        assert max(u.abs().max().item() for u in ours.values()) == pytest.approx(clip, rel=1e-6)
    for k in ref:  # the same update as FP32 training, to FP16 forward/backward accuracy
        torch.testing.assert_close(ours[k], ref[k], rtol=2**-6, atol=clip * 2**-6)


@pytest.mark.on_device
@pytest.mark.parametrize("optimizer", ["adam_fused", "adam_foreach"])
def test_foreach_and_fused_optimizers_train_and_clip(optimizer):
    L.seed_everything(0)
    ref = TinyRegressor(optimizer=optimizer)
    fit(ref, None, max_steps=5, gradient_clip_val=0.5)
    L.seed_everything(0)
    model = TinyRegressor(optimizer=optimizer)
    fit(model, MixedPrecisionPlugin("bf16"), max_steps=5, gradient_clip_val=0.5)
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.01, msg=k)


@pytest.mark.on_device
def test_lbfgs_with_dynamic_scale_is_refused_clearly_and_works_in_bf16():
    with pytest.raises(ValueError, match="LBFGS.*loss_scale='dynamic'"):
        fit(TinyRegressor(optimizer="lbfgs", lr=0.1), MixedPrecisionPlugin("fp16"), max_steps=2)
    model = TinyRegressor(optimizer="lbfgs", lr=0.1)
    start = copy.deepcopy(model.state_dict())
    fit(model, MixedPrecisionPlugin("bf16"), max_steps=2)
    assert not same_tree(start, model.state_dict())


# ---------------------------------------------------------------------------------------------- manual optimization
@pytest.mark.on_device
def test_manual_optimization_two_optimizers_update_the_scale_once_per_training_step():
    plugin = MixedPrecisionPlugin("fp16", init_scale=4.0, growth_interval=2)
    model = TwoOptimizers()
    start = copy.deepcopy(model.state_dict())
    fit(model, plugin, max_steps=8)  # 8 optimizer steps = 4 training steps
    assert plugin.loss_scale == 16.0  # two growths, not four
    for k, v in model.state_dict().items():
        assert not torch.equal(v, start[k]), k


@pytest.mark.on_device
def test_manual_optimization_overflow_in_first_optimizer_skips_both_and_backs_off_once():
    plugin = MixedPrecisionPlugin("fp16", init_scale=64.0, growth_interval=100)
    snap = Snapshot()
    model = TwoOptimizers(fault_at={1})
    fit(model, plugin, max_steps=6, callbacks=[snap])
    before, at = snap.rows[0], snap.rows[1]
    assert same_tree(before["weights"], at["weights"])  # neither sub-net moved
    assert at["scale"] == 32.0 and at["skipped"] == 1
    assert plugin.loss_scale == 32.0


class GraphAcrossTheOtherStep(TwoOptimizers):
    """Issue 37's GAN order under manual optimization: G's loss graph through D is built before D's step, and a forward
    through D after that step (a metric, say) refreshes D's copies before G's backward. That graph back-propagates
    through D's weights as they were when it was built, a 16-bit copy under ours and autocast's cast under
    ``bf16-mixed``; in FP32 the step would modify the saved weight, so the FP32 reference (``snapshot``) reads a clone
    of them, made when the graph is built."""

    def __init__(self, snapshot=False):
        super().__init__()
        self.losses, self.snapshot = [], snapshot

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        x, y = batch
        fake = self.g(x)
        if self.snapshot:
            score = torch.func.functional_call(self.d, {n: p.clone() for n, p in self.d.named_parameters()}, (fake,))
        else:
            score = self.d(fake)  # G's loss graph: it saved D's weight
        loss_d = nn.functional.mse_loss(self.d(fake.detach()).float(), y)
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        self.d(x)  # raised at G's backward below while this refresh wrote D's copies in place
        loss_g = score.float().pow(2).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.losses.append((loss_d.item(), loss_g.item()))


@pytest.mark.on_device
@pytest.mark.parametrize("precision, dtype, reference", [("bf16", torch.bfloat16, "bf16-mixed"),
                                                         ("fp16", torch.float16, "32-true")])
def test_manual_optimization_a_graph_built_before_the_other_optimizers_step_trains_as_lightnings_own(
    precision, dtype, reference
):
    # fp16 against FP32: Lightning turns 16-mixed into bf16-mixed on the CPU
    torch.manual_seed(0)
    ours, ref = GraphAcrossTheOtherStep(), GraphAcrossTheOtherStep(snapshot=reference == "32-true")
    ref.load_state_dict(ours.state_dict())
    fit(ours, MixedPrecisionPlugin(precision, **FP16_SAFE), max_steps=16)
    fit(ref, precision=reference, max_steps=16)
    unit = torch.finfo(dtype).eps / 2  # unit roundoff: 2^-8 in bf16, 2^-11 in fp16
    # bf16-mixed does bf16's arithmetic (measured: equal); against FP32 a loss carries the roundings of the inputs,
    # weights and outputs of two layers (measured: 1.5 units in fp16; bf16-mixed is 1.0 bf16 unit from FP32)
    tolerance = unit if reference == "bf16-mixed" else 4 * unit
    got, want = torch.tensor(ours.losses), torch.tensor(ref.losses)
    assert len(got) == 8 and ((got - want).abs() / want.abs()).max() <= tolerance


# ---------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.on_device
def test_checkpoint_holds_fp32_masters_and_loads_into_a_plain_fp32_model(tmp_path):
    model = TinyRegressor()
    plugin = MixedPrecisionPlugin("bf16")
    captured = {}

    class Grab(Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            captured["mid_step"] = {k: v.detach().clone() for k, v in pl_module.named_parameters()}

        def on_train_end(self, trainer, pl_module):
            trainer.save_checkpoint(tmp_path / "last.ckpt")
            captured["masters"] = {k: v.clone() for k, v in pl_module.state_dict().items()}

    fit(model, plugin, max_steps=5, callbacks=[Grab()])
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert {v.dtype for v in ckpt["state_dict"].values()} == {torch.float32}
    assert same_tree(ckpt["state_dict"], captured["masters"])
    assert {v.dtype for v in captured["mid_step"].values()} == {torch.float32}  # between forward and backward too
    assert ckpt["MixedPrecisionPlugin"]["scaler"]["skipped_steps"] == 0
    assert ckpt["MixedPrecisionPlugin"]["version"] == 2

    loaded = TinyRegressor.load_from_checkpoint(tmp_path / "last.ckpt")
    assert same_tree(loaded.state_dict(), ckpt["state_dict"])


@pytest.mark.on_device
def test_bf16_checkpoint_resumes_in_fp16_and_fp32(tmp_path):
    trainer = fit(TinyRegressor(), MixedPrecisionPlugin("bf16"), max_steps=3)
    trainer.save_checkpoint(tmp_path / "bf16.ckpt")
    for precision in ("fp16", "fp32"):
        plugin = MixedPrecisionPlugin(precision, **FP16_SAFE)
        trainer = L.Trainer(plugins=[plugin], max_steps=6, **trainer_kwargs())
        model = TinyRegressor()
        trainer.fit(model, regression_data(), ckpt_path=tmp_path / "bf16.ckpt")
        assert trainer.global_step == 6
        assert plugin.loss_scale == (2.0**8 if precision == "fp16" else 1.0)


@pytest.mark.on_device
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_resume_continues_bit_for_bit(tmp_path, precision):
    def plugin():
        # a short growth interval and one overflow, so the scaler state (tracker, hysteresis) matters
        return MixedPrecisionPlugin(precision, init_scale=2.0**6, growth_interval=3, hysteresis=2)

    faults = {2, 9}  # resume at an epoch boundary (8 batches): Lightning restarts a plain DataLoader's epoch
    L.seed_everything(0)
    straight, straight_plugin = TinyRegressor(fault_at=faults), plugin()
    fit(straight, straight_plugin, max_epochs=2)

    L.seed_everything(0)
    first = TinyRegressor(fault_at=faults)
    trainer = fit(first, plugin(), max_epochs=1)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    second = TinyRegressor(fault_at=faults)
    second.seen_batches = 8
    resumed_plugin = plugin()
    trainer = L.Trainer(plugins=[resumed_plugin], max_epochs=2, **trainer_kwargs())
    trainer.fit(second, regression_data(), ckpt_path=tmp_path / "mid.ckpt")
    assert trainer.global_step == 16
    assert same_tree(second.state_dict(), straight.state_dict())
    assert resumed_plugin.skipped_steps == 2
    assert resumed_plugin.core.scaler.state_dict() == straight_plugin.core.scaler.state_dict()  # scale, trackers, counts


@pytest.mark.on_device
def test_fp32_is_a_bit_exact_passthrough():
    L.seed_everything(0)
    plain = TinyRegressor()
    L.seed_everything(0)
    ours = TinyRegressor()
    fit(plain, None, max_steps=8, gradient_clip_val=0.3)
    fit(ours, MixedPrecisionPlugin("fp32"), max_steps=8, gradient_clip_val=0.3)
    assert same_tree(plain.state_dict(), ours.state_dict())


# ---------------------------------------------------------------------------------------------- eval loops
@pytest.mark.on_device
@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_validation_and_predict_run_in_16_bits_and_leave_the_model_fp32(precision, dtype):
    model = TinyRegressor()
    before = copy.deepcopy(model.state_dict())
    trainer = L.Trainer(plugins=[MixedPrecisionPlugin(precision)], **trainer_kwargs())
    out = trainer.predict(model, regression_data())
    assert out[0].dtype == dtype
    trainer.validate(model, regression_data())
    assert same_tree(before, model.state_dict())  # nothing rounded by an eval-only run


@pytest.mark.on_device
def test_model_building_fp32_tensors_inside_forward_still_trains_in_16_bits():
    class BuildsFp32(TinyRegressor):
        def forward(self, x):
            bias = torch.ones(x.shape[-1], device=x.device)  # FP32, made inside forward
            out = self.net[0](x + bias)
            self.seen.add(out.dtype)
            return self.net[1:](out)

    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        model = BuildsFp32()
        model.seen = set()
        before = model.net[0].weight.detach().clone()
        fit(model, MixedPrecisionPlugin(precision, **FP16_SAFE), max_steps=3)
        assert model.seen == {dtype}  # the FP32 sum still meets a 16-bit matrix product
        assert not torch.equal(model.net[0].weight, before)


@pytest.mark.on_device
def test_output_head_tied_to_an_fp32_embedding_stays_fp32():
    class Tied(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.mid = nn.Linear(8, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight
            self.seen = {}

        def training_step(self, batch, batch_idx):
            idx = torch.arange(16, device=self.device).view(2, 8)
            h = self.emb(idx)
            m = self.mid(h)
            out = h + m  # FP32 residual stream: FP32 embedding + 16-bit block output
            self.seen = {"emb": h.dtype, "mid": m.dtype, "stream": out.dtype}
            return nn.functional.cross_entropy(self.head(out).flatten(0, 1), idx.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Tied()
    fit(model, MixedPrecisionPlugin("bf16"), data=ones(2), max_steps=2)
    assert model.seen == {"emb": torch.float32, "mid": torch.bfloat16, "stream": torch.float32}
    assert model.head.weight is model.emb.weight
