"""precision="fp8" without a Trainer: the arguments checked, the missing-torchao error, which Linears the default
and a list choose, and a chosen Linear's forward: torchao's FP8 matmul inside the run's autocast, the Linear's own
outside it and in copies, gone at teardown."""

import builtins
import copy
import dataclasses
import math
import pickle
import re

import pytest
import torch
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.fabric import MixedPrecisionPlugin as FabricPlugin
from lightning_mp.fp8 import Fp8Linears, Fp8Settings
from lightning_mp.fp8.selection import choose, too_small

torchao = pytest.importorskip("torchao", reason="precision='fp8' needs torchao: pip install 'lightning_mp[fp8]'")


@pytest.mark.parametrize("cls", [MixedPrecisionPlugin, FabricPlugin])
@pytest.mark.parametrize("recipe", ["row-wise", "ROWWISE", None, 8, "float8"])
def test_a_bad_fp8_recipe_is_named_with_what_is_allowed(cls, recipe):
    with pytest.raises(ValueError, match=r"fp8_recipe=.* is not allowed: use one of 'tensorwise', 'rowwise'"):
        cls("fp8", fp8_recipe=recipe)


@pytest.mark.parametrize("modules", ["all", "mlp", [], (), [3], [""], [torch.float32], None])
def test_bad_fp8_modules_are_named_with_what_is_allowed(modules):
    with pytest.raises(ValueError, match=r"fp8_modules=.* is not allowed.*'default'.*names.*classes"):
        MixedPrecisionPlugin("fp8", fp8_modules=modules)


def test_fp8_arguments_are_checked_under_every_precision():
    with pytest.raises(ValueError, match="fp8_recipe="):
        MixedPrecisionPlugin("bf16", fp8_recipe="rowwse")  # a typo is found even where FP8 is off


@pytest.mark.parametrize("cls", [MixedPrecisionPlugin, FabricPlugin])
@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed", "fp16", "fp32"])
@pytest.mark.parametrize(("knob", "value", "shown"), [
    ("fp8_recipe", "tensorwise", "'tensorwise'"),
    ("fp8_modules", [nn.Linear, "mlp"], "[Linear, 'mlp']"),
    ("fp8_modules", "auto", "'auto'"),
])
def test_an_fp8_knob_under_a_precision_without_fp8_is_refused_not_ignored(cls, precision, knob, value, shown):
    """They ran plain bf16 (fp16, fp32) with no word: the user thought some Linears computed in FP8."""
    with pytest.raises(ValueError, match=rf"{knob}={re.escape(shown)} is not allowed with precision='(bf16|fp16|fp32)'"
                                         rf".*only precision='fp8'.*HINT: MixedPrecisionPlugin\('fp8', {knob}="):
        cls(precision, **{knob: value})
    cls(precision, fp8_recipe="rowwise", fp8_modules="default")  # the defaults are what every precision has


def test_without_torchao_fp8_says_what_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name == "torchao" or name.startswith("torchao."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    for cls in (MixedPrecisionPlugin, FabricPlugin):
        with pytest.raises(ImportError, match=r"pip install 'lightning_mp\[fp8\]'"):
            cls("fp8")
    MixedPrecisionPlugin("bf16")  # the other precisions never import it


class Model(nn.Module):
    """An embedding, two large Linears (above torchao's rowwise rule), a small one, a tied head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4096, 4096)
        self.up = nn.Linear(4096, 8192)  # N=8192, K=4096: FP8 under both rules
        self.down = nn.Linear(8192, 4096)  # N=4096, K=8192
        self.small = nn.Linear(4096, 1024)  # N=1024: too small for both
        self.odd = nn.Linear(4096, 4100)  # not a multiple of 16
        self.norm = nn.LayerNorm(4096)
        self.head = nn.Linear(4096, 4096, bias=False)
        self.head.weight = self.emb.weight


def keeps_norms(module):
    return isinstance(module, (nn.LayerNorm, nn.Embedding))


def test_torchaos_measured_size_rule():
    assert too_small("rowwise", 2048, 8192) and too_small("rowwise", 8192, 1024)
    assert too_small("rowwise", 4096, 2048) and not too_small("rowwise", 4096, 4096)
    assert too_small("tensorwise", 1024, 4096) and not too_small("tensorwise", 1024, 8192)
    assert not too_small("tensorwise", 2048, 1024)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_default_keeps_the_head_small_and_odd_gemms_in_bf16(recipe):
    with torch.device("meta"):
        model = Model()
    chosen, kept = choose(model, recipe, "default", keeps_norms, 16)
    assert [name for name, _ in chosen] == ["up", "down"]
    assert kept["the output head"] == ["head"]
    assert kept[f"below torchao's {recipe} size rule"] == ["small"]
    assert kept["dimensions not multiples of 16"] == ["odd"]


def test_a_list_of_names_and_classes_chooses_their_linears():
    with torch.device("meta"):
        model = nn.Sequential(Model(), nn.Sequential(nn.Linear(32, 32), nn.ReLU()))
    chosen, _ = choose(model, "rowwise", ("0.small", nn.Sequential), keeps_norms, 16)
    names = [name for name, _ in chosen]
    assert names[0] == "0.small" and "1.0" in names and "0.up" in names  # the root Sequential holds them all
    chosen, _ = choose(model, "rowwise", ("head",), keeps_norms, 16)
    assert [name for name, _ in chosen] == ["0.head"]  # a dotted suffix; named, the head is the user's choice


def test_a_list_entry_that_matches_nothing_or_names_an_odd_linear_raises_at_setup():
    with torch.device("meta"):
        model = Model()
    with pytest.raises(ValueError, match=r"fp8_modules entry 'mlp' matches no module of Model.*'up'"):
        choose(model, "rowwise", ("mlp",), keeps_norms, 16)
    with pytest.raises(ValueError, match=r"fp8_modules entry 'odd' names 'odd', an nn.Linear\(4096, 4100\).*16"):
        choose(model, "rowwise", ("odd",), keeps_norms, 16)
    chosen, kept = choose(model, "mxfp8", (nn.Linear,), keeps_norms, 32)
    assert "odd" in kept["dimensions not multiples of 32"] and "odd" not in dict(chosen)


def test_a_list_entry_naming_a_module_without_linears_raises_at_setup():
    """A LayerNorm named in fp8_modules put nothing in FP8, and only describe() hinted at it."""
    with torch.device("meta"):
        model = Model()
    with pytest.raises(ValueError, match=r"fp8_modules entry 'norm' names 'norm', a LayerNorm, which holds no "
                                         r"nn.Linear: nothing of it would compute in FP8.*HINT:.*'up'"):
        choose(model, "rowwise", ("norm", nn.Linear), keeps_norms, 16)
    with pytest.raises(ValueError, match=r"fp8_modules entry LayerNorm names '1' and 1 more, a LayerNorm"):
        choose(nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.LayerNorm(32)), "rowwise", (nn.LayerNorm,),
               keeps_norms, 16)
    chosen, _ = choose(nn.Sequential(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32))), "rowwise", ("0",),
                       keeps_norms, 16)
    assert [name for name, _ in chosen] == ["0.1"]  # a block holding a norm and a Linear: its Linear


class OwnForward(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_linears_with_their_own_forward_and_in_fp32_subtrees_stay():
    model = nn.Sequential(OwnForward(32, 32), nn.LayerNorm(32), nn.Linear(32, 32))
    model[1].inner = nn.Linear(32, 32)  # inside a kept (FP32) module
    chosen, kept = choose(model, "rowwise", (nn.Linear,), keeps_norms, 16)
    assert [name for name, _ in chosen] == ["2"]
    assert kept["a Linear subclass with its own forward"] == ["0"]


def torchao_float8_linear(linear, recipe):
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return Float8Linear.from_float(copy.deepcopy(linear), config=config)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_a_chosen_linear_computes_what_torchaos_float8linear_computes_and_is_its_own_again_after(recipe):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).bfloat16()
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    reference = torchao_float8_linear(linear, recipe)
    expected = reference(x)  # outside autocast torchao's module computes on its bf16 input as given
    expected.float().square().sum().backward()
    expected_grads = x.grad.clone(), reference.weight.grad.clone()
    x.grad = None

    fp8 = Fp8Linears("fp8", Fp8Settings(recipe, (nn.Linear,)))
    line = fp8.attach(linear, "cpu", torch.bfloat16, lambda m: False)
    assert line.startswith(f"fp8: 1 of 1 Linears compute through torchao's {recipe!r} recipe") and "emulated" in line
    assert type(linear) is nn.Linear and "forward" in vars(linear)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(x)
    out.float().square().sum().backward()
    assert torch.equal(out, expected)
    assert torch.equal(x.grad, expected_grads[0]) and torch.equal(linear.weight.grad, expected_grads[1])

    plain = nn.functional.linear(x.detach(), linear.weight, linear.bias)
    assert torch.equal(linear(x.detach()), plain)  # outside the run's autocast: the Linear's own computation
    clone = copy.deepcopy(linear)
    pickled = pickle.loads(pickle.dumps(linear))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for other in (clone, pickled):  # copies made during the fit compute as plain Linears
            assert torch.equal(other(x.detach()), nn.functional.linear(x.detach(), other.weight, other.bias))
    fp8.remove()
    assert "forward" not in vars(linear) and type(linear) is nn.Linear


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"])
def test_under_inference_mode_a_chosen_linear_computes_the_training_fp8_forward_bit_for_bit(recipe):
    """Lightning's validate, test and predict run under torch.inference_mode, where rowwise recipes raised torchao's
    "aten.reshape.default with axiswise scaling is not supported yet" on every input (3-D and 2-D alike)."""
    if recipe == "mxfp8" and tuple(int(p) for p in torchao.__version__.split(".")[:2]) < (0, 18):
        pytest.skip("fp8_recipe='mxfp8' needs torchao 0.18")
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).bfloat16()
    fp8 = Fp8Linears("fp8", Fp8Settings(recipe, (nn.Linear,)))
    fp8.attach(linear, "cpu", torch.bfloat16, lambda m: False)
    for x in (torch.randn(4, 8, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            trained = linear(x.requires_grad_())  # the training step's forward
            with torch.no_grad():
                no_grad = linear(x)
            with torch.inference_mode():
                inference = linear(x)
                assert not torch.is_grad_enabled()  # the mode is the caller's again after the Linear
        bf16 = nn.functional.linear(x.detach(), linear.weight, linear.bias)
        assert torch.equal(inference, trained.detach()) and torch.equal(no_grad, trained.detach())
        assert not inference.requires_grad and not torch.equal(inference, bf16)  # FP8, not a bf16 fallback
    fp8.remove()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_a_chosen_linear_compiles_whole_for_training_and_under_inference_mode(recipe):
    """FP8 is fast only compiled: the evaluation's way out of inference mode must not cost a graph break per Linear
    (``torch.is_inference_mode_enabled`` cannot be traced: fullgraph raised). The compiled graph meets torchao's
    FP8 ops decomposed, so under inference mode it computes what it computes under no_grad."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # torchao's compiled FP8 alone: NaN or oneDNN's refusal
        pytest.skip("inductor's FP8 GEMMs on a CPU need bf16 arithmetic (AVX2 here: torchao's own model fails too)")
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).bfloat16()
    fp8 = Fp8Linears("fp8", Fp8Settings(recipe, (nn.Linear,)))
    fp8.attach(linear, "cpu", torch.bfloat16, lambda m: False)
    compiled = torch.compile(linear, fullgraph=True)
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                eager, no_grad = linear(x), compiled(x)
            trained = compiled(x.clone().requires_grad_())
            with torch.inference_mode():
                inference = compiled(x)
    finally:
        fp8.remove()
        torch._dynamo.reset()
    ulp = 2**-7 * eager.abs().max().item()  # compiled and eager round the same FP8 product apart by a bf16 ulp
    for out in (no_grad, trained.detach(), inference):
        torch.testing.assert_close(out, eager, rtol=0, atol=ulp)
    assert torch.equal(inference, no_grad)


def test_mxfp8_runs_emulated_here_or_says_which_torchao_it_needs():
    try:
        fp8 = Fp8Linears("fp8", Fp8Settings("mxfp8", (nn.Linear,)))
    except ImportError as err:
        assert "torchao 0.18" in str(err) and tuple(int(p) for p in torchao.__version__.split(".")[:2]) < (0, 18)
        return
    linear = nn.Linear(64, 64).bfloat16()
    fp8.attach(linear, "cpu", torch.bfloat16, lambda m: False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(torch.randn(2, 32, 64, dtype=torch.bfloat16))
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        with pytest.raises(ValueError, match=r"mxfp8.*multiple of 32; this one has 20"):
            linear(torch.randn(2, 10, 64, dtype=torch.bfloat16))
    fp8.remove()


def test_describe_names_the_recipe_before_and_after_setup():
    plugin = MixedPrecisionPlugin("fp8", fp8_recipe="tensorwise")
    assert "fp8: recipe 'tensorwise'" in plugin.describe() and plugin.precision == "bf16-mixed"
    assert "fp8:" not in MixedPrecisionPlugin("bf16").describe()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_bf16_gemms_leave_torchaos_fp8_gemms_to_torchao(recipe):
    """On a CPU without bf16 arithmetic the bf16 GEMMs are emulated by kernels below autograd, which torchao's FP8
    tensors (reporting dtype bf16) reach first: the emulation must hand them on, not upcast them (it raised
    "attempting to run aten.to.dtype"). With every Linear in FP8 no bf16 GEMM is left, so emulated and native agree
    bit for bit."""
    import lightning as L

    losses = {}
    for gemm in ("native", "emulated"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        plugin = FabricPlugin("fp8", fp8_recipe=recipe, fp8_modules=[nn.Linear], gemm=gemm)
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
        losses[gemm] = []
        for _ in range(3):
            loss = model(x).float().pow(2).mean()
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses[gemm].append(loss.item())
        with torch.inference_mode():  # the emulation's dispatch mode (inference mode only) hands them on too
            losses[gemm].append(model(x).float().pow(2).mean().item())
    assert all(map(math.isfinite, losses["emulated"])) and losses["emulated"] == losses["native"]
