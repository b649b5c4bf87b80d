"""Lightning's own precision tests for Fabric (tag 2.6.5), adapted: each runs with Fabric's ``MixedPrecision`` and
with ``lightning_mp.fabric.MixedPrecisionPlugin``, on the CPU, and asserts what a Fabric loop sees (issue 38). The
facts are Lightning's; the code is ours. Fabric's fp16 runs as ``MixedPrecision("16-mixed", "cpu", scaler=...)``:
real fp16 on the CPU (``Fabric(precision="16-mixed")`` switches a CPU run to bf16). A difference of ours by design
is asserted as ours, with the sentence of ``docs/behaviour.md`` (or ``docs/fabric.md``, ``README.md``) it rests on.
Under ``pytest --device cuda`` (the CUDA suite) the tests marked ``on_device`` run both plugins on the GPU instead.

Upstream cases (``tests/tests_fabric/``; ``[n]``: parametrizations), and where each went:

=========================================================================  ============================================
upstream case                                                              here
=========================================================================  ============================================
plugins/precision/test_amp.py::test_amp_precision_default_scaler           ``test_the_default_scaler_...`` (both; the
                                                                           ``GradScaler`` type: difference)
plugins/precision/test_amp.py::test_amp_precision_scaler_with_bf16         ``test_bf16_has_no_scaler_...`` (both)
plugins/precision/test_amp.py::test_amp_precision_forward_context          ``test_the_forward_context_...`` (both; the
                                                                           ``torch.autocast`` type: difference;
                                                                           ``plugin.device``: ours too)
plugins/precision/test_amp.py::test_amp_precision_backward                 ``test_backward_scales_...`` (both)
plugins/precision/test_amp.py::test_amp_precision_optimizer_step_with_...  ``test_a_step_steps_and_moves_...`` (both)
plugins/precision/test_amp.py::test_amp_precision_optimizer_step_without_  ``test_a_closure_...`` (difference: ours
  scaler                                                                   refuses closures in Fabric)
plugins/precision/test_amp.py::test_amp_precision_parameter_validation     ``test_precision_names`` (difference: ours
                                                                           takes ``"16"``, ``16``, ``"bf16"``)
plugins/precision/test_amp_integration.py::test_amp [cpu x 2]              ``test_the_forward_sees_...`` in one
                                                                           process (both; ``"16-mixed"`` on a CPU:
                                                                           difference); two ranks: skipped, ours
                                                                           refuses them with master weights
plugins/precision/test_amp_integration.py::test_amp [cuda x 2]             as [cpu], on the CPU with real fp16
plugins/precision/test_amp_integration.py::test_amp_fused_optimizer_...    ``test_fused_and_for_loop_adam_...`` (both)
plugins/precision/test_all.py::test_default_dtype_is_restored [4]          skipped: DeepSpeed, Double, Half, FSDP
                                                                           plugins, none ours; the fact is carried to
                                                                           ``test_contexts_restore_...`` (both)
test_fabric.py::test_backward                                              ``test_backward_scales_...`` (upstream
                                                                           mocks the strategy)
test_fabric.py::test_backward_required [bf16-mixed x 2]                    ``test_fabric_backward_is_required`` (both)
test_fabric.py::test_backward_required [32-true x 2]                       ``test_..._also_in_fp32`` (difference)
test_fabric.py::test_backward_required [bf16-true x 2, fsdp x 2]           skipped: no ``*-true`` mode; FSDP on CUDA
test_fabric.py::test_autocast                                              ``test_fabric_autocast_...`` (both)
test_fabric.py::test_autocast_does_not_use_cuda_on_mps [2]                 skipped: MPS
test_fabric.py::test_init_module_context                                   ``test_init_module_...`` (both; upstream
                                                                           mocks the strategy)
test_fabric.py::test_grad_clipping [2]                                     ``test_clip_gradients_...`` (both; upstream
                                                                           mocks the strategy)
=========================================================================  ============================================
"""

from contextlib import nullcontext

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from torch import nn

from lightning_mp.fabric import MixedPrecisionPlugin
from tests.conftest import device

LIGHTNING_NAME = {"fp16": "16-mixed", "bf16": "bf16-mixed"}
DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
IMPLS = ("lightning", "ours")
INIT_SCALE = 2.0**8

both_formats = pytest.mark.parametrize("precision", ["fp16", "bf16"])
both_impls = pytest.mark.parametrize("impl", IMPLS)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def make(impl, precision, init_scale=INIT_SCALE, growth_interval=2000):
    """A fresh plugin: Fabric's ``MixedPrecision`` with a GradScaler in fp16 (both on the test's device), or ours with
    the same knobs."""
    if impl == "ours":
        knobs = dict(init_scale=init_scale, growth_interval=growth_interval) if precision == "fp16" else {}
        return MixedPrecisionPlugin(precision, **knobs)
    scaler = torch.amp.GradScaler(device(), init_scale=init_scale, growth_interval=growth_interval)
    return FabricMixedPrecision(LIGHTNING_NAME[precision], device(), scaler=scaler if precision == "fp16" else None)


def fabric_with(plugin):
    return L.Fabric(accelerator=device(), devices=1, plugins=[plugin])


def linear(n_in=4, n_out=2, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out)


# ------------------------------------------------------------------------------ plugins/precision/test_amp.py
def test_the_default_scaler_answers_what_a_gradscaler_answers():
    """test_amp.py::test_amp_precision_default_scaler: fp16 without a scaler argument gets one, with GradScaler's
    defaults (scale 2**16, growth 2 every 2000 clean steps, backoff 0.5)."""
    lightnings, ours = FabricMixedPrecision("16-mixed", "cpu").scaler, MixedPrecisionPlugin("fp16").scaler
    assert isinstance(lightnings, torch.amp.GradScaler)
    # docs/behaviour.md, "Code written for Lightning's `MixedPrecision`": "otherwise a read-only view that answers
    # what code asks a `GradScaler`"
    assert not isinstance(ours, torch.amp.GradScaler)
    assert ours.state_dict() == lightnings.state_dict()
    assert (ours.get_scale(), ours.is_enabled()) == (lightnings.get_scale(), lightnings.is_enabled()) == (2.0**16, True)
    getters = ("get_growth_factor", "get_backoff_factor", "get_growth_interval")
    assert [getattr(ours, g)() for g in getters] == [getattr(lightnings, g)() for g in getters]


@both_impls
def test_bf16_has_no_scaler_and_refuses_one(impl):
    """test_amp.py::test_amp_precision_scaler_with_bf16."""
    assert make(impl, "bf16").scaler is None
    scaler = torch.amp.GradScaler("cpu")
    if impl == "lightning":
        with pytest.raises(ValueError, match="`precision='bf16-mixed'` does not use a scaler"):
            FabricMixedPrecision("bf16-mixed", "cpu", scaler=scaler)
        return
    # ours has no scaler argument in any format: docs/behaviour.md, "Code written for Lightning's `MixedPrecision`":
    # "`scaler=` is refused with a `ValueError` naming it: the loss scaler is built in, and its knobs are the
    # plugin's own arguments (`init_scale=`, `growth_interval=`...)."
    for precision in ("bf16-mixed", "16-mixed"):
        with pytest.raises(ValueError, match=r"scaler=.* is not an argument of MixedPrecisionPlugin.*HINT"):
            MixedPrecisionPlugin(precision, scaler=scaler)


@pytest.mark.on_device
@both_impls
@both_formats
def test_the_forward_context_is_autocast_to_the_16_bit_format(impl, precision):
    """test_amp.py::test_amp_precision_forward_context (upstream: fp16 on CUDA, bf16 on the CPU)."""
    plugin = make(impl, precision)
    on = plugin.device  # ours: "cpu" until its first forward in a Fabric loop; Fabric's: the device it was made for
    assert (plugin.scaler is not None) == (precision == "fp16")
    with plugin.forward_context():
        assert torch.is_autocast_enabled(on) and torch.get_autocast_dtype(on) == DTYPE[precision]
        assert torch.get_default_dtype() == torch.float32
        assert nn.Linear(2, 2, device=on)(torch.ones(1, 2, device=on)).dtype == DTYPE[precision]
    assert not torch.is_autocast_enabled(on)
    context = plugin.forward_context()
    if impl == "lightning":
        assert isinstance(context, torch.autocast) and context.fast_dtype == DTYPE[precision]
    else:
        # docs/behaviour.md, "Code written for Lightning's `MixedPrecision`": "`torch.autocast` to the 16-bit format
        # plus GEMM emulation and the FP32 policy where they apply (not a bare `torch.autocast` object)"; "Fabric's
        # `forward_context()` is the same context."
        assert not isinstance(context, torch.autocast)


@pytest.mark.on_device
@pytest.mark.parametrize("impl", ["lightning", "ours"])
def test_the_plugin_says_its_device(impl):
    """test_amp.py::test_amp_precision_forward_context: ``assert precision.device == "cpu"``."""
    plugin = make(impl, "bf16")
    fabric_with(plugin).setup(linear())(torch.ones(1, 4, device=device()))
    assert plugin.device == device()


@pytest.mark.on_device
@both_impls
@both_formats
def test_backward_scales_the_loss_and_passes_its_arguments_on(impl, precision):
    """test_amp.py::test_amp_precision_backward and test_fabric.py::test_backward: ``fabric.backward(loss, *args,
    **kwargs)`` back-propagates the scaled loss with the caller's arguments (``retain_graph`` here: a second
    backward through the same graph works and doubles the gradients)."""
    reference = linear()
    x = torch.linspace(-1, 1, 12).view(3, 4)
    reference(x).pow(2).sum().backward()
    plugin = make(impl, precision)
    fabric = fabric_with(plugin)
    model = fabric.setup(linear())
    loss = model(x.to(fabric.device)).float().pow(2).sum()
    fabric.backward(loss, retain_graph=True)
    first = model.weight.grad.clone()
    fabric.backward(loss)
    assert torch.equal(model.weight.grad, 2 * first)
    scale = plugin.scaler.get_scale() if precision == "fp16" else 1.0
    assert scale == (INIT_SCALE if precision == "fp16" else 1.0)
    torch.testing.assert_close((first / scale).cpu(), reference.weight.grad, rtol=2e-2, atol=2e-2)  # a 16-bit forward


@pytest.mark.on_device
@both_impls
@both_formats
def test_a_step_steps_and_moves_the_scale_once(impl, precision):
    """test_amp.py::test_amp_precision_optimizer_step_with_scaler (GradScaler.step and .update, once each): with
    ``growth_interval=1`` one clean step doubles the scale."""
    plugin = make(impl, precision, growth_interval=1)
    fabric = fabric_with(plugin)
    module = linear()
    model, opt = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    before = model.weight.detach().clone()
    fabric.backward(model(torch.ones(2, 4, device=fabric.device)).float().sum())
    opt.step()
    assert not torch.equal(before, model.weight)
    if precision == "fp16":
        assert plugin.scaler.get_scale() == 2 * INIT_SCALE and plugin.scaler.state_dict()["_growth_tracker"] == 0


@pytest.mark.on_device
@both_impls
@both_formats
def test_a_closure_given_to_the_step(impl, precision):
    """test_amp.py::test_amp_precision_optimizer_step_without_scaler: without a scaler, Fabric's plugin hands the
    optimizer what the loop passes (a ``closure`` is all Fabric's optimizer wrapper takes); with one, torch's
    GradScaler refuses a closure. Ours passes it on in both formats (docs/fabric.md, "Closures: LBFGS and SAM"): the
    closure's backward is scaled, unscaled and checked before the optimizer reads the gradients."""
    fabric = fabric_with(make(impl, precision))
    module = linear()
    model, opt = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))

    def closure():
        opt.zero_grad()
        loss = model(torch.ones(2, 4, device=fabric.device)).float().sum()
        fabric.backward(loss)
        return loss

    if impl != "ours" and precision == "fp16":
        with pytest.raises(RuntimeError, match="Closure use is not currently supported if GradScaler is enabled"):
            opt.step(closure=closure)
    else:
        before = model.weight.detach().clone()
        assert torch.is_tensor(opt.step(closure=closure)) and not torch.equal(before, model.weight)


def test_precision_names():
    """test_amp.py::test_amp_precision_parameter_validation: Fabric's MixedPrecision takes only ``"16-mixed"`` and
    ``"bf16-mixed"``."""
    for name in ("16", 16, "bf16"):
        with pytest.raises(ValueError, match="Precision must be '16-mixed' or 'bf16-mixed'"):
            FabricMixedPrecision(name, "cpu")
    # README.md, the plugin's arguments: "`"bf16"`, `"fp16"` or `"fp32"`; aliases `"bf16-mixed"`, `"16-mixed"`,
    # `"16"`, `"32-true"`, `"32"`"
    names = {name: MixedPrecisionPlugin(name).format.name for name in ("16-mixed", "bf16-mixed", "16", 16, "bf16")}
    assert names == {"16-mixed": "fp16", "bf16-mixed": "bf16", "16": "fp16", 16: "fp16", "bf16": "bf16"}
    for name in ("16-true", "bf16-true"):  # HalfPrecision's names: 16-bit weights, no masters
        with pytest.raises(ValueError, match=f"precision='{name}' is not supported.*HINT"):
            MixedPrecisionPlugin(name)


# ------------------------------------------------------------------ plugins/precision/test_amp_integration.py
class MixedPrecisionModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(32, 2)
        self.seen = []

    def forward(self, x):
        output = self.layer(x)
        self.seen.append((x.dtype, torch.is_autocast_enabled(x.device.type), output.dtype))
        return output


@pytest.mark.parametrize(
    "impl, given, expected",
    [
        ("lightning", "16-mixed", torch.float16),  # the plugin itself: real fp16
        ("lightning", "bf16-mixed", torch.bfloat16),
        ("lightning-string", "16-mixed", torch.bfloat16),  # Fabric(precision="16-mixed") on a CPU
        ("lightning-string", "bf16-mixed", torch.bfloat16),
        ("ours", "16-mixed", torch.float16),
        ("ours", "bf16-mixed", torch.bfloat16),
    ],
)
@pytest.mark.on_device
def test_the_forward_sees_16_bit_inputs_and_the_loop_fp32_tensors(impl, given, expected):
    """test_amp_integration.py::test_amp, in one process: inside ``forward`` the input and the output are 16-bit
    under autocast; outside, the output, the weights and their gradients are FP32. Two ranks (upstream's
    ``ddp_spawn``) are left out: docs/fabric.md, "What differs from the Trainer plugin": "Master weights run in one
    process: several ranks are refused at the first forward with a hint.\""""
    precision = {"16-mixed": "fp16", "bf16-mixed": "bf16"}[given]
    if impl == "lightning-string":
        switched = pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU")
        if device() == "cuda":  # Fabric switches "16-mixed" to bf16 on a CPU only: on a GPU it is real fp16
            switched, expected = nullcontext(), DTYPE[precision]
        with switched if precision == "fp16" else nullcontext():
            fabric = L.Fabric(accelerator=device(), devices=1, precision=given)
    else:
        knobs = dict(init_scale=INIT_SCALE) if precision == "fp16" else {}  # 2**16 overflows this net's first step
        fabric = fabric_with(make(impl, precision) if impl == "lightning" else MixedPrecisionPlugin(given, **knobs))
    # ours under "16-mixed": docs/behaviour.md, comparison table: "| `precision="16-mixed"` on a CPU | switches to
    # `bf16-mixed`, with a warning | real fp16 |"
    torch.manual_seed(0)
    module = MixedPrecisionModule()
    model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=0.1))
    batch = torch.rand(2, 32, device=fabric.device)
    assert model.layer.weight.dtype == batch.dtype == torch.float32
    output = model(batch)
    assert output.dtype == torch.float32
    assert module.seen == [(expected, True, expected)]
    fabric.backward(nn.functional.mse_loss(output, torch.ones_like(output)))
    assert model.layer.weight.grad.dtype == torch.float32
    before = model.layer.weight.detach().clone()
    optimizer.step()
    optimizer.zero_grad()
    assert not torch.equal(before, model.layer.weight)


@pytest.mark.on_device
@both_impls
@both_formats
def test_fused_and_for_loop_adam_train_alike(impl, precision):
    """test_amp_integration.py::test_amp_fused_optimizer_parity (CUDA fp16 upstream; torch has a fused CPU Adam)."""
    runs = []
    for fused in (False, True):
        fabric = fabric_with(make(impl, precision))
        model = linear(10, 10, seed=1234)
        model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused))
        g = torch.Generator().manual_seed(1)
        data, target = torch.randn(10, 10, generator=g), torch.randn(10, 10, generator=g)
        data, target = data.to(fabric.device), target.to(fabric.device)
        losses = []
        for _ in range(5):
            optimizer.zero_grad()
            loss = (model(data) - target).abs().sum()
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.detach())
        runs.append((torch.stack(losses), list(model.parameters())))
    (losses, params), (losses_fused, params_fused) = runs
    torch.testing.assert_close(losses, losses_fused)
    for p, q in zip(params, params_fused):
        torch.testing.assert_close(p, q)
    assert losses[-1] < losses[0]


# ------------------------------------------------------------------------------ plugins/precision/test_all.py
@pytest.mark.on_device
@both_impls
@both_formats
def test_contexts_restore_autocast_and_the_default_dtype_after_an_error(impl, precision):
    """test_all.py::test_default_dtype_is_restored, for the mixed plugins: neither context changes the default
    dtype, the forward's turns autocast on, and both undo everything when the block raises."""
    plugin = make(impl, precision)
    for context in (plugin.module_init_context, plugin.forward_context):
        with pytest.raises(RuntimeError, match="foo"), context():
            assert torch.get_default_dtype() is torch.float32
            raise RuntimeError("foo")
        assert torch.get_default_dtype() is torch.float32 and not torch.is_autocast_enabled(plugin.device)


# ---------------------------------------------------------------------------------------------- test_fabric.py
@pytest.mark.on_device
@both_impls
@both_formats
@pytest.mark.parametrize("setup_method", ["setup", "setup_module"])
def test_fabric_backward_is_required(impl, precision, setup_method):
    """test_fabric.py::test_backward_required [bf16-mixed]: a mixed plugin needs ``fabric.backward(loss)``; a bare
    ``loss.backward()`` raises, for one model, two chained, and a model returning a dict."""
    fabric = fabric_with(make(impl, precision))
    batch = torch.rand(2, 2, device=fabric.device)
    model1, model2 = (getattr(fabric, setup_method)(linear(2, 2, seed=s)) for s in (0, 1))

    class DictReturn(nn.Linear):
        def forward(self, x):
            return {"loss": super().forward(x).sum(), "other": torch.rand(2, 2)}

    model3 = getattr(fabric, setup_method)(DictReturn(2, 2))
    for forward in (lambda: model1(batch).sum(), lambda: model2(model1(batch)).sum(), lambda: model3(batch)["loss"]):
        with pytest.raises(RuntimeError, match=r"requires you to call `fabric.backward\(loss\)`"):
            forward().float().backward()
        fabric.backward(forward().float())  # no error


@pytest.mark.on_device
def test_fabric_backward_is_required_also_in_fp32():
    """test_fabric.py::test_backward_required [32-true]: Fabric's default precision lets ``loss.backward()`` through.
    docs/behaviour.md, "Code written for Lightning's `MixedPrecision`": "ours wants `fabric.backward(loss)` in every
    format, also in `"fp32"`, where Fabric's `32-true` lets `loss.backward()` through"."""
    batch = torch.rand(2, 2, device=device())
    plain = L.Fabric(accelerator=device(), devices=1).setup(linear(2, 2))
    plain(batch).sum().backward()  # no error
    fabric = fabric_with(MixedPrecisionPlugin("fp32"))
    model = fabric.setup(linear(2, 2))
    with pytest.raises(RuntimeError, match=r"requires you to call `fabric.backward\(loss\)`"):
        model(batch).sum().backward()
    fabric.backward(model(batch).sum())


@pytest.mark.on_device
@both_impls
@both_formats
def test_fabric_autocast_enters_the_plugins_forward_context(impl, precision):
    """test_fabric.py::test_autocast (upstream mocks the context and checks it is entered and exited)."""
    plugin = make(impl, precision)
    fabric = fabric_with(plugin)
    on = plugin.device  # ours: "cpu" until its first forward (no model is set up here); Fabric's: the fabric's
    layer, x = nn.Linear(2, 2, device=on), torch.ones(1, 2, device=on)
    with fabric.autocast():
        assert torch.get_autocast_dtype(on) == DTYPE[precision]
        assert layer(x).dtype == DTYPE[precision]
    assert not torch.is_autocast_enabled(on) and layer(x).dtype == torch.float32


@pytest.mark.on_device
@both_impls
@both_formats
def test_init_module_builds_fp32_parameters(impl, precision):
    """test_fabric.py::test_init_module_context (upstream checks the strategy's context is called): under a mixed
    plugin the parameters are built in FP32."""
    fabric = fabric_with(make(impl, precision))
    with fabric.init_module():
        module = nn.Linear(2, 2)
    assert module.weight.dtype == torch.float32 and fabric.setup(module).weight.dtype == torch.float32


@pytest.mark.on_device
@both_formats
@pytest.mark.parametrize("clip_val, max_norm", [(1e-3, None), (None, 1.0)])
def test_clip_gradients_clips_the_true_gradients(precision, clip_val, max_norm):
    """test_fabric.py::test_grad_clipping [2] (upstream checks which strategy method is called): by value or by norm,
    on the unscaled gradients; the returned norm is the true one, the same under both plugins."""
    norms = {}
    for impl in IMPLS:
        fabric = fabric_with(make(impl, precision))
        module = linear(1, 1)
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=1e-3))
        fabric.backward(model(torch.full((4, 1), 8.0, device=fabric.device)).float().sum())
        norms[impl] = fabric.clip_gradients(model, optimizer, max_norm=max_norm, clip_val=clip_val)
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        if clip_val is not None:
            assert norms[impl] is None and torch.equal(grads, torch.full_like(grads, clip_val))
        else:
            assert grads.norm() == pytest.approx(max_norm, rel=1e-4)
    if max_norm is not None:
        true_norm = torch.tensor([4 * 8.0, 4.0]).norm()  # d/dw and d/db of sum(w * 8 + b) over 4 rows
        assert norms["ours"] == norms["lightning"] == pytest.approx(true_norm.item(), rel=1e-2)
