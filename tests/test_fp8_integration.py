"""precision="fp8" in real fits (Trainer and Fabric), the demo GPT and a tiny transformers Llama: every recipe trains
near bf16, the Parameters are FP32 at every moment, the model keeps its classes, checkpoints are a plain model's
and resume across precisions, and an fp8 resume continues bit for bit."""

import copy

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.demos.gpt import GPT
from lightning_mp.fabric import MixedPrecisionPlugin as FabricPlugin

torchao = pytest.importorskip("torchao", reason="precision='fp8' needs torchao: pip install 'lightning_mp[fp8]'")
pytestmark = pytest.mark.slow

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"]
MX = tuple(int(p) for p in torchao.__version__.split(".")[:2]) >= (0, 18)
# A few steps' losses of bf16 and fp8 differ by what FP8 rounding does to each GEMM's operands: at most half an ulp
# relative, 2^-4 in e4m3 (eps 2^-3), 2^-3 in e5m2 (eps 2^-2: tensorwise's output gradients), and the errors of a
# GEMM's K products partly cancel. The loss (a mean of thousands of cross-entropies) moves much less than that.
TOLERANCE = {"tensorwise": 2**-3, "rowwise": 2**-4, "rowwise_with_gw_hp": 2**-4, "mxfp8": 2**-4}
STEPS, BATCH, SEQ, VOCAB = 3, 4, 32, 256  # 128 rows per GEMM: a multiple of MXFP8's 32


def tokens(n=STEPS * BATCH, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(t[:, :-1], t[:, 1:])


class Llama(L.LightningModule):
    def __init__(self):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)
        self.net = transformers.LlamaForCausalLM(config)

    def forward(self, x):
        return self.net(x).logits

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def gpt():
    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_head=2, n_embd=64, lr=1e-3)


MODELS = {"gpt": gpt, "llama": Llama}


class Watch(L.Callback):
    """Every floating Parameter FP32 at each batch's start and end and before each step; the losses."""

    def __init__(self):
        self.losses, self.checks = [], 0

    def check(self, module):
        assert all(p.dtype == torch.float32 for p in module.parameters())
        self.checks += 1

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.check(module)

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.check(module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.check(module)
        self.losses.append(outputs["loss"].item())


def trainer(plugin, steps=STEPS, **kwargs):
    return L.Trainer(max_steps=steps, plugins=[plugin] if plugin else None, accelerator="cpu", logger=False,
                     enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False, **kwargs)


def fit(name, plugin, **kwargs):
    torch.manual_seed(0)
    model, watch = MODELS[name](), Watch()
    classes = {n: type(m) for n, m in model.named_modules()}
    trainer(plugin, callbacks=[watch], **kwargs).fit(model, torch.utils.data.DataLoader(tokens(), batch_size=BATCH))
    assert {n: type(m) for n, m in model.named_modules()} == classes  # the model's own classes after the fit
    assert not any("forward" in vars(m) for m in model.modules())
    assert watch.checks == 3 * STEPS
    return model, watch.losses


@pytest.fixture(scope="module")
def bf16_losses():
    return {name: fit(name, MixedPrecisionPlugin("bf16"))[1] for name in MODELS}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_trains_near_bf16_on_fp32_masters_under_the_trainer(recipe, name, bf16_losses):
    if recipe == "mxfp8" and not MX:
        pytest.skip("fp8_recipe='mxfp8' needs torchao 0.18")
    plugin = MixedPrecisionPlugin("fp8", fp8_recipe=recipe, fp8_modules=[nn.Linear])
    _, losses = fit(name, plugin)
    assert plugin.core.fp8.chosen and plugin.core.fp8.emulated  # Linears ran FP8, emulated on this CPU
    reference = bf16_losses[name]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses != reference  # FP8 changed the numbers...
    for fp8_loss, bf16_loss in zip(losses, reference):  # ...by what FP8's rounding allows
        assert abs(fp8_loss - bf16_loss) <= TOLERANCE[recipe] * abs(bf16_loss)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_trains_near_bf16_under_fabric(recipe, name):
    if recipe == "mxfp8" and not MX:
        pytest.skip("fp8_recipe='mxfp8' needs torchao 0.18")
    losses = {}
    for precision in ("bf16", "fp8"):
        torch.manual_seed(0)
        fp8 = {"fp8_recipe": recipe, "fp8_modules": [nn.Linear]} if precision == "fp8" else {}
        plugin = FabricPlugin(precision, **fp8)  # FP8 knobs under bf16 are refused
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        module = MODELS[name]()
        model, opt = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-3))
        losses[precision] = []
        for x, y in torch.utils.data.DataLoader(tokens(), batch_size=BATCH):
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            assert all(p.dtype == torch.float32 for p in module.parameters())
            losses[precision].append(loss.item())
        if precision == "fp8":
            chosen = [m for _, m in plugin.core.fp8.chosen]
            assert chosen and all(type(m).forward is nn.Linear.forward for m in chosen)  # nn.Linear's own class
        plugin.teardown()
        assert not any("forward" in vars(m) for m in module.modules())
    assert losses["fp8"] != losses["bf16"]
    for fp8_loss, bf16_loss in zip(losses["fp8"], losses["bf16"]):
        assert abs(fp8_loss - bf16_loss) <= TOLERANCE[recipe] * abs(bf16_loss)


class SaveMidForward(L.Callback):
    """A checkpoint written inside a Linear's FP8 forward (its bf16 copies installed, about to be cast to FP8) and
    one before the optimizer step."""

    def __init__(self, tmp_path):
        self.tmp_path, self.expected, self.copy_dtype = tmp_path, {}, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 1:
            linear = next(m for m in module.modules() if isinstance(m, nn.Linear) and "forward" in vars(m))
            fp8_forward = vars(linear)["forward"]
            matmul = fp8_forward.matmul

            def save_then_multiply(x, weight):
                self.copy_dtype = vars(linear)["weight"].dtype  # what the forward reads: the installed copy
                trainer.save_checkpoint(self.tmp_path / "mid_forward.ckpt")
                self.expected = {k: v.clone() for k, v in module.state_dict().items()}
                fp8_forward.matmul = matmul
                return matmul(x, weight)

            fp8_forward.matmul = save_then_multiply

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step == 1:
            trainer.save_checkpoint(self.tmp_path / "before_step.ckpt")


def test_checkpoints_hold_fp32_masters_with_a_plain_models_keys_and_resume_across_precisions(tmp_path):
    plugin = MixedPrecisionPlugin("fp8", fp8_modules=[nn.Linear])
    saver = SaveMidForward(tmp_path)
    torch.manual_seed(0)
    model = gpt()
    trainer(plugin, callbacks=[saver]).fit(model, torch.utils.data.DataLoader(tokens(), batch_size=BATCH))
    plain_keys = set(gpt().state_dict())
    for path in ("mid_forward.ckpt", "before_step.ckpt"):
        state = torch.load(tmp_path / path, weights_only=False)["state_dict"]
        assert set(state) == plain_keys
        assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    mid = torch.load(tmp_path / "mid_forward.ckpt", weights_only=False)["state_dict"]
    assert saver.copy_dtype == torch.bfloat16 and saver.expected
    assert all(torch.equal(mid[k], v) for k, v in saver.expected.items())  # the masters, not their bf16 copies
    assert any(not torch.equal(v, v.bfloat16().float()) for v in mid.values())

    plain = gpt()
    plain.load_state_dict(mid)  # a plain model takes it as it is
    loader = torch.utils.data.DataLoader(tokens(), batch_size=BATCH)
    for resume in (None, MixedPrecisionPlugin("bf16"), MixedPrecisionPlugin("fp16"),
                   MixedPrecisionPlugin("fp8", fp8_modules=[nn.Linear])):
        model, watch = gpt(), Watch()
        trainer(resume, steps=STEPS + 1, callbacks=[watch]).fit(model, loader, ckpt_path=tmp_path / "before_step.ckpt")
        assert watch.losses and all(torch.isfinite(torch.tensor(watch.losses)))
    bf16_path = tmp_path / "bf16.ckpt"
    bf16_trainer = trainer(MixedPrecisionPlugin("bf16"))
    bf16_trainer.fit(gpt(), loader)
    bf16_trainer.save_checkpoint(bf16_path)
    model, watch = gpt(), Watch()
    fp8 = MixedPrecisionPlugin("fp8", fp8_modules=[nn.Linear])
    trainer(fp8, steps=STEPS + 2, callbacks=[watch]).fit(model, loader, ckpt_path=bf16_path)  # bf16 -> fp8
    assert len(watch.losses) == 2 and fp8.core.fp8.chosen


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_an_fp8_resume_continues_bit_for_bit_as_an_uninterrupted_run(tmp_path, recipe):
    loader = torch.utils.data.DataLoader(tokens(), batch_size=BATCH)  # one epoch: STEPS batches, in order

    def plugin():
        return MixedPrecisionPlugin("fp8", fp8_recipe=recipe, fp8_modules=[nn.Linear])

    torch.manual_seed(0)
    straight = gpt()
    trainer(plugin(), steps=-1, max_epochs=2).fit(straight, loader)
    torch.manual_seed(0)
    first = gpt()
    first_trainer = trainer(plugin(), steps=-1, max_epochs=1)
    first_trainer.fit(first, loader)
    first_trainer.save_checkpoint(tmp_path / "epoch.ckpt")
    torch.manual_seed(1)
    resumed = gpt()  # other initial weights: everything comes from the checkpoint
    trainer(plugin(), steps=-1, max_epochs=2).fit(resumed, loader, ckpt_path=tmp_path / "epoch.ckpt")
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert a.dtype == torch.float32 and torch.equal(a, b), name
    assert not torch.equal(copy.deepcopy(first).head.weight, straight.head.weight)  # the second epoch moved them


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_on_compensated_masters_trains_bit_for_bit_as_on_fp32_masters(recipe):
    """docs/fp8.md's promise for "fp8" with master_weights="compensated" (bf16 parameters with exact remainders)."""
    trained = {}
    for masters in (True, "compensated"):
        torch.manual_seed(0)
        model = gpt()
        plugin = MixedPrecisionPlugin("fp8", fp8_recipe=recipe, fp8_modules=[nn.Linear], master_weights=masters)
        trainer(plugin).fit(model, torch.utils.data.DataLoader(tokens(), batch_size=BATCH))
        assert plugin.core.fp8.chosen and (plugin.core.lean is not None) == (masters == "compensated")
        trained[masters] = model
    for (name, a), b in zip(trained[True].named_parameters(), trained["compensated"].parameters()):
        assert b.dtype == torch.float32 and torch.equal(a, b), name  # FP32 again after the fit, and identical
    torch.manual_seed(0)
    assert not torch.equal(trained[True].head.weight, gpt().head.weight)  # the steps moved them from their start
