"""Emulated 16-bit GEMMs: op coverage (dtype, gradients, 1-ulp match), the gemm= knob, the warning."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import lightning_mp.gemm.emulation as ge
import lightning_mp.gemm.support as gs
from lightning_mp.gemm.emulation import EmulatedGemmMode, GemmEmulation
from lightning_mp.gemm.ops import FAMILIES
from tests.conftest import cuda
from tests.test_gemm_support import mock_cpu

HALF = (torch.bfloat16, torch.float16)


pytestmark = pytest.mark.usefixtures("fresh_gemm_detection")



class Recorder(TorchDispatchMode):
    """Pushed *below* EmulatedGemmMode: sees the calls the emulation makes, with the dtypes the kernels get."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, set[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtypes = {a.dtype for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor) and a.is_floating_point()}
        self.calls.append((func.overloadpacket.__name__, dtypes))
        return func(*args, **kwargs)

    def gemms(self):
        names = {op.overloadpacket.__name__ for op in ge.EMULATED_OPS}
        return [(name, dtypes) for name, dtypes in self.calls if name in names]


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest number of representable 16-bit values between matching elements (0 = bit-identical)."""

    def ordered(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return int((ordered(a) - ordered(b)).abs().max())


# ------------------------------------------------------------------------------------------------ op coverage
def _t(*shape, dtype, seed, grad=True):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x.requires_grad_(grad)


def op_cases(dtype, exact=False):
    """name -> (inputs, fn); every case is something a transformer or a convnet runs. ``exact=True``: the same
    16-bit values (inputs and module weights) in float64, for the exact result."""
    t = lambda *shape, seed, grad=True: _t(*shape, dtype=dtype, seed=seed, grad=grad)  # noqa: E731
    torch.manual_seed(0)
    lin = nn.Linear(16, 24).to(dtype).to(torch.float64 if exact else dtype)
    return {
        "mm": ((t(5, 16, seed=1), t(16, 7, seed=2)), torch.mm),
        "addmm": ((t(7, seed=3), t(5, 16, seed=1), t(16, 7, seed=2)), torch.addmm),
        "bmm": ((t(3, 5, 16, seed=1), t(3, 16, 7, seed=2)), torch.bmm),
        "baddbmm": ((t(3, 5, 7, seed=3), t(3, 5, 16, seed=1), t(3, 16, 7, seed=2)), torch.baddbmm),
        "addbmm": ((t(5, 7, seed=3), t(3, 5, 16, seed=1), t(3, 16, 7, seed=2)), torch.addbmm),
        "mv": ((t(5, 16, seed=1), t(16, seed=2)), torch.mv),
        "addmv": ((t(5, seed=3), t(5, 16, seed=1), t(16, seed=2)), torch.addmv),
        "dot": ((t(16, seed=1), t(16, seed=2)), torch.dot),
        "linear 3-D": ((t(2, 5, 16, seed=1),), lin),
        "matmul 4-D": ((t(2, 3, 5, 16, seed=1), t(2, 3, 16, 7, seed=2)), torch.matmul),
        "einsum": ((t(2, 5, 16, seed=1), t(2, 7, 16, seed=2)), lambda a, b: torch.einsum("bik,bjk->bij", a, b)),
        "conv1d": ((t(2, 3, 12, seed=1), t(4, 3, 3, seed=2), t(4, seed=3)), F.conv1d),
        "conv2d": ((t(2, 3, 8, 8, seed=1), t(4, 3, 3, 3, seed=2), t(4, seed=3)), lambda x, w, b: F.conv2d(x, w, b, padding=1)),
        "conv_transpose2d": ((t(2, 3, 6, 6, seed=1), t(3, 4, 3, 3, seed=2)), F.conv_transpose2d),
    }


def composite_cases(dtype):
    """Modules that chain several rounded ops: compared with the native path at the output's scale."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).to(dtype)
    x = _t(2, 6, 16, dtype=dtype, seed=1)
    return {
        "multihead attention": ((x,), lambda x: mha(x, x, x)[0]),
        "multihead attention, no weights": ((x,), lambda x: mha(x, x, x, need_weights=False)[0]),
        "linear-gelu-linear": ((x,), nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).to(dtype)),
    }


ATTENTION = {
    # the fused CPU flash kernel; its native 16-bit version rounds the probabilities to 16 bits before P @ V
    "sdpa causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "sdpa float mask": lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.arange(64.0, dtype=q.dtype).view(8, 8) / 16 - 2  # exact in every format
    ),
}
CASE_NAMES = list(op_cases(torch.float32))
# native 16-bit kernels that round partial results to 16 bits inside (addbmm sums per-batch 16-bit products; the
# flash kernel rounds its probabilities; fp16 transposed convolution accumulates in fp16 on the CPU): emulation is
# closer to the exact result than they are, so these are compared with the exact result only
NATIVE_ROUNDS_INSIDE = {"addbmm", "conv_transpose2d"}


HOW = ("mode", "kernels")  # EmulatedGemmMode, or a run's kernels at ADInplaceOrView (GemmEmulation after setup)


@contextlib.contextmanager
def emulating(dtype, how: str = "mode"):
    """Emulation of ``dtype`` GEMMs the way ``how`` says (the kernels: registered for the block only)."""
    if how == "mode":
        with EmulatedGemmMode(dtype):
            yield
        return
    run = GemmEmulation("emulated")
    with _disable_current_modes():  # the support probe's native GEMMs are not the code under test
        run.setup("cpu", dtype)
    try:
        with run.context():
            yield
    finally:
        run.remove()


def _run(fn, inputs, emulate: bool, dtype, how: str = "mode"):
    """Forward and backward, with emulation around both as the plugin does; returns (out, grads, gemm calls seen)."""
    inputs = [x.detach().requires_grad_() for x in inputs]
    recorder = Recorder()
    with recorder, (emulating(dtype, how) if emulate else contextlib.nullcontext()):
        out = fn(*inputs)
        out.float().pow(2).sum().backward()
    return out, [x.grad for x in inputs], recorder.gemms()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("how", HOW)
def test_every_gemm_runs_in_fp32_returns_16_bit_and_matches_the_native_kernel(dtype, name, how):
    inputs, fn = op_cases(dtype)[name]
    _, exact_fn = op_cases(dtype, exact=True)[name]
    out, grads, kernels = _run(fn, inputs, emulate=True, dtype=dtype, how=how)
    assert out.dtype == dtype
    assert kernels, "no GEMM reached the kernels"
    assert all(dtypes <= {torch.float32} for _, dtypes in kernels), f"a 16-bit GEMM kernel ran: {kernels}"
    assert all(g is not None and g.dtype == dtype and torch.isfinite(g).all() for g in grads)

    exact = exact_fn(*[x.detach().double() for x in inputs]).to(dtype)
    assert ulp_distance(out, exact) <= 1  # FP32 inside, one rounding at the end

    native_out, native_grads, native_kernels = _run(fn, inputs, emulate=False, dtype=dtype)
    assert any(dtypes == {dtype} for _, dtypes in native_kernels)
    if name not in NATIVE_ROUNDS_INSIDE:
        assert ulp_distance(out, native_out) <= 1
    for g, ng in zip(grads, native_grads):
        # gradients chain two or three rounded ops: each may differ by an ulp, relative to their scale
        assert (g.double() - ng.double()).abs().max() <= 4 * torch.finfo(dtype).eps * ng.double().abs().max()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(composite_cases(torch.float32)))
@pytest.mark.parametrize("how", HOW)
def test_modules_of_several_gemms_match_the_native_path_at_their_scale(dtype, name, how):
    inputs, fn = composite_cases(dtype)[name]
    out, grads, kernels = _run(fn, inputs, emulate=True, dtype=dtype, how=how)
    native_out, native_grads, _ = _run(fn, inputs, emulate=False, dtype=dtype)
    assert out.dtype == dtype and kernels and all(d <= {torch.float32} for _, d in kernels)
    for a, b in [(out, native_out), *zip(grads, native_grads)]:
        assert a.dtype == dtype
        assert (a.double() - b.double()).abs().max() <= 4 * torch.finfo(dtype).eps * b.double().abs().max()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(ATTENTION))
@pytest.mark.parametrize("how", HOW)
def test_attention_runs_in_fp32_and_is_correctly_rounded(dtype, name, how):
    inputs = [_t(2, 4, 8, 16, dtype=dtype, seed=s) for s in (1, 2, 3)]
    out, grads, kernels = _run(ATTENTION[name], inputs, emulate=True, dtype=dtype, how=how)
    native_out, _, _ = _run(ATTENTION[name], inputs, emulate=False, dtype=dtype)
    assert out.dtype == dtype and all(g.dtype == dtype and torch.isfinite(g).all() for g in grads)
    assert any("flash_attention" in n for n, _ in kernels) and all(d <= {torch.float32} for _, d in kernels)
    exact = ATTENTION[name](*[x.detach().double() for x in inputs]).to(dtype)
    assert ulp_distance(out, exact) <= 1  # FP32 inside, one rounding at the end
    # the native kernel is itself off by up to an ulp at the output's scale; emulation is no further than that
    scale = torch.finfo(dtype).eps * exact.double().abs().max()
    assert (out.double() - native_out.double()).abs().max() <= scale


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("dtype", HALF)
def test_fused_inference_kernels_are_emulated(dtype, how):
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True).to(dtype).eval()
    x = _t(2, 6, 16, dtype=dtype, seed=1, grad=False)
    recorder = Recorder()
    with torch.no_grad(), recorder, emulating(dtype, how):
        out = layer(x)
    with torch.no_grad():
        native = layer(x)
    assert out.dtype == dtype
    assert ("_transformer_encoder_layer_fwd", {torch.float32}) in recorder.calls
    assert (out.double() - native.double()).abs().max() <= 4 * torch.finfo(dtype).eps * native.double().abs().max()


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("dtype", HALF)
def test_inference_mode_emulates_composite_ops_like_no_grad(dtype, how):
    """Under inference_mode (Lightning's validate/test/predict) conv2d, linear and matmul reach the mode whole; they
    are decomposed under it, so their GEMMs still run in FP32, with the same bits as under no_grad."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)).to(dtype).eval()
    x = _t(4, 3, 8, 8, dtype=dtype, seed=3, grad=False)
    results = {}
    for ctx in (torch.no_grad, torch.inference_mode):
        recorder = Recorder()
        with ctx(), recorder, emulating(dtype, how):
            results[ctx] = torch.matmul(model(x), _t(10, 5, dtype=dtype, seed=4, grad=False))
        gemms = recorder.gemms()
        assert [name for name, _ in gemms] == ["convolution", "addmm", "mm"]
        assert all(dtypes == {torch.float32} for _, dtypes in gemms)
    assert results[torch.inference_mode].dtype == dtype
    assert torch.equal(results[torch.no_grad], results[torch.inference_mode])


@pytest.mark.parametrize("how", HOW)
def test_saved_activations_stay_16_bit(how):
    """Autograd saves what the op it records gets: the 16-bit tensors, as without emulation."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)).to(torch.float16)
    x = torch.randn(4, 3, 8, 8).to(torch.float16)

    def saved(emulate):
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            with emulating(torch.float16, how) if emulate else contextlib.nullcontext():
                model(x).sum()
        return sorted((str(t.dtype), t.numel()) for t in packed if t.is_floating_point())

    assert saved(emulate=True) == saved(emulate=False)
    assert all(dtype == "torch.float16" for dtype, _ in saved(emulate=True))


@pytest.mark.parametrize("how", HOW)
def test_autocast_does_not_cast_the_fp32_gemm_back_down(how):
    lin, x = nn.Linear(32, 16), torch.randn(8, 32)
    recorder = Recorder()
    with torch.autocast("cpu", dtype=torch.float16), recorder, emulating(torch.float16, how):
        out = lin(x)
    with torch.autocast("cpu", dtype=torch.float16):
        native = lin(x)
    assert out.dtype == torch.float16
    assert recorder.gemms() == [("addmm", {torch.float32})]
    assert ulp_distance(out, native) <= 1


def test_other_dtypes_pass_through_untouched():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    h = a.to(torch.float16)
    with EmulatedGemmMode(torch.bfloat16):
        fp32, fp16 = a @ b, h @ h
    assert fp32.dtype == torch.float32 and torch.equal(fp32, a @ b)
    assert fp16.dtype == torch.float16 and torch.equal(fp16, h @ h)


def test_the_mode_refuses_a_non_16_bit_dtype():
    with pytest.raises(ValueError, match=r"dtype=torch\.float32 is not allowed.*bfloat16.*float16"):
        EmulatedGemmMode(torch.float32)


# ------------------------------------------------------------------------------------------- ResNet convolutions
# (batch, in channels, side, out channels, kernel, stride, padding, groups, transposed, bias): the convolutions of a
# torchvision/timm ResNet-18 at small sizes, plus a grouped and a transposed one
RESNET_CONVS = {
    "7x7 stride-2 stem, bias": (4, 3, 16, 16, 7, 2, 3, 1, False, True),
    "3x3": (4, 16, 8, 16, 3, 1, 1, 1, False, False),
    "3x3 stride 2": (4, 16, 8, 32, 3, 2, 1, 1, False, False),
    "1x1 stride-2 downsample": (4, 16, 8, 32, 1, 2, 0, 1, False, False),
    "3x3 stride 2 on a 1x1 map": (4, 32, 1, 64, 3, 2, 1, 1, False, False),  # ResNet-18's last stage at 16x16 images
    "3x3 grouped, bias": (4, 16, 8, 16, 3, 1, 1, 4, False, True),
    "3x3 stride-2 transposed, bias": (4, 16, 4, 8, 3, 2, 1, 1, True, True),
}


def _grid(*shape, generator):
    """Multiples of 2^-6 in [-1, 1]: exact in bf16 and fp16, their products multiples of 2^-12, and any sum of a few
    hundred of them exact in FP32 (22 bits) in any order. The exact result then does not depend on how a kernel orders
    its FP32 accumulation, and one rounding of it is the correctly rounded value: what a native 16-bit kernel with FP32
    accumulators (tensor cores, oneDNN's AVX512-BF16 and AMX kernels) returns. Results need up to 14 bits: rounding to
    bf16 (8) and fp16 (11) is exercised."""
    return torch.randint(-64, 65, shape, generator=generator).float() / 64


def _resnet_conv(name, dtype, channels_last, run):
    """Forward and backward of one convolution through autograd, as a model runs it, with every input requiring grad.
    ``run``: a context for both, or None for float64 on the same values. Returns (out, grad_input, grad_weight,
    grad_bias or None)."""
    n, c_in, side, c_out, k, stride, pad, groups, transposed, bias = RESNET_CONVS[name]
    gen = torch.Generator().manual_seed(0)
    x = _grid(n, c_in, side, side, generator=gen)
    w = _grid(*((c_in, c_out // groups) if transposed else (c_out, c_in // groups)), k, k, generator=gen)
    b = _grid(c_out, generator=gen) if bias else None
    f = (lambda x, w, b: F.conv_transpose2d(x, w, b, stride, pad, stride - 1, groups)) if transposed else (
        lambda x, w, b: F.conv2d(x, w, b, stride, pad, 1, groups))  # fmt: skip
    grad_out = _grid(*f(x, w, b).shape, generator=gen)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    to = torch.float64 if run is None else dtype
    x, w, grad_out = (t.to(to).to(memory_format=fmt) for t in (x, w, grad_out))
    leaves = [t.requires_grad_() for t in (x, w, b.to(to) if bias else None) if t is not None]
    with run if run is not None else contextlib.nullcontext():
        out = f(*leaves, None) if not bias else f(*leaves)
        out.backward(grad_out)
    return out.detach(), x.grad, w.grad, leaves[2].grad if bias else None


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("channels_last", [False, True], ids=["NCHW", "channels-last"])
@pytest.mark.parametrize("name", list(RESNET_CONVS))
@pytest.mark.parametrize("dtype", HALF)
def test_resnet_convolutions_are_correctly_rounded_forward_and_backward(dtype, name, channels_last, how):
    """Every output of an emulated convolution, forward, input, weight and bias gradient, is the exact result rounded
    once: bit for bit, element by element. Against the native kernel of this machine: the forward and the bias
    gradient within 1 ulp, and no element of any output farther from the exact value than the native kernel's.

    Only that, and not 1 ulp everywhere, because torch's CPU kernel for 16-bit convolutions without 16-bit arithmetic
    (fp16 on CPUs without AVX512-FP16, bf16 on AVX2 CPUs) rounds inside: it adds each image's weight gradient into
    a 16-bit sum, one image at a time, and sums the overlapping windows of the input gradient (col2im) in 16 bits.
    Lightning's ``bf16-mixed`` runs that kernel on an AVX2 CPU (docs/benchmarks.md, "Emulated convolutions")."""
    with _disable_current_modes():
        exact = _resnet_conv(name, dtype, channels_last, None)
        native = _resnet_conv(name, dtype, channels_last, contextlib.nullcontext())
    recorder = Recorder()
    with recorder:
        emulated = _resnet_conv(name, dtype, channels_last, emulating(dtype, how))
    assert {n for n, _ in recorder.gemms()} == {"convolution", "convolution_backward"}
    assert all(dtypes == {torch.float32} for _, dtypes in recorder.gemms())
    for what, e, nat, ex in zip(("out", "grad_input", "grad_weight", "grad_bias"), emulated, native, exact):
        if ex is None:
            continue
        assert e.dtype == nat.dtype == dtype and e.shape == nat.shape, what
        assert ulp_distance(e, ex.to(dtype)) == 0, what  # one rounding of an exact FP32 result
        # no element farther from the exact value than the native kernel's (NaN-safe: torch's own bf16 kernel on
        # AVX512-BF16 returns garbage, NaN included, for the weight gradient on a 1x1 map)
        assert not ((e.double() - ex).abs() > (nat.double() - ex).abs()).any(), what
        if what in ("out", "grad_bias") and "transposed" not in name:  # a transposed forward is a col2im too
            assert ulp_distance(e, nat) <= 1, what


@contextlib.contextmanager
def emulating_families(dtype, how, families, monkeypatch):
    """Emulation of ``families`` only: the mode given them, or a run whose probe found exactly them slow."""
    if how == "mode":
        with EmulatedGemmMode(dtype, families=frozenset(families)):
            yield
        return
    mock_cpu(monkeypatch, onednn=True, slowdown={f: 30.0 if f in families else 1.0 for f in FAMILIES})
    gs.gemm_support.cache_clear()  # a real verdict may be cached already
    run = GemmEmulation("auto")
    run.setup("cpu", dtype)
    assert run.families == set(families)
    try:
        with run.context():
            yield
    finally:
        run.remove()


@pytest.mark.usefixtures("fresh_gemm_detection")
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("families", [["conv weight grad"], ["conv input grad"], ["conv forward", "conv weight grad"]])
@pytest.mark.parametrize("name", ["3x3 stride 2", "7x7 stride-2 stem, bias", "3x3 grouped, bias",
                                  "3x3 stride-2 transposed, bias"])
@pytest.mark.parametrize("dtype", HALF)
def test_each_convolution_family_is_emulated_alone_and_the_others_stay_native(dtype, name, families, how, monkeypatch):
    """With some families emulated (the fp16 weight gradient on an AVX512-FP16 Xeon), every output of a convolution
    is bit for bit either the native kernel's or the fully emulated one's, as its family says: the bias gradient goes
    with the weight gradient."""
    with _disable_current_modes():
        native = _resnet_conv(name, dtype, False, contextlib.nullcontext())
    emulated = _resnet_conv(name, dtype, False, emulating(dtype, how))
    mixed = _resnet_conv(name, dtype, False, emulating_families(dtype, how, families, monkeypatch))
    owner = ("conv forward", "conv input grad", "conv weight grad", "conv weight grad")
    for what, family, m, nat, emu in zip(("out", "grad_input", "grad_weight", "grad_bias"), owner, mixed, native,
                                         emulated):
        if m is None:
            continue
        assert m.dtype == dtype and torch.equal(m, emu if family in families else nat), (what, family)


@pytest.mark.usefixtures("fresh_gemm_detection")
@pytest.mark.parametrize("mask", [[True, False, True], [False, True, False], [False, False, True], [True, True, False]])
def test_a_split_convolution_backward_returns_exactly_the_gradients_asked_for(mask, monkeypatch):
    """Frozen weights, frozen inputs, a bias alone: the two halves of a split backward are each asked only for their
    own gradients, and the op returns None for every gradient not asked for, as the 16-bit kernel does."""
    gen = torch.Generator().manual_seed(0)
    x, w = _grid(2, 4, 6, 6, generator=gen).half(), _grid(8, 4, 3, 3, generator=gen).half()
    g = _grid(2, 8, 6, 6, generator=gen).half()
    args = (g, x, w, [8], [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    native = torch.ops.aten.convolution_backward(*args, [True, True, True])
    exact = torch.ops.aten.convolution_backward(*(a.double() if isinstance(a, torch.Tensor) else a for a in args),
                                                [True, True, True])
    recorder = Recorder()
    with recorder, EmulatedGemmMode(torch.float16, families=frozenset({"conv weight grad"})):
        out = torch.ops.aten.convolution_backward(*args, mask)
    assert [o is not None for o in out] == mask
    # the input gradient is the native kernel's, bit for bit; the weight and bias gradients the exact ones rounded
    # once (grid values: exact in FP32), which torch's fallback on CPUs without fp16 arithmetic is not
    for o, nat, ex, asked, emulated in zip(out, native, exact, mask, (False, True, True)):
        if asked:
            assert o.dtype == torch.float16 and torch.equal(o, ex.half() if emulated else nat)
    calls = [dtypes for name, dtypes in recorder.gemms() if name == "convolution_backward"]
    # the input gradient natively, the weight gradient in FP32; a bias gradient alone is a sum, no convolution
    assert sorted(calls, key=str) == [{torch.float16}] * mask[0] + [{torch.float32}] * mask[1]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("dtype", HALF)
def test_a_frozen_convolution_weight_costs_no_weight_gradient(dtype, how):
    """A frozen weight with a trainable bias (autograd's output_mask [True, False, True]): oneDNN's FP32 kernel
    computes the weight gradient whenever the bias gradient is asked for; emulation asks it for the input gradient
    only and sums the bias gradient itself, and returns no weight gradient, as the 16-bit kernel does."""

    class Masks(TorchDispatchMode):  # below the emulation: the output_mask of every backward kernel that runs
        def __init__(self):
            super().__init__()
            self.masks = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.convolution_backward.default:
                self.masks.append((list(args[-1]), {a.dtype for a in args[:3]}))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    x, w = (_grid(*shape, generator=gen).to(dtype) for shape in ((4, 16, 8, 8), (32, 16, 3, 3)))
    grad_out = _grid(4, 32, 4, 4, generator=gen).to(dtype)
    args = ([2, 2], [1, 1], [1, 1], False, [0, 0], 1)
    below = Masks()
    with below, emulating(dtype, how):
        grads = torch.ops.aten.convolution_backward(grad_out, x, w, [32], *args, [True, False, True])
    assert grads[1] is None
    assert below.masks == [([True, False, False], {torch.float32})]  # the FP32 kernel, for the input gradient alone
    exact = torch.ops.aten.convolution_backward(grad_out.double(), x.double(), w.double(), [32], *args,
                                                [True, True, True])  # fmt: skip
    assert all(g.dtype == dtype and ulp_distance(g, ex.to(dtype)) == 0 for g, ex in zip(grads[::2], exact[::2]))

    x.requires_grad_()
    conv = nn.Conv2d(16, 32, 3, stride=2, padding=1).to(dtype).requires_grad_(False)
    conv.bias.requires_grad_()
    with emulating(dtype, how):
        conv(x).backward(grad_out)
    assert conv.weight.grad is None and conv.bias.grad.dtype == dtype and x.grad.dtype == dtype


# ------------------------------------------------------------------------------------------------ the knob
@pytest.mark.parametrize("bad", ["AUTO", "fast", "", None, True, 1])
def test_bad_gemm_values_name_the_argument_value_and_choices(bad):
    with pytest.raises(ValueError) as err:
        GemmEmulation(bad)
    msg = str(err.value)
    assert f"gemm={bad!r}" in msg and all(repr(c) in msg for c in ge.GEMM_CHOICES)


@pytest.mark.parametrize(
    "gemm, native, emulated",
    [("auto", False, True), ("auto", True, False), ("native", False, False), ("native", True, False),
     ("emulated", True, True), ("emulated", False, True)],
)
def test_the_knob_decides(monkeypatch, gemm, native, emulated):
    mock_cpu(monkeypatch, onednn=native)
    g = GemmEmulation(gemm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        line = g.setup("cpu", torch.float16)
    assert g.emulated is emulated
    recorder = Recorder()
    with recorder, g.context():
        torch.mm(torch.ones(4, 4, dtype=torch.float16), torch.ones(4, 4, dtype=torch.float16))
    assert recorder.gemms() == [("mm", {torch.float32 if emulated else torch.float16})]
    assert line == g.describe() and f"gemm={gemm!r}" in line
    assert ("emulated (FP32 GEMMs on fp16 operands" in line) is emulated
    assert (g.support.reason in line) and (("native fp16 kernels" in line) is not emulated)


def test_fp32_runs_use_no_emulation(monkeypatch):
    calls = mock_cpu(monkeypatch, onednn=False)
    g = GemmEmulation("emulated")
    assert "not used" in g.setup("cpu", torch.float32) and not g.emulated and calls == []
    assert isinstance(g.context(), contextlib.nullcontext)


def test_describe_before_setup_and_repr():
    g = GemmEmulation()
    assert "decided at setup" in g.describe() and repr(g) == "GemmEmulation(gemm='auto')"


# ------------------------------------------------------------------------------------------------ the warning
def test_slow_native_warns_once_with_the_factor_and_a_hint(monkeypatch):
    mock_cpu(monkeypatch, onednn=False, slowdown=17.6)
    with pytest.warns(UserWarning, match=r"gemm='native'.*18x the FP32 time.*HINT: gemm='auto'") as record:
        GemmEmulation("native").setup("cpu", torch.bfloat16)
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GemmEmulation("native").setup("cpu", torch.bfloat16)  # the second run in the process stays quiet


@pytest.mark.parametrize("gemm, onednn", [("auto", False), ("emulated", False), ("native", True), ("auto", True)])
def test_no_warning_when_emulated_or_fast(monkeypatch, gemm, onednn):
    mock_cpu(monkeypatch, onednn=onednn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GemmEmulation(gemm).setup("cpu", torch.float16)


@cuda
@pytest.mark.cuda
def test_cuda_runs_native_kernels_under_auto():
    g = GemmEmulation("auto")
    g.setup("cuda", torch.bfloat16)
    assert not g.emulated and isinstance(g.context(), contextlib.nullcontext)


def test_the_probe_leaves_the_thread_count_as_it_was():
    threads = torch.get_num_threads()
    assert all(r > 0 for r in gs._probe(torch.float16).values())
    assert torch.get_num_threads() == threads


# ------------------------------------------------------------------------------------------------ staging buffers
def test_staging_remembers_the_last_copies_by_memory_and_version():
    """An operand over the same memory at the same version (the tensor again, a transpose of it) is served from its
    copy; a write moves the version and the next take copies again; at most MEMO copies are remembered."""
    staging = ge._Staging()
    x = torch.randn(512, 1024).half()
    first = staging.take(x)
    assert first.dtype == torch.float32 and torch.equal(first, x.float())
    again, transposed = staging.take(x), staging.take(x.t())
    assert again.data_ptr() == transposed.data_ptr() == first.data_ptr()  # no second copy
    assert torch.equal(transposed, x.t().float()) and transposed.stride() == x.t().stride()
    x.add_(1)  # in place: the version counter moves
    assert torch.equal(staging.take(x), x.float()) and staging.take(x).data_ptr() != first.data_ptr()
    assert staging.take(x[:256]).data_ptr() != first.data_ptr()  # other memory: a copy of its own
    others = [torch.randn(512, 256).half() for _ in range(staging.MEMO)]
    for t in others:
        staging.take(t)
    assert [m[0] for m in staging._memo.values()] == others  # the oldest went
    assert torch.equal(staging.take(others[0]), others[0].float())


def test_staging_copies_small_operands_plainly():
    """Below MEMO_MIN elements an upcast costs about what remembering it does (~2 us of Python on this machine's
    cores against 2.8 us for 32k elements), and few such operands come back: the Llama 2x64's fp16 step took 10 hits
    in 92 of them. They are copied and forgotten; larger ones are remembered."""
    staging = ge._Staging()
    small, large = torch.randn(128, 256).half(), torch.randn(512, 256).half()
    assert small.numel() < staging.MEMO_MIN <= large.numel()
    assert torch.equal(staging.take(small), small.float())
    assert staging.take(small).data_ptr() != staging.take(small).data_ptr() and staging._memo == {}
    assert staging.take(large).data_ptr() == staging.take(large).data_ptr() and len(staging._memo) == 1


def test_staging_pools_large_copies_that_leave_the_memo_and_keeps_a_bounded_few():
    staging = ge._Staging()
    big = [torch.randn(n * 2**17, 2).half() for n in range(1, 10)]  # 1-9 MiB in FP32
    for t in big:
        staging.take(t)
        assert staging._free == []  # a buffer that leaves the memo may be an operand of the op: pooled after it
    staging.done(None)
    assert len(staging._free) == staging.KEEP  # 5 left the memo, only the largest KEEP stay
    assert [b.numel() for b in staging._free] == [n * 2**18 for n in range(2, 6)]
    pooled = staging._free[0].data_ptr()
    reused = staging.take(torch.randn(2**17, 2).half())  # the smallest pooled buffer that fits it
    assert reused.data_ptr() == pooled and len(staging._free) == staging.KEEP - 1
    staging.done(None)
    assert len(staging._free) == staging.KEEP  # the memo's oldest went there
    staging.clear()
    assert staging._free == [] and staging._memo == {}


def test_staging_keeps_strides_and_copies_overlapping_or_inference_operands_plainly():
    staging = ge._Staging()
    x = torch.randn(1024, 768).half()
    for view in (x.t(), x.view(1024, 12, 64).permute(1, 0, 2), torch.randn(64, 16, 32, 32).half().to(
            memory_format=torch.channels_last)):  # fmt: skip
        up = staging.take(view)
        assert up.stride() == view.stride() and torch.equal(up, view.float())
    expanded = staging.take(torch.randn(1, 768).half().expand(1024, 768))  # stride 0: not dense
    # the two views of x share one copy (the same memory), the channels-last tensor has its own, nothing else
    assert expanded.shape == (1024, 768) and len(staging._memo) == 2
    with torch.inference_mode():
        y = torch.randn(64, 64).half()
        assert torch.equal(staging.take(y), y.float()) and len(staging._memo) == 2


def test_an_operand_that_leaves_the_memo_inside_an_op_keeps_its_copy_until_the_op_ends(monkeypatch):
    monkeypatch.setattr(ge._Staging, "MEMO", 1)
    staging = ge._Staging()
    a, b, c = (torch.randn(512, 1024).half() for _ in range(3))  # 2 MiB each in FP32: pooled buffers
    copies = [staging.take(t) for t in (a, b, c)]  # one op's three operands: a's and b's copies left the memo
    assert all(torch.equal(t32, t.float()) for t32, t in zip(copies, (a, b, c)))
    staging.done(None)
    assert len(staging._free) == 2 and torch.equal(staging.take(b), b.float())


def test_new_memory_at_a_remembered_address_is_copied_afresh():
    """FSDP2 frees a gathered parameter's memory while the tensor lives, and the next layer's parameter may land at the
    same address with version 0. Two numpy-backed tensors over one array are that case: same address, same version,
    another storage."""
    import numpy as np

    staging = ge._Staging()
    array = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float16)
    staging.take(torch.from_numpy(array))
    array += 1  # the memory changes without a version counter seeing it
    fresh = torch.from_numpy(array)
    assert torch.equal(staging.take(fresh), fresh.float())


def test_a_copy_an_output_lives_in_is_not_served_again():
    staging = ge._Staging()
    x = torch.randn(1024, 512).half()
    up = staging.take(x)
    staging.done(up.view(-1)[:10].view(2, 5))  # an op returned a view of its operand
    assert staging._memo == {} and staging.take(x).data_ptr() != up.data_ptr()


def test_remembered_copies_give_the_bits_of_fresh_ones(monkeypatch):
    """Three linears on one input (a transformer's q, k, v) and their backward, where each output gradient feeds two
    GEMMs: the same gradients with the memo and the pool as with every operand upcast into a fresh tensor."""
    import copy

    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256)

        def forward(self, x):
            return self.q(x) * self.k(x) + self.v(x)

    torch.manual_seed(0)
    ref, x0 = QKV().half(), torch.randn(1024, 256).half()  # 1 MiB in FP32: the pooled path too
    grads = []
    for memo, min_bytes in ((ge._Staging.MEMO, ge._Staging.MIN_BYTES), (0, 1 << 62)):  # then: fresh copies only
        monkeypatch.setattr(ge._Staging, "MEMO", memo)
        monkeypatch.setattr(ge._Staging, "MIN_BYTES", min_bytes)
        model, x = copy.deepcopy(ref), x0.clone().requires_grad_()
        g = GemmEmulation("emulated")
        g.setup("cpu", torch.float16)
        with g.context():
            y = model(x)
        with g.context():
            y.float().square().mean().backward()
        g.remove()
        grads.append([x.grad, *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("dtype", HALF)
def test_emulated_convolution_backward_with_reused_buffers_matches_fresh_copies(dtype):
    """Three steps through the same staging (buffers reused, a smaller batch in between) give the same bits as
    the op computed on fresh FP32 copies."""
    conv = nn.Conv2d(16, 16, 3, padding=1, bias=False).to(dtype)
    mode = EmulatedGemmMode(dtype)
    for batch in (64, 32, 64):
        x = torch.randn(batch, 16, 16, 16).to(dtype).requires_grad_()
        with mode:
            y = conv(x)
            y.backward(torch.ones_like(y))
        ref_y = F.conv2d(x.detach().float(), conv.weight.detach().float(), padding=1).to(dtype)
        assert torch.equal(y, ref_y)
        ref_gx = torch.ops.aten.convolution_backward(
            torch.ones_like(y).float(), x.detach().float(), conv.weight.detach().float(), None, [1, 1], [1, 1],
            [1, 1], False, [0, 0], 1, [True, False, False])[0].to(dtype)  # fmt: skip
        assert torch.equal(x.grad, ref_gx)
        conv.weight.grad = None
    assert mode.staging._memo  # the operands went through the memo


def test_the_run_context_releases_its_buffers_on_exit():
    """Buffers are reused within one forward or one backward; none stay allocated between steps."""
    g = GemmEmulation("emulated")
    g.setup("cpu", torch.float16)
    x = torch.randn(1024, 512).half()
    with g.context():
        torch.mm(x, x.t())
        assert g._staging._memo  # kept for the next op of this pass
    assert g._staging._memo == {} and g._staging._free == []


def test_a_pickled_or_copied_staging_starts_empty():
    import copy
    import pickle

    staging = ge._Staging()
    staging.take(torch.randn(1024, 512).half())
    for clone in (pickle.loads(pickle.dumps(staging)), copy.deepcopy(staging)):
        assert clone._memo == {} and clone._free == []
        x = torch.randn(1024, 512).half()
        assert torch.equal(clone.take(x), x.float()) and len(clone._memo) == 1


# ------------------------------------------------------------------------------ a run's kernels at ADInplaceOrView


def _has_kernel(op, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)


def test_a_run_registers_its_kernels_from_setup_to_remove_and_only_its_thread_emulates():
    run, other = GemmEmulation("emulated"), GemmEmulation("emulated")
    gc.collect()  # runs of earlier tests that were dropped without remove() release their holds when collected
    assert not _has_kernel(torch.ops.aten.mm.default, "ADInplaceOrView")
    run.setup("cpu", torch.float16)
    other.setup("cpu", torch.float16)  # holds add up: the kernels go with the last
    assert _has_kernel(torch.ops.aten.mm.default, "ADInplaceOrView")
    x = torch.randn(8, 8).half()

    def calls(ctx) -> list:
        recorder = Recorder()
        with recorder, ctx:
            assert (torch.mm(x, x) + x).dtype == torch.float16
        return [call for call in recorder.calls if call[0] in ("mm", "add")]  # not the casts

    try:
        # only the GEMM is emulated; the add runs on the fp16 tensors, and outside the context nothing changes
        assert calls(run.context()) == [("mm", {torch.float32}), ("add", {torch.float16})]
        assert calls(contextlib.nullcontext()) == [("mm", {torch.float16}), ("add", {torch.float16})]
        in_thread: list = []
        with run.context():  # another thread of the process is not emulated
            worker = threading.Thread(target=lambda: in_thread.append(calls(contextlib.nullcontext())))
            worker.start()
            worker.join()
        assert in_thread == [[("mm", {torch.float16}), ("add", {torch.float16})]]
    finally:
        run.remove()
        run.remove()  # idempotent
        assert _has_kernel(torch.ops.aten.mm.default, "ADInplaceOrView")
        other.remove()
    assert not _has_kernel(torch.ops.aten.mm.default, "ADInplaceOrView")


def test_a_run_set_up_without_a_hold_registers_the_kernels_only_for_its_blocks_and_its_holds():
    # Fabric's: no end of fit to release a hold at, so nothing stays registered between its iterations
    run = GemmEmulation("emulated")
    gc.collect()
    run.setup("cpu", torch.float16, hold=False)
    mm = torch.ops.aten.mm.default
    x = torch.randn(8, 8).half()
    assert not _has_kernel(mm, "ADInplaceOrView")
    recorder = Recorder()
    with recorder, run.context():
        assert _has_kernel(mm, "ADInplaceOrView") and torch.mm(x, x).dtype == torch.float16
    assert ("mm", {torch.float32}) in recorder.calls  # emulated, through the kernels (no mode)
    assert not _has_kernel(mm, "ADInplaceOrView")
    run.hold()
    run.hold()  # idempotent
    with run.context():
        pass
    assert _has_kernel(mm, "ADInplaceOrView")  # held across blocks until remove()
    run.remove()
    assert not _has_kernel(mm, "ADInplaceOrView")


def test_an_op_without_a_derivative_refuses_tensors_that_require_grad_as_torch_does_at_backward():
    run = GemmEmulation("emulated")
    run.setup("cpu", torch.float16)
    a, b = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)
    try:
        with pytest.raises(NotImplementedError, match="_addmm_activation.*no derivative.*HINT: call it under"):
            torch._addmm_activation(b, a, b)
        with torch.no_grad():
            assert torch.equal(torch._addmm_activation(b, a, b), torch.relu(torch.addmm(b, a, b)))
    finally:
        run.remove()


def test_registering_the_kernels_prints_nothing_to_the_user():
    # torch warns once per process when a kernel replaces one of its own ("Overriding a previously registered
    # kernel ... registered at .../emulation.py"): every user of an emulated run saw it. A fresh process, so that
    # the warning has not been used up by an earlier test.
    code = (
        "import warnings, torch\n"
        "warnings.simplefilter('error')\n"
        "from lightning_mp.gemm.emulation import GemmEmulation\n"
        "run = GemmEmulation('emulated')\n"
        "run.setup('cpu', torch.bfloat16)\n"
        "with run.context():\n"
        "    x = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)\n"
        "    (x @ x).float().sum().backward()\n"
        "run.remove()\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "Overrid" not in done.stderr and "Warning" not in done.stderr, done.stderr
