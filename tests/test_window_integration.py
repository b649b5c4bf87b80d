"""The 16-bit copies are invisible: every user path of issue 21, written as a user writes it, through the Trainer or
Fabric, against Lightning's own ``bf16-mixed`` or FP32 on the same code."""

import copy
import os

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import Callback, OnExceptionCheckpoint, StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import DEFAULT_FP32_MODULES, MixedPrecisionPlugin
from lightning_mp.fabric import MixedPrecisionPlugin as FabricPlugin
from tests.conftest import TinyRegressor, cpu_only, device, inside_forward, trainer_kwargs

# bf16 keeps 8 significant bits: a few SGD steps of a small MLP end within ~1e-3 of FP32; the bugs this file guards
# against were 0.13-0.17 off
BF16_RUN_TOL = 2e-2


def data(n=16, batch_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True) * 0.3), batch_size=batch_size)


def run(model, precision, **kwargs):
    """``precision``: ours ("bf16", "fp16", or a plugin), or Lightning's own ("32-true", "bf16-mixed")."""
    plugin = MixedPrecisionPlugin(precision) if precision in ("bf16", "fp16") else precision
    extra = {"plugins": [plugin]} if isinstance(plugin, MixedPrecisionPlugin) else {"precision": precision}
    dl = kwargs.pop("data", None) or data()
    trainer = L.Trainer(**trainer_kwargs(**extra, **kwargs))
    trainer.fit(model, dl)
    return trainer


def max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a.state_dict().values(), b.state_dict().values()))


class Mlp(L.LightningModule):
    def __init__(self, lr=0.1):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


# ---------------------------------------------------------------------------------------------- gradients
class ZeroGradAtTop(Mlp):
    """Manual optimization: zero_grad at the top of every step, a step every other batch (the odd batch's
    gradients only)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.loss(batch))
        if batch_idx % 2:
            opt.step()


class DropsEvenBatches(Mlp):
    """Automatic optimization whose optimizer_step runs the closure without stepping on even batches."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if batch_idx % 2 == 0:
            optimizer_closure()
        else:
            optimizer.step(closure=optimizer_closure)


@pytest.mark.on_device
@pytest.mark.parametrize("cls", [ZeroGradAtTop, DropsEvenBatches])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero_grad_drops_the_gradients_the_user_means(cls, precision):
    ours, fp32, native = cls(), cls(), cls()
    run(ours, precision, max_epochs=2)
    run(fp32, "32-true", max_epochs=2)
    run(native, "bf16-mixed", max_epochs=2)
    assert max_diff(native, fp32) < BF16_RUN_TOL  # what 16-bit compute costs here
    assert max_diff(ours, fp32) < BF16_RUN_TOL


class TwoHeads(L.LightningModule):
    """manual_backward(la, retain_graph=True); manual_backward(lb): head_b is reached only by lb."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.trunk, self.head_a, self.head_b = nn.Linear(8, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        h = self.trunk(x)
        self.manual_backward(nn.functional.mse_loss(self.head_a(h).float(), y), retain_graph=True)
        self.manual_backward(nn.functional.mse_loss(self.head_b(h).float(), -y))
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.on_device
def test_two_backwards_through_one_graph_train_as_in_fp32():
    ours, fp32 = TwoHeads(), TwoHeads()
    run(ours, "bf16", max_epochs=2)
    run(fp32, "32-true", max_epochs=2)
    assert max_diff(ours, fp32) < BF16_RUN_TOL
    assert not torch.equal(ours.head_b.weight, TwoHeads().head_b.weight)  # head_b trained


# ---------------------------------------------------------------------------------------------- what others see
class Watcher(Callback):
    """Reads the parameters where users do: before the backward, before zero_grad (an EMA updates there)."""

    def __init__(self):
        self.dtypes, self.ema = set(), None

    def on_before_backward(self, trainer, pl_module, loss):
        self.dtypes |= {p.dtype for p in pl_module.parameters()}

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        params = [p.detach() for p in pl_module.parameters()]
        self.dtypes |= {p.dtype for p in params}
        if self.ema is None:
            self.ema = [p.clone() for p in params]
        torch._foreach_lerp_(self.ema, params, 0.5)


@pytest.mark.on_device
def test_callbacks_see_fp32_masters_before_backward_and_zero_grad():
    ours, fp32 = Watcher(), Watcher()
    run(Mlp(), "bf16", max_epochs=1, callbacks=[ours])
    run(Mlp(), "32-true", max_epochs=1, callbacks=[fp32])
    assert ours.dtypes == {torch.float32}
    assert max(abs(a - b).max().item() for a, b in zip(ours.ema, fp32.ema)) < BF16_RUN_TOL


class SavesMidStep(Mlp):
    def __init__(self, path, fail_at=None):
        super().__init__()
        self.path, self.fail_at = path, fail_at

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)  # after the forward, as a signal handler could fire here too
        if batch_idx == 2:
            self.at_save = {k: v.clone() for k, v in self.state_dict().items()}
            if self.fail_at is None:
                self.trainer.save_checkpoint(self.path)
            else:
                raise RuntimeError("boom")
        return loss


@pytest.mark.on_device
def test_save_checkpoint_inside_training_step_writes_fp32_masters(tmp_path):
    model = SavesMidStep(tmp_path / "mid.ckpt")
    run(model, "bf16", max_epochs=1)
    saved = torch.load(tmp_path / "mid.ckpt", weights_only=False, map_location="cpu")["state_dict"]
    assert {v.dtype for v in saved.values()} == {torch.float32}
    assert all(torch.equal(saved[k], v.cpu()) for k, v in model.at_save.items())  # taken on the device


@pytest.mark.on_device
def test_on_exception_checkpoint_writes_the_fp32_masters_of_the_last_step(tmp_path):
    model = SavesMidStep(None, fail_at=2)
    with pytest.raises(RuntimeError, match="boom"):
        run(model, "bf16", max_epochs=1, callbacks=[OnExceptionCheckpoint(tmp_path)], enable_checkpointing=True)
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=False, map_location="cpu")["state_dict"]
    assert {v.dtype for v in saved.values()} == {torch.float32}
    assert all(torch.equal(saved[k], v.cpu()) for k, v in model.at_save.items())


# ---------------------------------------------------------------------------------------------- writes
class ClampsFirst(L.LightningModule):
    """WGAN's habit: clamp every parameter in training_step, before the forward. loss = w * 1."""

    def __init__(self, w0, bound):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w0]))
        self.bound, self.seen = bound, []

    def forward(self, x):
        return self.w * 1.0

    def training_step(self, batch, batch_idx):
        for p in self.parameters():
            p.data.clamp_(-self.bound, self.bound)
        out = self(batch[0])
        self.seen.append(out.detach().float().item())
        return out.float().sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)


@pytest.mark.on_device
def test_a_write_in_training_step_before_the_forward_keeps_every_update_and_reaches_the_forward():
    reference = torch.tensor([1.0])
    for _ in range(50):
        reference -= 1e-4  # FP32 SGD: 0.9950
    model = ClampsFirst(1.0, bound=10.0)  # a clamp that changes nothing
    run(model, "bf16", data=DataLoader(TensorDataset(torch.zeros(50, 1)), batch_size=1), max_epochs=1)
    assert torch.equal(model.w.detach(), reference)  # 49 of 50 updates were lost when the copy was written back

    clipped = ClampsFirst(2.0, bound=1.0)  # a clamp that changes the weight: the same step's forward sees it
    run(clipped, "bf16", data=DataLoader(TensorDataset(torch.zeros(1, 1)), batch_size=1), max_epochs=1)
    assert clipped.seen == [1.0]


# ---------------------------------------------------------------------------------------------- checkpointing
def gpt2(seed=0):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


class Lm(L.LightningModule):
    def __init__(self, net, reentrant=None):
        super().__init__()
        self.net, self.losses = net, []
        if reentrant is not None:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})

    def training_step(self, batch, batch_idx):
        loss = self.net(input_ids=batch[0], labels=batch[0]).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def tokens(n=4):
    return DataLoader(TensorDataset(torch.randint(0, 128, (n * 2, 32), generator=torch.Generator().manual_seed(0))), batch_size=2)


@pytest.mark.on_device
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_of_a_transformers_gpt2_matches_the_run_without_it(precision, reentrant):
    plain, ckpt = Lm(gpt2()), Lm(gpt2(), reentrant=reentrant)
    run(plain, precision, data=tokens(), max_epochs=1)
    run(ckpt, precision, data=tokens(), max_epochs=1)
    assert ckpt.losses == plain.losses  # bit-identical: the recomputation reads the same copies and policy
    assert max_diff(plain, ckpt) == 0.0


# ---------------------------------------------------------------------------------------------- what is converted
class LoRA(L.LightningModule):
    """A frozen base loaded in bf16 and a trainable FP32 adapter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(8, 8).to(torch.bfloat16).requires_grad_(False)
        self.adapter = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.base(x) + self.adapter(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


@pytest.mark.on_device
def test_a_frozen_bf16_base_stays_bf16_and_the_adapter_trains_like_bf16_mixed():
    ours, native = LoRA(), LoRA()
    before = ours.base.weight.clone()
    run(ours, "bf16", max_epochs=1)
    run(native, "bf16-mixed", max_epochs=1)
    assert ours.base.weight.dtype == torch.bfloat16 and torch.equal(ours.base.weight, before)  # 2 B/param
    assert ours.adapter.weight.dtype == torch.float32
    assert max_diff(ours, native) < BF16_RUN_TOL


class Boosted(nn.Module):
    """A block whose parameters sit in a child: a Linear whose output is scaled past FP16's 65504."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * 1e5


class WithBoosted(Mlp):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(Boosted(), nn.LayerNorm(8), nn.Linear(8, 1))
        self.seen = set()
        inside_forward(self.net[0].lin, lambda m, a, out: self.seen.add((m.weight.dtype, out.dtype)))


@pytest.mark.on_device
def test_a_listed_module_is_fp32_through_its_whole_subtree():
    model = WithBoosted()
    plugin = MixedPrecisionPlugin("fp16", fp32_modules=(*DEFAULT_FP32_MODULES, Boosted))
    run(model, plugin, max_epochs=3)
    assert model.seen == {(torch.float32, torch.float32)}
    # the scaler's first probes from 2^16 may skip; the block itself (1e5, past FP16's 65504) never overflows
    assert plugin.skipped_steps <= 2 and not plugin.last_step_skipped


class EmbedMaxNorm(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8, max_norm=1.0)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        return self.head(self.emb(torch.tensor([1, 2, 3], device=self.device))).float().sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # only the renorm moves the weight


@pytest.mark.on_device
def test_embedding_max_norm_off_the_fp32_list_renormalises_the_fp32_master_as_bf16_mixed_does():
    ours, native = EmbedMaxNorm(), EmbedMaxNorm()
    run(ours, MixedPrecisionPlugin("bf16", fp32_modules=()), data=DataLoader(TensorDataset(torch.zeros(1, 1))), max_epochs=1)
    run(native, "bf16-mixed", data=DataLoader(TensorDataset(torch.zeros(1, 1))), max_epochs=1)
    assert torch.equal(ours.emb.weight, native.emb.weight)  # rows 1-3 renormed in FP32, the rest untouched


class LoadedInBf16(Mlp):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1)).to(torch.bfloat16)


@pytest.mark.on_device
def test_a_model_loaded_in_bf16_with_a_layernorm_trains_under_the_trainer_and_fabric():
    ours, native = LoadedInBf16(), LoadedInBf16()
    with pytest.warns(UserWarning, match="already in torch.bfloat16"):
        run(ours, "bf16", max_epochs=1)
    run(native, "bf16-mixed", max_epochs=1)
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    assert max_diff(ours, native) < BF16_RUN_TOL

    fabric = Fabric(accelerator=device(), devices=1, plugins=[FabricPlugin("bf16")])
    net = LoadedInBf16().net
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in data():
        x, y = x.to(fabric.device), y.to(fabric.device)
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        opt.zero_grad()
    assert {p.dtype for p in net.parameters()} == {torch.float32}


class Float64(Mlp):
    def __init__(self):
        super().__init__()
        self.net = self.net.double()

    def loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self(x.double()).float(), y)


@pytest.mark.on_device
def test_float64_parameters_keep_their_dtype_and_train_as_under_bf16_mixed():
    ours, native = Float64(), Float64()
    run(ours, "bf16", max_epochs=1)
    run(native, "bf16-mixed", max_epochs=1)
    assert {p.dtype for p in ours.parameters()} == {torch.float64}
    assert max_diff(ours, native) < 1e-6


# ---------------------------------------------------------------------------------------------- runs that fail
class FailsAfterUnscale(Callback):
    def __init__(self):
        self.armed = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.armed:
            self.armed = False
            raise RuntimeError("boom after unscale")


@pytest.mark.on_device
def test_an_exception_after_the_unscale_leaves_nothing_for_the_next_fit():
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**4)
    with pytest.raises(RuntimeError, match="boom after unscale"):  # on a step whose gradients overflowed
        run(TinyRegressor(fault_at={0}), plugin, max_epochs=1, callbacks=[FailsAfterUnscale()])
    run(Mlp(), plugin, max_steps=2)
    assert plugin.skipped_steps == 0 and plugin.optimizer_steps == 2


class SwaBn(Mlp):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


@pytest.mark.on_device
@cpu_only("bitwise: the CPU's BatchNorm on bf16-mixed's bf16 input computes as ours does on its FP32 input and "
          "rounds alike; on CUDA bf16-mixed runs a mixed-dtype BatchNorm kernel (its own reductions), not ours")
def test_swa_with_batch_norm_ends_where_bf16_mixed_ends():
    # Lightning's BN-update epoch runs the optimizer once on the last gradients (under 32-true too), so no
    # precision ends exactly on the average; the used gradients of every parameter, FP32-kept ones included,
    # must behave as under Lightning's own plugin (BatchNorm's were 0.004 off it)
    ours, native = SwaBn(), SwaBn()
    run(ours, "bf16", max_epochs=3, callbacks=[StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)])
    run(native, "bf16-mixed", max_epochs=3, callbacks=[StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)])
    assert max_diff(ours, native) == 0.0


# ---------------------------------------------------------------------------------------------- Fabric
@pytest.mark.on_device
def test_fabric_load_after_a_forward_without_backward_restores_exact_fp32_values_and_adam_state(tmp_path):
    fabric = Fabric(accelerator=device(), devices=1, plugins=[FabricPlugin("bf16")])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model, opt = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    batches = [(x.to(fabric.device), y.to(fabric.device)) for x, y in data()]

    def step(x, y):
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        opt.zero_grad()

    state = {"model": model, "optimizer": opt}
    step(*batches[0])
    fabric.save(tmp_path / "good.pt", state)
    good = copy.deepcopy(net.state_dict())
    step(*batches[1])
    model(batches[2][0])  # a loss spike: its loss is never back-propagated, the loop rolls back
    fabric.load(tmp_path / "good.pt", state)
    assert all(torch.equal(v, good[k]) for k, v in model.state_dict().items())
    assert {t.dtype for s in opt.state.values() for t in s.values() if t.is_floating_point()} == {torch.float32}
    step(*batches[2])  # Adam steps on from the restored state
    assert all(torch.isfinite(p).all() for p in net.parameters())


@pytest.mark.on_device
def test_fabric_clip_by_value_on_an_overflowing_fp16_step_skips_it_and_trains_on():
    fabric = Fabric(accelerator=device(), devices=1, plugins=[FabricPlugin("fp16", init_scale=16.0)])
    torch.manual_seed(0)
    net = nn.Linear(8, 1)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    plugin = fabric.strategy.precision
    for i, (x, y) in enumerate(data()):
        x, y = x.to(fabric.device), y.to(fabric.device)
        loss = nn.functional.mse_loss(model(x).float(), y) * (1e6 if i == 0 else 1.0)  # past 65504 in FP16
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, clip_val=1.0)
        opt.step()
        opt.zero_grad()
    assert plugin.skipped_steps == 1 and plugin.optimizer_steps == 4


# ---------------------------------------------------------------------------------------------- DDP
WORKER = os.path.join(os.path.dirname(__file__), "ddp_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_ddp_with_manual_optimization_trains_like_bf16_mixed(tmp_path, precision):
    from tests.test_ddp import launch

    (tmp_path / "ours").mkdir()
    (tmp_path / "native").mkdir()
    ours = launch(tmp_path / "ours", "--precision", precision, "--manual", "--steps", "4")
    native = launch(tmp_path / "native", "--native", "bf16-mixed", "--manual", "--steps", "4")
    for k in ours[0]["state"]:
        assert torch.equal(ours[0]["state"][k], ours[1]["state"][k]), k  # the ranks agree
        assert (ours[0]["state"][k] - native[0]["state"][k]).abs().max() < BF16_RUN_TOL, k
