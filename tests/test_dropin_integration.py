"""Code written for Lightning's ``MixedPrecision`` plugin, run with ours in its place (issue 38): each test runs the
same user code under both plugins (or, where Lightning's cannot run it, without a plugin) and asserts what the user
would see. Lightning's fp16 runs on the CPU as ``MixedPrecision("16-mixed", "cpu")`` (``precision="16-mixed"``
would switch a CPU run to bf16); under ``pytest --device cuda`` the tests marked ``on_device`` run both on the GPU."""

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.fabric import MixedPrecisionPlugin as FabricPlugin
from tests.conftest import TinyRegressor, device, regression_data, trainer_kwargs

LIGHTNING = {"fp16": "16-mixed", "bf16": "bf16-mixed"}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def lightnings(precision):
    return MixedPrecision(LIGHTNING[precision], device())


def fit(model, plugins, steps=4, **kwargs):
    trainer = L.Trainer(plugins=plugins, max_steps=steps, **trainer_kwargs(**kwargs))
    trainer.fit(model, regression_data())
    return trainer


# ---------------------------------------------------------------------------------------------- 1. plugin.scaler
class ScaleIdiom(TinyRegressor):
    """The idiom of public code: log the scale when there is a scaler."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.precision_plugin.scaler is not None:
            self.log("scale", self.trainer.precision_plugin.scaler.get_scale())
        return loss


class RecordScale(Callback):
    def __init__(self):
        self.scales = []

    def on_train_batch_end(self, trainer, *args):
        scaler = trainer.precision_plugin.scaler
        if scaler is not None:
            self.scales.append(scaler.get_scale())


@pytest.mark.on_device
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_scaler_idiom_logs_the_scale_in_fp16_and_nothing_in_bf16_as_with_lightnings(precision):
    logged = {}
    for name, plugin in (("ours", MixedPrecisionPlugin(precision)), ("lightning", lightnings(precision))):
        trainer = fit(ScaleIdiom(), [plugin], steps=3)
        logged[name] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert logged["ours"] == logged["lightning"] == ({"scale": 2.0**16} if precision == "fp16" else {})


@pytest.mark.on_device
def test_get_scale_backs_off_on_the_skipped_step_as_gradscalers_does():
    scales = {}
    for name, plugin in (("ours", MixedPrecisionPlugin("fp16")), ("lightning", lightnings("fp16"))):
        record = RecordScale()
        fit(TinyRegressor(fault_at=(1,)), [plugin], steps=4, callbacks=[record])
        scales[name] = record.scales
    assert scales["ours"] == scales["lightning"] == [2.0**16, 2.0**15, 2.0**15, 2.0**15]


# ------------------------------------------------------------------------------------ 2. autocast_context_manager
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_autocast_context_manager_computes_in_the_16_bit_format_as_lightnings(precision):
    layer = nn.Linear(4, 4)
    dtypes = []
    for plugin in (MixedPrecisionPlugin(precision), lightnings(precision)):
        with plugin.autocast_context_manager():
            dtypes.append((torch.is_autocast_enabled("cpu"), layer(torch.ones(1, 4)).dtype))
    assert dtypes == [(True, DTYPES[precision])] * 2


# ---------------------------------------------------------------------------------------------- 3. Fabric inputs
class SeesInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)
        self.seen = []

    def forward(self, x, extra):
        self.seen.append((x.dtype, extra["mask"].dtype, extra["ids"].dtype))
        return self.norm(self.linear(x)).sum()


@pytest.mark.on_device
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_fabric_forward_sees_floating_inputs_in_the_16_bit_format_as_under_fabrics_own(precision):
    seen = []
    for plugin in (FabricPlugin(precision), FabricMixedPrecision(LIGHTNING[precision], device())):
        fabric = L.Fabric(accelerator=device(), devices=1, plugins=[plugin])
        model = fabric.setup(SeesInputs())
        on = fabric.device
        out = model(torch.randn(2, 8, device=on), {"mask": torch.ones(2, device=on), "ids": torch.arange(2, device=on)})
        seen.append((model.seen[-1], out.dtype))
    assert seen[0] == seen[1] == ((DTYPES[precision], DTYPES[precision], torch.int64), torch.float32)


class Fp32ModulesFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lstm, self.head = nn.LayerNorm(8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 1)
        self.seen = {}

    def forward(self, x):
        h = self.norm(x)
        out, _ = self.lstm(h.unsqueeze(1))
        self.seen.update(x=x.dtype, norm=h.dtype, lstm=out.dtype)
        return self.head(out).sum()


@pytest.mark.on_device
def test_fabric_fp32_modules_still_compute_in_fp32_on_16_bit_inputs():
    fabric = L.Fabric(accelerator=device(), devices=1, plugins=[FabricPlugin("bf16")])
    model = fabric.setup(Fp32ModulesFirst())
    model(torch.randn(2, 8, device=fabric.device))
    assert model.seen == {"x": torch.bfloat16, "norm": torch.float32, "lstm": torch.float32}  # DEFAULT_FP32_MODULES


# ---------------------------------------------------------------------------------------------- 4. closures
class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization as such optimizers are written: ``step`` evaluates the closure at the weights,
    again at a perturbed point (``torch.enable_grad()`` inside a ``no_grad`` step), and steps with the second
    gradient from the first point."""

    def __init__(self, params, lr=0.05, rho=0.05):
        super().__init__(params, dict(lr=lr, rho=rho))
        self.evaluations = 0

    @torch.no_grad()
    def step(self, closure=None):
        if closure is None:
            raise RuntimeError("SAM requires a closure")
        closure = torch.enable_grad()(closure)
        loss = closure()
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        scale = self.defaults["rho"] / (torch.stack([p.grad.norm() for p in params]).norm() + 1e-12)
        moves = [p.grad * scale for p in params]
        torch._foreach_add_(params, moves)
        closure()
        torch._foreach_sub_(params, moves)
        torch._foreach_add_(params, [p.grad for p in params], alpha=-self.defaults["lr"])
        self.evaluations += 2
        return loss


class SamModel(TinyRegressor):
    def __init__(self, **kwargs):
        torch.manual_seed(0)
        super().__init__(**kwargs)
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach().float())
        return loss

    def configure_optimizers(self):
        return SAM(self.parameters())


def sam_run(plugins, steps=4, **model_kwargs):
    model = SamModel(**model_kwargs)
    fit(model, plugins, steps=steps)
    return model


@pytest.mark.on_device
@pytest.mark.parametrize(
    "precision, reference, tol",
    [("fp32", None, 0.0), ("bf16", "bf16", 1e-3), ("fp16", None, 2e-4)],
)
def test_a_sam_style_optimizer_trains_as_under_lightnings_plugin(precision, reference, tol):
    """fp16: Lightning's ``16-mixed`` hands its GradScaler no closure ("SAM requires a closure"), so the reference
    is the run without a plugin (fp32: bit for bit)."""
    ours = sam_run([MixedPrecisionPlugin(precision, init_scale=2.0**8)])
    ref = sam_run([lightnings(reference)] if reference else [])
    assert ours.optimizers().optimizer.evaluations == ref.optimizers().optimizer.evaluations == 8
    assert len(ours.losses) == len(ref.losses) == 8  # two forwards per step, as without a plugin
    assert ours.losses[-1] < ours.losses[0]
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=tol) if tol else torch.equal(a, b)


@pytest.mark.on_device
def test_sam_is_not_called_on_a_skipped_step_and_the_scale_backs_off():
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8)
    model = sam_run([plugin], fault_at=(2,))  # the first evaluation of step 1 overflows
    assert model.optimizers().optimizer.evaluations == 6  # steps 0, 2, 3
    assert plugin.skipped_steps == 1 and plugin.loss_scale == 2.0**7


@pytest.mark.on_device
def test_a_non_finite_re_evaluation_inside_step_stops_with_the_step_and_a_hint():
    with pytest.raises(FloatingPointError, match=r"step 1 .*SAM re-evaluated its closure.*HINT: "):
        sam_run([MixedPrecisionPlugin("bf16")], fault_at=(3,))  # the second evaluation of step 1


class ManualClosure(TinyRegressor):
    def __init__(self):
        torch.manual_seed(0)
        super().__init__(optimizer="sgd")
        self.automatic_optimization = False
        self.returned = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        computed = []

        def closure():
            loss = nn.functional.mse_loss(self(batch[0]).float(), batch[1])
            opt.zero_grad()
            self.manual_backward(loss)
            computed.append(loss.detach())
            return loss

        self.returned.append((opt.step(closure=closure), computed[-1]))


@pytest.mark.on_device
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_manual_step_with_a_closure_returns_the_loss_as_without_a_plugin(precision):
    model = ManualClosure()
    fit(model, [MixedPrecisionPlugin(precision, init_scale=2.0**8)], steps=3)
    reference = ManualClosure()  # Lightning's 16-mixed returns None here (its GradScaler steps without the closure)
    fit(reference, [] if precision == "fp32" else [lightnings("bf16")], steps=3)
    for returned in (model.returned, reference.returned):
        assert len(returned) == 3 and all(torch.equal(out, loss) for out, loss in returned)


# ---------------------------------------------------------------------------------------------- 5. constructor
@pytest.mark.parametrize("cls", [MixedPrecisionPlugin, FabricPlugin])
def test_lightnings_positional_device_is_refused_naming_it(cls):
    match = r"\('16-mixed', 'cuda'\): only `precision` is positional.*device='cuda'.*HINT"
    with pytest.raises(ValueError, match=match):
        cls("16-mixed", "cuda")


# ---------------------------------------------------------------------------------------------- 6. forward_context
def counting(base):
    class Counting(base):
        entered = 0

        def forward_context(self):
            type(self).entered += 1
            return super().forward_context()

    return Counting


@pytest.mark.on_device
def test_an_overridden_forward_context_is_entered_in_every_step_as_in_lightnings():
    counts = []
    runs = ((counting(MixedPrecisionPlugin), ("bf16",)), (counting(MixedPrecision), ("bf16-mixed", device())))
    for plugin_cls, args in runs:
        trainer = L.Trainer(plugins=[plugin_cls(*args)], max_steps=2, limit_val_batches=1, **trainer_kwargs())
        trainer.fit(TinyRegressor(), regression_data(n=16), regression_data(n=8))  # 2 steps, then 1 val batch
        trainer.predict(trainer.lightning_module, regression_data(n=8), return_predictions=False)
        counts.append(plugin_cls.entered)
    assert counts[0] == counts[1] == 2 + 1 + 1  # two training steps, one validation batch, one predict batch


# ---------------------------------------------------------------------------------------------- 7. skipped steps
class GradsBeforeStep(Callback):
    def __init__(self):
        self.finite = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.finite.append(all(p.grad.isfinite().all().item() for p in pl_module.parameters()))


@pytest.mark.on_device
def test_a_skipped_steps_hook_sees_its_inf_gradients_and_no_clipping_reaches_the_weights():
    seen, weights = {}, {}
    for name, plugin in (("ours", MixedPrecisionPlugin("fp16")), ("lightning", lightnings("fp16"))):
        torch.manual_seed(0)
        model, spy = TinyRegressor(fault_at=(1,)), GradsBeforeStep()
        fit(model, [plugin], steps=3, callbacks=[spy], gradient_clip_val=0.5)
        seen[name], weights[name] = spy.finite, [p.detach() for p in model.parameters()]
    assert seen["ours"] == seen["lightning"] == [True, False, True]
    assert all(torch.isfinite(w).all() for ws in weights.values() for w in ws)  # the skip dropped them
