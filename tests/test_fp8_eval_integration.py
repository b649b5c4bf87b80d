"""precision="fp8" in evaluation: ``trainer.validate``, ``test`` and ``predict`` (``inference_mode`` True, Lightning's
default, and False; after a fit and in a fresh Trainer) and Fabric forwards under ``torch.inference_mode()`` and
``torch.no_grad()`` compute the training step's FP8 forward: the in-fit validation's numbers bit for bit, FP8's
rounding away from bf16's. Under ``inference_mode`` the rowwise recipes raised torchao's "aten.reshape.default with
axiswise scaling is not supported yet" on every transformer."""

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
# FP8 against bf16 on the same weights: each GEMM's operands rounded to e4m3 (half an ulp: 2^-4 relative); the loss,
# a mean of thousands of cross-entropies, moves far less (tests/test_fp8_integration.py's tolerances, forward only)
TOLERANCE = 2**-4
STEPS, BATCH, SEQ, VOCAB = 3, 4, 32, 256  # 128 rows per GEMM: a multiple of MXFP8's 32


class EvalGPT(GPT):
    """The demo GPT with a test step (the validation loss) and a predict step (FP32 logits)."""

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", self.loss_fn(self(x), y), batch_size=x.shape[0])

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).float()


def gpt(cls=EvalGPT):
    return cls(vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_head=2, n_embd=64, lr=1e-3)


def loader(seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ + 1), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(t[:, :-1], t[:, 1:]), batch_size=BATCH)


def trainer(plugin, **kwargs):
    return L.Trainer(plugins=[plugin], accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_model_summary=False, enable_progress_bar=False, num_sanity_val_steps=0, **kwargs)


def fp8(recipe):
    return MixedPrecisionPlugin("fp8", fp8_recipe=recipe, fp8_modules=[nn.Linear])


def cross_entropy(logits, data):
    return F.cross_entropy(torch.cat(logits).reshape(-1, VOCAB), torch.cat([y for _, y in data]).reshape(-1))


@pytest.mark.parametrize("recipe", RECIPES)
def test_validate_test_and_predict_compute_the_in_fit_fp8_validation_under_either_inference_mode(recipe):
    if recipe == "mxfp8" and not MX:
        pytest.skip("fp8_recipe='mxfp8' needs torchao 0.18")
    torch.manual_seed(0)
    model = gpt()
    train, val = loader(0), loader(1)
    plugin = fp8(recipe)
    fitting = trainer(plugin, max_steps=STEPS)  # one epoch, validated at its end (no_grad, FP8 Linears)
    fitting.fit(model, train, val)
    in_fit = fitting.callback_metrics["val_loss"].item()
    assert plugin.core.fp8.chosen and torch.isfinite(torch.tensor(in_fit))
    assert fitting.validate(model, val)[0]["val_loss"] == in_fit  # the same Trainer, after the fit

    predictions = {}
    for inference_mode in (True, False):
        fresh, trained = fp8(recipe), gpt()
        trained.load_state_dict(model.state_dict())  # metrics made under inference_mode cannot update outside it
        evaluator = trainer(fresh, inference_mode=inference_mode)
        assert evaluator.validate(trained, val)[0]["val_loss"] == in_fit
        assert fresh.core.fp8.chosen  # the Linears computed in FP8 in this Trainer too
        assert evaluator.test(trained, val)[0]["test_loss"] == in_fit
        predictions[inference_mode] = evaluator.predict(trained, val)
    assert all(torch.equal(a, b) for a, b in zip(predictions[True], predictions[False]))
    bf16 = trainer(MixedPrecisionPlugin("bf16")).predict(model, val)  # the same weights, Linears in bf16
    assert not any(torch.equal(a, b) for a, b in zip(predictions[True], bf16))  # FP8, not a silent bf16 fallback
    loss_fp8, loss_bf16 = cross_entropy(predictions[True], val), cross_entropy(bf16, val)
    assert abs(loss_fp8 - in_fit) <= 1e-6 * in_fit  # predict's logits give validate's loss (FP32 vs bf16 logits)
    assert abs(loss_fp8 - loss_bf16) <= TOLERANCE * loss_bf16


@pytest.mark.parametrize("recipe", RECIPES)
def test_fabric_forwards_under_inference_mode_and_no_grad_are_the_training_fp8_forward(recipe):
    if recipe == "mxfp8" and not MX:
        pytest.skip("fp8_recipe='mxfp8' needs torchao 0.18")
    torch.manual_seed(0)
    module = gpt(GPT)
    plugin = FabricPlugin("fp8", fp8_recipe=recipe, fp8_modules=[nn.Linear])
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-3))
    for x, y in loader(0):
        fabric.backward(F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)))
        opt.step()
        opt.zero_grad()
    x, y = next(iter(loader(1)))
    trained = model(x).detach()  # the training step's forward on the trained weights
    with torch.no_grad():
        no_grad = model(x)
    with torch.inference_mode():
        inference = model(x)
    assert torch.equal(no_grad, trained) and torch.equal(inference, trained)
    plugin.core.fp8.remove()  # the same weights, every Linear back to bf16
    with torch.inference_mode():
        bf16 = model(x)
    plugin.teardown()
    assert not torch.equal(inference, bf16)
    loss_fp8, loss_bf16 = (F.cross_entropy(out.float().reshape(-1, VOCAB), y.reshape(-1)) for out in (inference, bf16))
    assert abs(loss_fp8 - loss_bf16) <= TOLERANCE * loss_bf16


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_a_norm_named_in_fp8_modules_is_refused_at_setup_by_both_front_ends(front_end):
    model = gpt(GPT)
    match = r"fp8_modules entry 'ln_f' names 'ln_f', a LayerNorm, which holds no nn.Linear"
    with pytest.raises(ValueError, match=match):
        if front_end == "trainer":
            trainer(MixedPrecisionPlugin("fp8", fp8_modules=["ln_f"]), max_steps=1).fit(model, loader(0))
        else:
            fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricPlugin("fp8", fp8_modules=["ln_f"])])
            model, _ = fabric.setup(model, torch.optim.AdamW(model.parameters()))
            model(next(iter(loader(0)))[0])  # Fabric sets the precision up at the first forward
