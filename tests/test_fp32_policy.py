"""Unit tests for lightning_mp.policy.policy (no Trainer; CPU only; a few seconds)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_mp import fp32_policy
from lightning_mp.policy.dispatch import active_kernels
from lightning_mp.policy.policy import (
    DEFAULT_FP32_MODULES,
    DEFAULT_FP32_OPS,
    NORM_MODULES,
    Fp32Policy,
)

LOW = [torch.bfloat16, torch.float16]
# Unit roundoff u = 2^-p of each format (p = significand bits incl. the implicit one):
# a correctly rounded result is within a relative u of the exact value.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
# Fraction bits stored by each 16-bit format.
FRACTION_BITS = {torch.bfloat16: 7, torch.float16: 10}


@pytest.fixture(scope="module")
def policy() -> Fp32Policy:
    return Fp32Policy()


def _mode_depth() -> int:
    return torch._C._len_torch_function_stack()


def _rel_err(value: torch.Tensor, ref: torch.Tensor) -> float:
    """max |value - ref| / max |ref|, in float64 (inf if value is not finite)."""
    value = value.double()
    if not torch.isfinite(value).all():
        return float("inf")
    return ((value - ref).abs().max() / ref.abs().max()).item()


# ----------------------------------------------------------------------------- op context


@pytest.mark.parametrize("dtype", LOW)
def test_listed_ops_return_fp32_inside_autocast(policy: Fp32Policy, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    target = torch.tensor([0, 3, 5, 7])
    with torch.autocast("cpu", dtype=dtype):
        with policy.op_context():
            y = lin(x)
            assert y.dtype == dtype  # matmuls stay 16-bit
            results = {
                "F.softmax": F.softmax(y, dim=-1),
                "torch.softmax": torch.softmax(y, -1),
                "Tensor.softmax": y.softmax(-1),
                "torch.special.softmax": torch.special.softmax(y, -1),
                "F.log_softmax": F.log_softmax(y, dim=-1),
                "F.layer_norm": F.layer_norm(y, (8,)),
                "F.cross_entropy": F.cross_entropy(y, target),
                "Tensor.sum": y.sum(),
                "torch.mean": torch.mean(y, dim=0),
                "Tensor.cumsum": y.cumsum(0),
                "x ** 2": y**2,
                "torch.logsumexp": torch.logsumexp(y, -1),
                "Tensor.norm": y.norm(),
            }
            for where, out in results.items():
                assert out.dtype == torch.float32, where
            # unlisted ops and non-floating tensors are untouched
            assert y.relu().dtype == dtype
            assert F.gelu(y).dtype == dtype
            assert torch.arange(10).sum().dtype == torch.int64
            assert (y > 0).sum().dtype == torch.int64
            assert torch.is_autocast_enabled("cpu")  # the listed calls re-enabled it
        # outside the context: CPU autocast's own behaviour again
        assert F.softmax(y, dim=-1).dtype == dtype
        assert y.sum().dtype == dtype
    assert F.softmax(y, dim=-1).dtype == dtype


def test_context_order_and_values(policy: Fp32Policy) -> None:
    """op_context outside autocast works too, and the FP32 result equals the FP32 op
    on the upcast input (what autocast's FP32 list means)."""
    torch.manual_seed(1)
    y = torch.randn(6, 32).bfloat16()
    with policy.op_context(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.log_softmax(y, dim=-1)
    torch.testing.assert_close(out, F.log_softmax(y.float(), dim=-1), rtol=0, atol=0)


def test_context_does_not_leak_on_exception(policy: Fp32Policy) -> None:
    depth = _mode_depth()
    before = active_kernels("AutocastCPU")
    y = torch.randn(3, 4, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(IndexError):
            with policy.op_context():
                assert "_softmax" in active_kernels("AutocastCPU")  # kernels at the dispatcher, no Python mode
                assert _mode_depth() == depth
                F.softmax(y, dim=5)  # the listed op itself raises
        assert torch.is_autocast_enabled("cpu")
        with pytest.raises(RuntimeError, match="boom"):
            with policy.op_context():
                raise RuntimeError("boom")
        assert _mode_depth() == depth and active_kernels("AutocastCPU") == before
        assert F.softmax(y, dim=-1).dtype == torch.bfloat16


def test_backward_through_listed_op(policy: Fp32Policy) -> None:
    w = torch.randn(8, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), policy.op_context():
        logits = torch.randn(4, 8) @ w
        loss = F.log_softmax(logits, dim=-1).sum()
    assert loss.dtype == torch.float32
    loss.backward()
    assert w.grad is not None and w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()


def test_explicit_dtype_is_respected(policy: Fp32Policy) -> None:
    y = torch.randn(4, 8, dtype=torch.bfloat16)
    with policy.op_context():
        assert F.softmax(y, dim=-1, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.softmax(y, -1, torch.bfloat16).dtype == torch.bfloat16
        assert y.sum(dtype=torch.float64).dtype == torch.float64


_DTYPE_CALLS = {
    "softmax": lambda f, x: f(x, -1),
    "log_softmax": lambda f, x: f(x, -1),
    "cumsum": lambda f, x: f(x, 0),
    "cumprod": lambda f, x: f(x, 0),
}


def test_every_dtype_alias_gives_the_fp32_result(policy: Fp32Policy) -> None:
    """Ops called with dtype=float32 instead of an upcast copy: each alias must accept
    it and give exactly what the op gives on the upcast input."""
    x = (torch.rand(6, 5) + 0.5).bfloat16()
    for name in fp32_policy._DTYPE_OPS:
        call = _DTYPE_CALLS.get(name, lambda f, t: f(t))
        for label, func in policy._aliases[name]:
            with torch.autocast("cpu", dtype=torch.bfloat16), policy.op_context():
                out = call(func, x)
            expected = call(func, x.float())
            assert out.dtype == torch.float32, label
            torch.testing.assert_close(out, expected, msg=label)


def test_activation_checkpointing_with_context_fn(policy: Fp32Policy) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)

    def block(t):
        return lin(F.softmax(lin(t), dim=-1))

    grads = []
    for use_checkpoint in (False, True):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), policy.op_context():
            if use_checkpoint:
                y = checkpoint(block, x, use_reentrant=False, context_fn=policy.checkpoint_context_fn())
            else:
                y = block(x)
        y.float().sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_empty_policy_is_a_noop() -> None:
    empty = Fp32Policy(ops=(), modules=())
    depth = _mode_depth()
    with empty.op_context():
        assert _mode_depth() == depth  # no mode pushed: zero overhead
    assert empty.ops == frozenset() and empty.modules == ()
    assert not empty.keeps_fp32(nn.LayerNorm(4))


# ----------------------------------------------------------------------------- numerics
# Each case: CPU autocast alone is wrong by a 16-bit-format amount, the policy gives
# the FP32 answer. References are computed in float64 from the same 16-bit inputs.


def _both(policy: Fp32Policy, dtype: torch.dtype, fn):
    with torch.autocast("cpu", dtype=dtype):
        plain = fn()
        with policy.op_context():
            fixed = fn()
    return plain, fixed


def test_fp16_long_sum_overflows_without_policy(policy: Fp32Policy) -> None:
    x = torch.full((4096,), 32.0, dtype=torch.float16)  # total 131072 > 65504
    ref = x.double().sum()
    plain, fixed = _both(policy, torch.float16, lambda: x.sum())
    assert plain.dtype == torch.float16 and torch.isinf(plain)
    assert fixed.dtype == torch.float32 and fixed.double() == ref


def test_bf16_sum_rounds_without_policy(policy: Fp32Policy) -> None:
    x = torch.ones(257, dtype=torch.bfloat16)  # 257 needs 9 significant bits, bf16 has 8
    ref = x.double().sum()
    plain, fixed = _both(policy, torch.bfloat16, lambda: x.sum())
    err = _rel_err(plain, ref)
    assert 0 < err <= UNIT_ROUNDOFF[torch.bfloat16]  # wrong, by exactly a rounding
    assert fixed.double() == ref


@pytest.mark.parametrize("dtype", LOW)
def test_cumsum_rounds_partial_sums_without_policy(policy: Fp32Policy, dtype: torch.dtype) -> None:
    # Partial sums of ones pass 2^(p) where odd integers stop being representable.
    n = 2 ** (FRACTION_BITS[dtype] + 2)
    x = torch.ones(n, dtype=dtype)
    ref = torch.arange(1, n + 1, dtype=torch.float64)
    plain, fixed = _both(policy, dtype, lambda: torch.cumsum(x, 0))
    plain_err = ((plain.double() - ref).abs() / ref).max().item()
    assert plain_err > 100 * UNIT_ROUNDOFF[torch.float32]
    assert plain_err <= UNIT_ROUNDOFF[dtype]
    assert fixed.dtype == torch.float32
    torch.testing.assert_close(fixed.double(), ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", LOW)
def test_mean_rounds_without_policy(policy: Fp32Policy, dtype: torch.dtype) -> None:
    # 1 + k * 2^-m (m = stored fraction bits) is exact in the format; their mean
    # 1 + (2^m - 1) / 2^(m+1) needs one more bit, so a 16-bit result must round.
    m = FRACTION_BITS[dtype]
    x = (1 + torch.arange(2**m, dtype=torch.float64) * 2.0**-m).to(dtype)
    assert torch.equal(x.double(), 1 + torch.arange(2**m, dtype=torch.float64) * 2.0**-m)
    ref = x.double().mean()
    plain, fixed = _both(policy, dtype, lambda: x.mean())
    assert 0 < _rel_err(plain, ref) <= UNIT_ROUNDOFF[dtype]
    assert _rel_err(fixed, ref) <= UNIT_ROUNDOFF[torch.float32]


def test_fp16_rms_statistic_overflows_without_policy(policy: Fp32Policy) -> None:
    """Hand-written RMSNorm statistic: squares of activations ~300 exceed 65504."""
    x = torch.full((2, 64), 300.0, dtype=torch.float16)
    ref = x.double().pow(2).mean(-1)
    plain, fixed = _both(policy, torch.float16, lambda: x.pow(2).mean(-1))
    assert torch.isinf(plain).all()
    assert _rel_err(fixed, ref) <= UNIT_ROUNDOFF[torch.float32]


def test_fp16_exp_overflows_without_policy(policy: Fp32Policy) -> None:
    x = torch.tensor([5.0, 12.0], dtype=torch.float16)  # e^12 = 162755 > 65504
    ref = x.double().exp()
    plain, fixed = _both(policy, torch.float16, lambda: x.exp())
    assert torch.isinf(plain[1])
    assert _rel_err(fixed, ref) <= 4 * UNIT_ROUNDOFF[torch.float32]


def test_fp16_softmax_flushes_small_probabilities_without_policy(policy: Fp32Policy) -> None:
    logits = torch.tensor([[0.0, -12.0, -20.0]], dtype=torch.float16)
    ref = torch.softmax(logits.double(), -1)  # e^-20 = 2.1e-9, below fp16's smallest 6e-8
    plain, fixed = _both(policy, torch.float16, lambda: F.softmax(logits, dim=-1))
    assert plain[0, 2] == 0  # probability lost entirely (relative error 1)
    small = ref[0, 1:]
    assert ((fixed[0, 1:].double() - small).abs() / small).max() <= 4 * UNIT_ROUNDOFF[torch.float32]


@pytest.mark.parametrize("dtype", LOW)
def test_log_softmax_rounds_without_policy(policy: Fp32Policy, dtype: torch.dtype) -> None:
    # Spread logits (exact in both formats): log-probabilities down to -16, whose
    # 16-bit values carry an absolute error of up to u * 16.
    logits = (torch.arange(64, dtype=torch.float32) * 0.25).to(dtype)
    ref = torch.log_softmax(logits.double(), -1)
    plain, fixed = _both(policy, dtype, lambda: F.log_softmax(logits, dim=-1))
    plain_err = _rel_err(plain, ref)
    assert 100 * UNIT_ROUNDOFF[torch.float32] < plain_err <= 4 * UNIT_ROUNDOFF[dtype]
    assert _rel_err(fixed, ref) <= 16 * UNIT_ROUNDOFF[torch.float32]


# ----------------------------------------------------------------------------- custom lists


def test_removing_softmax_makes_it_16_bit_again() -> None:
    custom = Fp32Policy(ops=DEFAULT_FP32_OPS - {"softmax"})
    assert "softmax" not in custom.ops and "log_softmax" in custom.ops
    y = torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), custom.op_context():
        assert F.softmax(y, dim=-1).dtype == torch.bfloat16
        assert y.softmax(-1).dtype == torch.bfloat16
        assert F.log_softmax(y, dim=-1).dtype == torch.float32


def test_adding_callables_and_names() -> None:
    custom = Fp32Policy(ops=DEFAULT_FP32_OPS | {torch.tanh, "sigmoid", F.gelu})
    assert {"tanh", "sigmoid", "gelu"} <= custom.ops
    y = torch.randn(2, 8, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.float16), custom.op_context():
        # a callable stands for its name: every alias of tanh is covered
        assert torch.tanh(y).dtype == torch.float32
        assert y.tanh().dtype == torch.float32
        assert F.tanh(y).dtype == torch.float32
        assert torch.sigmoid(y).dtype == torch.float32
        assert F.gelu(y).dtype == torch.float32
        assert y.relu().dtype == torch.float16


def test_listed_lower_precision_op_is_not_recast_by_autocast() -> None:
    custom = Fp32Policy(ops={"matmul"}, modules=())
    a = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
        with custom.op_context():
            assert (a @ a).dtype == torch.float32
            assert torch.matmul(a, a).dtype == torch.float32


def test_canonical_names_round_trip(policy: Fp32Policy) -> None:
    assert policy.ops == DEFAULT_FP32_OPS
    assert Fp32Policy(ops=policy.ops) == policy
    aliased = Fp32Policy(
        ops=[torch.special.softmax, F.softmax, "torch.nn.functional.softmax", "__pow__", "torch.fft.rfft"]
    )
    assert aliased.ops == {"softmax", "pow", "torch.fft.rfft"}
    assert Fp32Policy(ops=aliased.ops).ops == aliased.ops


def test_unknown_op_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError) as info:
        Fp32Policy(ops=DEFAULT_FP32_OPS | {"sofmax"})
    message = str(info.value)
    assert "fp32_ops" in message and "'sofmax'" in message
    assert "Did you mean 'softmax'" in message
    assert "log_softmax" in message and "layer_norm" in message  # lists the known names


@pytest.mark.parametrize(
    ("ops", "error", "fragment"),
    [
        ("softmax", TypeError, "single string"),
        (None, TypeError, "fp32_ops"),
        ([3], TypeError, "fp32_ops"),
        ([lambda t: t], ValueError, "fp32_ops"),
        ([nn.Softmax], TypeError, "fp32_modules"),
        (["exp_"], ValueError, "in-place"),
        (["torch.fft.nothing"], ValueError, "fp32_ops"),
        (["manual_seed"], ValueError, "fp32_ops"),  # not an interceptable op
    ],
)
def test_invalid_ops(ops, error, fragment) -> None:
    with pytest.raises(error, match=fragment):
        Fp32Policy(ops=ops)


@pytest.mark.parametrize(
    ("modules", "error"),
    [
        (nn.LSTM, TypeError),  # a bare class, not a tuple
        ((nn.LSTM(2, 2),), TypeError),  # an instance
        (("LayerNorm",), TypeError),
        ((int,), TypeError),
        (None, TypeError),
        ((nn.Module,), ValueError),
    ],
)
def test_invalid_modules(modules, error) -> None:
    with pytest.raises(error, match="fp32_modules"):
        Fp32Policy(modules=modules)


def test_keeps_fp32(policy: Fp32Policy) -> None:
    class MyNorm(nn.LayerNorm):
        pass

    for module in (nn.LayerNorm(4), MyNorm(4), nn.BatchNorm2d(3), nn.SyncBatchNorm(3), nn.GroupNorm(2, 4),
                   nn.InstanceNorm1d(3), nn.LSTM(2, 2), nn.GRUCell(2, 2), nn.Embedding(3, 2), nn.EmbeddingBag(3, 2)):
        assert policy.keeps_fp32(module), module
    for module in (nn.Linear(2, 2), nn.Conv1d(2, 2, 1), nn.Sequential()):
        assert not policy.keeps_fp32(module), module
    assert not Fp32Policy(modules=NORM_MODULES).keeps_fp32(nn.LSTM(2, 2))
    assert Fp32Policy(modules=[nn.Linear, nn.Linear]).modules == (nn.Linear,)


# ----------------------------------------------------------------------------- install()


class _Recorder(nn.Module):
    """Linear (fp16) -> LayerNorm -> LSTM -> Linear (fp16); records dtypes/autocast state."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.out = nn.Linear(16, 4)
        self.seen: dict[str, object] = {}

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = self.inp(x)
        self.seen["inp"] = h.dtype
        h = self.norm(h)
        self.seen["norm"] = h.dtype
        h, (hn, cn) = self.lstm(h, hx=state)  # nested tuple passed as a kwarg
        self.seen["lstm"] = (h.dtype, hn.dtype, cn.dtype)
        self.seen["autocast_after_lstm"] = torch.is_autocast_enabled("cpu")
        return self.out(h)


def _fp16_model(policy: Fp32Policy) -> _Recorder:
    torch.manual_seed(0)
    model = _Recorder()
    for module in model.modules():
        if not policy.keeps_fp32(module):
            for param in module.parameters(recurse=False):
                param.data = param.data.half()
    return model


def _inputs() -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    x = torch.randn(2, 5, 8)
    state = (torch.zeros(1, 2, 16, dtype=torch.float16), torch.zeros(1, 2, 16, dtype=torch.float16))
    return x, state


def _outcome(fn) -> tuple[str, object]:
    try:
        out = fn()
    except RuntimeError as err:
        return ("error", type(err))
    return ("ok", out.dtype if isinstance(out, torch.Tensor) else out[0].dtype)


def test_install_runs_lstm_and_layernorm_in_fp32(policy: Fp32Policy) -> None:
    model = _fp16_model(policy)
    assert model.inp.weight.dtype == torch.float16 and model.lstm.weight_hh_l0.dtype == torch.float32
    handle = policy.install(model, "cpu")
    assert set(handle.modules) == {model.norm, model.lstm}
    x, state = _inputs()
    with torch.autocast("cpu", dtype=torch.float16):
        y = model(x, state)
        assert torch.is_autocast_enabled("cpu")
    assert model.seen["inp"] == torch.float16
    assert model.seen["norm"] == torch.float32
    assert model.seen["lstm"] == (torch.float32,) * 3
    assert model.seen["autocast_after_lstm"] is True
    assert y.dtype == torch.float16
    y.float().pow(2).mean().backward()
    assert model.lstm.weight_ih_l0.grad.dtype == torch.float32
    assert model.norm.weight.grad.dtype == torch.float32
    assert model.inp.weight.grad.dtype == torch.float16
    for param in model.parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all()
    handle.remove()


def test_install_lstm_inside_autocast_disabled_forward(policy: Fp32Policy) -> None:
    class Probe(nn.LSTM):
        def forward(self, *args, **kwargs):
            self.autocast_inside = torch.is_autocast_enabled("cpu")
            self.input_dtype = args[0].dtype
            return super().forward(*args, **kwargs)

    probe = Probe(4, 4)
    with policy.install(probe, "cpu"), torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = probe(torch.randn(3, 2, 4, dtype=torch.bfloat16))
    assert probe.autocast_inside is False and probe.input_dtype == torch.float32
    assert out.dtype == torch.float32


def test_install_packed_sequence(policy: Fp32Policy) -> None:
    lstm = nn.LSTM(4, 4)
    seq = torch.randn(5, 2, 4, dtype=torch.float16)
    packed = nn.utils.rnn.pack_padded_sequence(seq, torch.tensor([5, 3]))
    with policy.install(lstm, "cpu"), torch.autocast("cpu", dtype=torch.float16):
        out, _ = lstm(packed)
    assert isinstance(out, nn.utils.rnn.PackedSequence) and out.data.dtype == torch.float32


def test_remove_restores_behaviour(policy: Fp32Policy) -> None:
    model = _fp16_model(policy)
    pristine = copy.deepcopy(model)
    before = [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()]
    handle = policy.install(model, "cpu")
    handle.remove()
    handle.remove()  # idempotent
    assert [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()] == before
    h16 = torch.randn(2, 5, 16, dtype=torch.float16)
    h32 = torch.randn(2, 5, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        assert model.norm(h16).dtype == torch.float16  # CPU autocast's own behaviour
        # The LSTM behaves exactly like one that was never installed. (With oneDNN on
        # x86, an FP32 input under fp16 autocast raises in both; elsewhere both return
        # the same dtype.)
        for h in (h16, h32):
            assert _outcome(lambda: model.lstm(h)) == _outcome(lambda: pristine.lstm(h))


def test_exception_in_forward_restores_autocast(policy: Fp32Policy) -> None:
    class Boom(nn.LayerNorm):
        def forward(self, x):
            assert not torch.is_autocast_enabled("cpu")
            raise RuntimeError("boom")

    boom = Boom(4)
    lin = nn.Linear(4, 4)
    with policy.install(boom, "cpu"), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="boom"):
            boom(torch.randn(2, 4))
        assert torch.is_autocast_enabled("cpu")
        assert lin(torch.randn(2, 4)).dtype == torch.bfloat16

    # a later pre-hook that raises after ours ran: our always-called hook still restores
    norm = nn.LayerNorm(4)
    with policy.install(norm, "cpu"), torch.autocast("cpu", dtype=torch.bfloat16):
        bad = norm.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(ValueError("hook")))
        with pytest.raises(ValueError, match="hook"):
            norm(torch.randn(2, 4))
        assert torch.is_autocast_enabled("cpu")
        bad.remove()
        assert norm(torch.randn(2, 4, dtype=torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_installed_model_can_be_copied(policy: Fp32Policy, how: str) -> None:
    model = _fp16_model(policy)
    with policy.install(model, "cpu"):
        if how == "deepcopy":
            clone = copy.deepcopy(model)
        else:
            clone = pickle.loads(pickle.dumps(model))
    x, state = _inputs()
    with torch.autocast("cpu", dtype=torch.float16):
        clone(x, state)
    assert clone.seen["lstm"] == (torch.float32,) * 3
    assert model.seen == {}  # the copy's hooks act on the copy


def test_nested_fp32_modules(policy: Fp32Policy) -> None:
    """A user-listed block that contains a LayerNorm: both hooked, state unwinds in order."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(4)
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            self.inside = torch.is_autocast_enabled("cpu")
            return self.lin(self.norm(x))

    custom = Fp32Policy(modules=DEFAULT_FP32_MODULES + (Block,))
    block = Block()
    with custom.install(block, "cpu") as handle, torch.autocast("cpu", dtype=torch.bfloat16):
        assert set(handle.modules) == {block, block.norm}
        out = block(torch.randn(2, 4, dtype=torch.bfloat16))
        assert torch.is_autocast_enabled("cpu")
    assert block.inside is False and out.dtype == torch.float32


def test_install_validates_arguments(policy: Fp32Policy) -> None:
    with pytest.raises(TypeError):
        policy.install("not a module", "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device_type"):
        policy.install(nn.LayerNorm(2), "meta")
    assert policy.install(nn.Linear(2, 2), "cuda").modules == ()
