"""The user paths of issue 9, through the Trainer, written the way a user writes them: manual clipping, models
handed over in 16 bits, checkpoints of Lightning's deprecated plugin alias, ``grad_norm``, pickled schedulers."""

import copy
import pickle

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import nn

import lightning_mp
from lightning_mp import MixedPrecisionPlugin
from tests.conftest import TinyRegressor, device, regression_data, trainer_kwargs
from tests.test_plugin_integration import OneWeight, fit, ones


class ManualClip(L.LightningModule):
    """Manual optimization, Lightning's recipe: manual_backward -> clip_gradients -> step."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.w = nn.Parameter(torch.ones(16))
        self.updates = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = (self.w * 0.5).sum()  # gradient norm 2: clipped to 0.1 (scaled by 2^16 it is still finite in fp16)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
        before = self.w.detach().clone()
        opt.step()
        self.updates.append((self.w.detach() - before).norm().item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.on_device
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_manual_clip_gradients_clips_the_true_gradients(precision):
    model = ManualClip()
    knobs = {"init_scale": 2.0**12} if precision == "fp16" else {}  # 2^16 x 0.5 would overflow FP16 at step 0
    fit(model, MixedPrecisionPlugin(precision, **knobs), data=ones(3), max_steps=3)
    # lr 0.1 x clipped norm 0.1; fp16 at scale 2^16 once clipped the scaled gradients (update norm 9.8e-6)
    assert model.updates == pytest.approx([0.01] * 3, rel=1e-5)


@pytest.mark.on_device
@pytest.mark.parametrize("cast", [lambda m: m.half(), lambda m: m.to(torch.bfloat16)], ids=["half", "bf16"])
def test_a_model_already_in_16_bits_gets_fp32_masters_and_keeps_small_updates(cast):
    model = cast(OneWeight(lr=1e-4))
    reference = torch.tensor([1.0])
    for _ in range(50):
        reference -= 1e-4
    precision = "fp16" if model.w.dtype == torch.float16 else "bf16"
    with pytest.warns(UserWarning, match=r"already in torch.(float16|bfloat16) before fit.*HINT"):
        fit(model, MixedPrecisionPlugin(precision, init_scale=2.0**8), data=ones(50), max_steps=50)
    assert model.w.dtype == torch.float32
    assert torch.equal(model.w.detach(), reference)  # 0.9950 exactly; without masters it stayed at 1.0


@pytest.mark.on_device
def test_checkpoint_of_lightnings_deprecated_mixed_precision_plugin_alias_hands_over_its_scale(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecisionPlugin as DeprecatedAlias

    scaler = torch.amp.GradScaler(device(), init_scale=2.0**9, growth_interval=1000)
    trainer = fit(TinyRegressor(), DeprecatedAlias("16-mixed", device(), scaler=scaler), max_steps=2)
    trainer.save_checkpoint(tmp_path / "alias.ckpt")
    saved = torch.load(tmp_path / "alias.ckpt", weights_only=False)
    assert "scale" in saved["MixedPrecisionPlugin"]  # GradScaler state under the same key as ours
    plugin = MixedPrecisionPlugin("fp16", growth_interval=1000)
    trainer = L.Trainer(plugins=[plugin], max_steps=3, **trainer_kwargs())
    trainer.fit(TinyRegressor(), regression_data(), ckpt_path=tmp_path / "alias.ckpt")
    assert plugin.last_step_scale == saved["MixedPrecisionPlugin"]["scale"] == 2.0**9


class NormLogger(Callback):
    def __init__(self):
        self.lightning, self.ours = [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lightning.append({k: float(v) for k, v in lightning_grad_norm(pl_module, 2).items()})
        self.ours.append({k: float(v) for k, v in lightning_mp.grad_norm(pl_module, 2).items()})


@pytest.mark.on_device
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_grad_norm_sees_every_parameter_and_the_true_gradients(precision):
    runs = {}
    for name in ("fp32", precision):
        L.seed_everything(0)
        spy = NormLogger()
        fit(TinyRegressor(norm=True), MixedPrecisionPlugin(name), max_steps=1, callbacks=[spy])
        runs[name] = spy
    fp32, mixed = runs["fp32"].lightning[0], runs[precision].lightning[0]
    names = {f"grad_2.0_norm/{n}" for n, _ in TinyRegressor(norm=True).named_parameters()} | {"grad_2.0_norm_total"}
    assert set(mixed) == names  # before: only the LayerNorm's gradients were seen
    eps = 2.0**-8 if precision == "bf16" else 2.0**-11
    assert mixed["grad_2.0_norm_total"] == pytest.approx(fp32["grad_2.0_norm_total"], rel=8 * eps)  # unscaled
    assert runs[precision].ours[0] == pytest.approx(mixed, rel=1e-6)  # lightning_mp.numerics.grad_norm: the same keys


def test_grad_norm_rejects_a_bad_norm_type():
    with pytest.raises(ValueError, match=r"norm_type=-1 is not allowed"):
        lightning_mp.grad_norm(nn.Linear(2, 2), -1)


@pytest.mark.on_device
def test_step_scheduler_pickles_and_deep_copies_while_the_skip_guard_is_on():
    class Scheduled(TinyRegressor):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    copies = {}

    class Copy(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            sched = trainer.lr_scheduler_configs[0].scheduler
            assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
            copies["pickled"] = pickle.loads(pickle.dumps(sched))
            copies["deep"] = copy.deepcopy(sched)
            copies["state"] = sched.state_dict()

    fit(Scheduled(), MixedPrecisionPlugin("bf16"), max_steps=2, callbacks=[Copy()])
    for kind in ("pickled", "deep"):
        assert type(copies[kind]) is torch.optim.lr_scheduler.StepLR  # an ordinary scheduler
        assert copies[kind].state_dict() == copies["state"]
