"""The FP32 op policy at the autocast dispatch keys (lightning_mp.policy.dispatch, fp32_aten): no Trainer, CPU only.

The CUDA kernels are exercised on the CPU by redispatching to the AutocastCUDA key: torch's CPU build registers
CUDA autocast's kernels too, so the same dispatcher table a GPU would use is reached.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._C import DispatchKey, DispatchKeySet
from torch.utils.checkpoint import checkpoint

from lightning_mp.policy.dispatch import active_kernels
from lightning_mp.policy.policy import DEFAULT_FP32_MODULES, DEFAULT_FP32_OPS, Fp32Policy

LOW = [torch.bfloat16, torch.float16]
# the keys a CPU tensor would have on a GPU: AutocastCUDA on top, then the CPU kernels below it
CUDA_AUTOCAST_ON_CPU = DispatchKeySet(DispatchKey.AutocastCUDA) | DispatchKeySet(DispatchKey.CPU)



@pytest.fixture(autouse=True)
def _collect_released_plugins():
    # a Fabric plugin dropped between a forward and its backward keeps its kernels until it is garbage-collected;
    # these tests check the process-wide registrations, so the plugins earlier tests dropped are collected first
    gc.collect()

def _has_kernel(overload: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{overload}", key)


@pytest.fixture(autouse=True)
def _no_kernels_left_behind():
    before = active_kernels("AutocastCPU"), active_kernels("AutocastCUDA")
    yield
    assert (active_kernels("AutocastCPU"), active_kernels("AutocastCUDA")) == before


def _listed_results(y: torch.Tensor) -> dict[str, torch.Tensor]:
    image = y.reshape(1, 1, *y.shape)
    return {
        "softmax": F.softmax(y, dim=-1),
        "Tensor.log_softmax": y.log_softmax(-1),
        "layer_norm": F.layer_norm(y, y.shape[-1:]),
        "sum": y.sum(),
        "mean": y.mean(-1),
        "exp": y.exp(),
        "pow": y**2,
        "logsumexp": torch.logsumexp(y, -1),
        "cumsum": y.cumsum(0),
        "vector_norm": torch.linalg.vector_norm(y),
        "Tensor.norm": y.norm(),
        "interpolate": F.interpolate(image, scale_factor=2.0, mode="bilinear"),
        "group_norm": F.group_norm(image, 1),
        "rms_norm": F.rms_norm(y, y.shape[-1:]),
        "softmin": F.softmin(y, dim=-1),  # pure-Python composite, through softmax
        "normalize": F.normalize(y, dim=-1),  # pure-Python composite, through vector_norm
        # the softmax inside F.multi_head_attention_forward, which a torch-function mode never saw
        "attention weights": _ATTENTION(y[:, None], y[:, None], y[:, None])[1],
    }


_ATTENTION = nn.MultiheadAttention(8, 1)  # in training mode: never the fused fast path


@pytest.mark.parametrize("dtype", LOW)
def test_listed_ops_are_fp32_while_active_and_16_bit_when_not(dtype: torch.dtype) -> None:
    y = torch.randn(4, 8).to(dtype)
    policy = Fp32Policy()
    with torch.autocast("cpu", dtype=dtype):
        before = _listed_results(y)
        with policy.activate():
            during = _listed_results(y)
            relu = y.relu()
        after = _listed_results(y)
    for name, out in during.items():
        assert out.dtype == torch.float32, name
        assert before[name].dtype == after[name].dtype == dtype, name
    assert relu.dtype == dtype


def test_unlisted_ops_have_no_kernel_and_are_bit_identical() -> None:
    y = torch.randn(64, 64, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = (F.gelu(y), y.relu() + y, y @ y, torch.tanh(y))
        with Fp32Policy().activate():
            for overload in ("relu", "gelu", "add.Tensor", "mm", "tanh"):
                assert overload not in active_kernels("AutocastCPU")
            assert not _has_kernel("relu", "AutocastCPU") and not _has_kernel("tanh", "AutocastCPU")
            during = (F.gelu(y), y.relu() + y, y @ y, torch.tanh(y))
    for a, b in zip(plain, during):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)


def test_outside_autocast_nothing_changes() -> None:
    y = torch.randn(4, 8, dtype=torch.bfloat16)
    with Fp32Policy().activate():
        assert F.softmax(y, dim=-1).dtype == torch.bfloat16 and y.sum().dtype == torch.bfloat16


def test_values_equal_the_op_on_the_upcast_input() -> None:
    torch.manual_seed(0)
    y = torch.randn(6, 32).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Policy().activate():
        results = {"log_softmax": F.log_softmax(y, -1), "layer_norm": F.layer_norm(y, (32,)), "sum": y.sum(0)}
    expected = {"log_softmax": F.log_softmax(y.float(), -1), "layer_norm": F.layer_norm(y.float(), (32,)),
                "sum": y.float().sum(0)}
    for name, out in results.items():
        torch.testing.assert_close(out, expected[name], rtol=0, atol=0, msg=name)


def test_explicit_dtype_is_left_as_written() -> None:
    y = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Policy().activate():
        assert F.softmax(y, dim=-1, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.softmax(y, -1, torch.bfloat16).dtype == torch.bfloat16
        assert y.sum(dtype=torch.float64).dtype == torch.float64
        assert y.cumsum(0, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.linalg.vector_norm(y, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert y.double().sum().dtype == torch.float64  # FP64 is not lowered
        assert torch.arange(5).sum().dtype == torch.int64


def test_batch_norm_with_fp32_statistics_stays_mixed_dtype() -> None:
    x = torch.randn(4, 8, 5, 5).bfloat16()
    stats = torch.zeros(8), torch.ones(8)
    with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Policy().activate():
        assert F.batch_norm(x, *stats, training=True).dtype == torch.bfloat16  # statistics in FP32 inside
        assert F.batch_norm(x, stats[0].bfloat16(), stats[1].bfloat16(), training=True).dtype == torch.float32
        assert F.instance_norm(x).dtype == torch.float32


def test_the_op_set_follows_the_policy_and_holds_add_up() -> None:
    y = torch.randn(4, 8, dtype=torch.bfloat16)
    no_softmax = Fp32Policy(ops=DEFAULT_FP32_OPS - {"softmax", "softmin", "gumbel_softmax"})
    only_exp = Fp32Policy(ops={"exp"}, modules=())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with no_softmax.activate():
            assert F.softmax(y, -1).dtype == torch.bfloat16 and F.log_softmax(y, -1).dtype == torch.float32
        a, b = only_exp.activate(), Fp32Policy(ops={"softmax"}, modules=()).activate()
        assert y.exp().dtype == F.softmax(y, -1).dtype == torch.float32  # two policies: the union
        b.remove()
        b.remove()  # idempotent
        assert y.exp().dtype == torch.float32 and F.softmax(y, -1).dtype == torch.bfloat16
        nested = only_exp.activate()  # the same plan again: one more hold
        a.remove()
        assert y.exp().dtype == torch.float32
        nested.remove()
        assert y.exp().dtype == torch.bfloat16
        assert repr(nested) == "Fp32Activation(0 kernels, removed)"


def test_a_plan_released_before_one_it_overlaps_leaves_the_others_kernels_registered() -> None:
    # a plan's kernels share one Library (half the registration time); the kernels another plan still holds outlive
    # it, each registered again on its own
    y = torch.randn(4, 8, dtype=torch.bfloat16)
    first, second = Fp32Policy(), Fp32Policy(ops={"softmax"}, modules=())
    a, b = first.activate(), second.activate()
    a.remove()
    held = {overload for key, overload, _ in second.kernel_plan() if key == "AutocastCPU"}
    assert active_kernels("AutocastCPU") == held and "_softmax" in held and "exp" not in held
    assert _has_kernel("_softmax", "AutocastCPU") and not _has_kernel("exp", "AutocastCPU")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.softmax(y, -1).dtype == torch.float32 and y.exp().dtype == torch.bfloat16
    b.remove()
    assert not _has_kernel("_softmax", "AutocastCPU")


def test_a_listed_lower_precision_op_overrides_autocast_and_gets_it_back() -> None:
    a = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with Fp32Policy(ops={"matmul"}, modules=()).activate():
            assert (a @ a).dtype == torch.float32
        assert (a @ a).dtype == torch.bfloat16  # autocast's own kernel is back


def test_active_for_every_thread() -> None:
    y = torch.randn(4, 8, dtype=torch.bfloat16)
    seen = []

    def other_thread():
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast state is per thread, the policy is not
            seen.append(F.softmax(y, -1).dtype)

    with Fp32Policy().activate():
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert seen == [torch.float32]


# ----------------------------------------------------------------------------------------------- the CUDA key


def test_cuda_kernels_only_where_cuda_autocast_differs() -> None:
    plan = Fp32Policy().kernel_plan()
    cuda = {overload for key, overload, _ in plan if key == "AutocastCUDA"}
    cpu = {overload for key, overload, _ in plan if key == "AutocastCPU"}
    # CUDA autocast runs softmax, sum, layer_norm, exp, the losses, upsampling in FP32 by itself
    assert {"mean", "mean.dim", "_softmax", "batch_norm", "binary_cross_entropy", "rms_norm"} <= cuda
    assert not {"softmax.int", "sum", "sum.dim_IntList", "layer_norm", "exp", "mse_loss"} & cuda
    assert not {"upsample_linear1d.vec", "upsample_bilinear2d.vec"} & cuda  # composites of CUDA's FP32 upsampling
    # CPU autocast runs only the losses (and prod, cdist) in FP32
    assert {"softmax.int", "sum", "layer_norm", "native_layer_norm", "exp", "upsample_bilinear2d.vec"} <= cpu
    assert not {"mse_loss", "nll_loss", "cross_entropy_loss", "prod", "binary_cross_entropy"} & cpu
    with Fp32Policy().activate():
        assert _has_kernel("mean.dim", "AutocastCUDA") and _has_kernel("mean.dim", "AutocastCPU")
    assert not _has_kernel("mean.dim", "AutocastCUDA")


def test_cuda_kernels_compute_in_fp32() -> None:
    x = torch.rand(4, 8, dtype=torch.float16)
    target = torch.rand(4, 8, dtype=torch.float16)
    mean, bce = torch.ops.aten.mean.dim, torch.ops.aten.binary_cross_entropy.default
    # without the policy: CUDA autocast falls through for mean (no kernel to redispatch to) and refuses
    # binary_cross_entropy
    assert not _has_kernel("mean.dim", "AutocastCUDA")
    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        bce.redispatch(CUDA_AUTOCAST_ON_CPU, x, target)
    with Fp32Policy().activate():
        assert mean.redispatch(CUDA_AUTOCAST_ON_CPU, x, [1]).dtype == torch.float32
        torch.testing.assert_close(mean.redispatch(CUDA_AUTOCAST_ON_CPU, x, [1]), x.float().mean(1))
        assert mean.redispatch(CUDA_AUTOCAST_ON_CPU, x, [1], dtype=torch.float16).dtype == torch.float16
        loss = bce.redispatch(CUDA_AUTOCAST_ON_CPU, x, target)
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, F.binary_cross_entropy(x.float(), target.float()))


def test_ops_left_to_cpu_autocast_are_fp32_there() -> None:
    """What the plan leaves to CPU autocast's own kernels really is FP32 (no policy active)."""
    logits, target = torch.randn(4, 5, dtype=torch.bfloat16), torch.tensor([0, 1, 2, 3])
    probs = torch.rand(4, 5, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for out in (
            F.cross_entropy(logits, target), F.nll_loss(logits, target), F.mse_loss(logits, probs),
            F.l1_loss(logits, probs), F.kl_div(logits, probs, reduction="batchmean"),
            F.binary_cross_entropy(probs, probs), F.binary_cross_entropy_with_logits(logits, probs), logits.prod(),
            torch.cdist(logits, logits),
        ):
            assert out.dtype == torch.float32


# ------------------------------------------------------------------------------- unlisted ops: 16 bits everywhere


def _bf16_ulps(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest distance of ``got`` from ``exact`` in bf16 ulps at ``exact`` (finite, non-zero values)."""
    ok = exact.isfinite() & (exact != 0)
    ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 8)  # bf16: 8 significant bits
    return float(((got.float() - exact).abs() / ulp)[ok].max())


def test_bf16_default_keeps_the_range_ops_in_bf16_on_cpu_and_cuda_within_an_ulp() -> None:
    from lightning_mp import BF16_FP32_OPS, FP16_RANGE_OPS, MixedPrecisionPlugin

    assert MixedPrecisionPlugin("bf16").policy.ops == BF16_FP32_OPS == DEFAULT_FP32_OPS - FP16_RANGE_OPS - {
        "gaussian_nll_loss", "gumbel_softmax", "local_response_norm"}
    assert MixedPrecisionPlugin("fp16").policy.ops == DEFAULT_FP32_OPS
    assert MixedPrecisionPlugin("bf16", fp32_ops=DEFAULT_FP32_OPS).policy.ops == DEFAULT_FP32_OPS
    policy = Fp32Policy(BF16_FP32_OPS)
    assert policy.python_only_ops == frozenset()
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0)).mul(3).bfloat16()
    positive, unit = x.abs() + 0.01, (x / 10).clamp(-0.99, 0.99)
    pow_, exp = torch.ops.aten.pow.Tensor_Scalar, torch.ops.aten.exp.default
    with policy.activate(), torch.autocast("cpu", dtype=torch.bfloat16):
        results = {
            "pow 3": (x**3, x.float() ** 3), "pow 2": (x.pow(2), x.float().pow(2)), "exp": (x.exp(), x.float().exp()),
            "log": (positive.log(), positive.float().log()), "rsqrt": (positive.rsqrt(), positive.float().rsqrt()),
            "erfinv": (unit.erfinv(), unit.float().erfinv()), "softplus": (F.softplus(x), F.softplus(x.float())),
        }
        # CUDA autocast runs these in FP32 itself; the policy's kernels at its key keep them in bf16
        on_cuda = pow_.redispatch(CUDA_AUTOCAST_ON_CPU, x, 3), exp.redispatch(CUDA_AUTOCAST_ON_CPU, x)
        assert F.softmax(x, 0).dtype == x.sum().dtype == torch.float32  # what FP32 buys accuracy for stays
    assert {"pow.Tensor_Scalar", "exp", "log", "rsqrt"} <= {o for k, o, r in policy.kernel_plan() if r.lower}
    assert all(out.dtype == torch.bfloat16 for out in on_cuda)
    for name, (got, exact) in results.items():
        assert got.dtype == torch.bfloat16, name
        # computed in FP32 and rounded once: half an ulp; an integer power of 3 or more (x * x * x) and torch's
        # approximate vectorised rsqrt are up to one ulp further off
        assert _bf16_ulps(got, exact) <= (1.5 if name in ("pow 3", "rsqrt") else 0.5), name
    # a kernel registered but switched off (activate(on=False) outside switched_on()) does what CUDA autocast does
    with policy.activate(on=False):
        assert pow_.redispatch(CUDA_AUTOCAST_ON_CPU, x, 3).dtype == torch.float32
    # a bf16 and an fp16 fit in one process: FP32 wins, on every device
    with policy.activate(), Fp32Policy().activate(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert pow_.redispatch(CUDA_AUTOCAST_ON_CPU, x, 3).dtype == (x**3).dtype == torch.float32


def test_an_op_left_out_of_the_default_table_is_16_bit_where_autocast_would_run_it_in_fp32() -> None:
    a, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    policy = Fp32Policy(DEFAULT_FP32_OPS - {"mse_loss"})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.mse_loss(a, b).dtype == torch.float32  # CPU autocast's own FP32 list
        with policy.activate():
            assert F.mse_loss(a, b).dtype == torch.bfloat16
            assert F.l1_loss(a, b).dtype == torch.float32  # still listed
        assert F.mse_loss(a, b).dtype == torch.float32  # removed with the policy
    assert "`mse_loss`" in policy.describe().split("Left out of `DEFAULT_FP32_OPS`")[1]


# ------------------------------------------------------------------------------------- composites and describe()


def test_default_list_needs_no_python_fallback() -> None:
    policy = Fp32Policy()
    assert policy.python_only_ops == frozenset()
    text = policy.describe()
    assert "aten `softmax`, `_softmax`" in text and "FP32 through the listed `softmax`" in text


def test_a_composite_whose_ops_are_not_listed_falls_back_to_python() -> None:
    y = torch.randn(2, 8, dtype=torch.bfloat16)
    hint = r"HINT: also remove \['gumbel_softmax', 'softmin'\], or list \['log', 'softmax'\]"
    with pytest.warns(UserWarning, match=hint):
        policy = Fp32Policy(ops=DEFAULT_FP32_OPS - {"softmax"})
    assert policy.python_only_ops == {"softmin", "gumbel_softmax"}
    assert Fp32Policy(ops=DEFAULT_FP32_OPS - {"softmax", "softmin", "gumbel_softmax"}).python_only_ops == frozenset()
    assert "intercepted in Python" in policy.describe()
    with pytest.warns(UserWarning, match="no aten op of their own, so"):
        user = Fp32Policy(ops={"softsign"}, modules=())  # F.softsign is x / (1 + |x|) in Python
    assert user.python_only_ops == {"softsign"}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with policy.op_context():
            assert F.softmin(y, -1).dtype == torch.float32 and F.softmax(y, -1).dtype == torch.bfloat16
        with user.op_context():
            assert F.softsign(y).dtype == torch.float32
        assert F.softsign(y).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------- checkpointing and compile


class _Block(nn.Module):
    """LayerNorm -> attention with an explicit softmax -> Linear, residual."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.norm, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        h = self.norm(x)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(h).split(d, -1))
        att = F.softmax(q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return x + self.proj(y), att, F.layer_norm(y, (d,))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_needs_no_context_fn(use_reentrant: bool) -> None:
    torch.manual_seed(0)
    block = _Block()

    def run(x):
        out, att, normed = block(x)
        return out + att.sum() + normed

    grads = []
    with Fp32Policy().activate():  # held through the backward, as the plugin holds it through a fit
        for use_checkpoint in (False, True):
            x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = checkpoint(run, x, use_reentrant=use_reentrant) if use_checkpoint else run(x)
            assert y.dtype == torch.float32
            y.sum().backward()
            grads.append((x.grad, *(p.grad.clone() for p in block.parameters())))
            block.zero_grad()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _count_graphs(model: nn.Module, x: torch.Tensor, backend: str, dtype: torch.dtype):
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        if backend == "eager":
            return gm.forward
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting_backend, fullgraph=True)
    with torch.autocast("cpu", dtype=dtype):
        out = compiled(x)
        out[0].float().sum().backward()
        compiled(x)  # no recompile on the second call
    return len(graphs), out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("dtype", LOW)
def test_compile_fullgraph_as_many_graphs_as_without_the_policy(backend: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _Block())  # the LayerNorm then sees a 16-bit input
    x = torch.randn(2, 5, 16)
    plain_graphs, plain = _count_graphs(model, x, backend, dtype)
    assert plain[1].dtype == dtype  # CPU autocast alone: a 16-bit softmax
    policy = Fp32Policy()
    with policy.install(model, "cpu"), policy.activate():
        graphs, out = _count_graphs(model, x, backend, dtype)
        with torch.autocast("cpu", dtype=dtype):
            eager = model(x)
    assert graphs == plain_graphs == 1
    assert out[1].dtype == out[2].dtype == torch.float32  # the listed softmax and layer_norm
    for a, b in zip(out, eager):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "compiled",
    [False, pytest.param(True, marks=pytest.mark.skipif(
        torch.__version__ < "2.13", reason="Dynamo in torch < 2.13 traces no torch.set_autocast_dtype (the FP32 "
        "forward of a subtree with 16-bit parameters sets FP32 as autocast's dtype; torch.autocast refuses FP32 on a "
        "CPU): fullgraph=True refuses it"))],
)  # fmt: skip
def test_a_listed_module_computes_in_fp32_through_its_subtree_also_with_16_bit_parameters(compiled: bool) -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(16).bfloat16()  # e.g. a frozen part loaded in bf16
            self.lin = nn.Linear(16, 4).bfloat16()

        def forward(self, x):
            return self.lin(self.norm(x))

    model = nn.Sequential(nn.Linear(16, 16), Head(), nn.BatchNorm1d(4).bfloat16())
    x = torch.randn(2, 16)
    policy = Fp32Policy(modules=DEFAULT_FP32_MODULES + (Head,))
    torch._dynamo.reset()
    with policy.install(model, "cpu"), policy.activate(), torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(x)
        out = torch.compile(model, backend="eager", fullgraph=True)(x) if compiled else eager
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    # the child Linear and the listed norms ran in FP32 on upcast copies of their bf16 parameters
    assert eager.dtype == out.dtype == torch.float32
    torch.testing.assert_close(out, eager)


def test_a_hold_released_by_a_finalizer_inside_a_registration_does_not_deadlock(monkeypatch) -> None:
    """A dropped Fabric plugin releases its kernels from a finalizer, whenever the collector runs: also in the
    middle of another plugin's registration on the same thread (it hung the suite once). Simulated at the worst
    moment: inside every kernel registration."""
    from lightning_mp.policy import dispatch

    dropped = Fp32Policy(ops={"exp"}, modules=()).activate()
    real = dispatch._register

    def register_while_collecting(*args):
        dropped.remove()  # what the finalizer does
        return real(*args)

    monkeypatch.setattr(dispatch, "_register", register_while_collecting)
    worker = threading.Thread(target=lambda: Fp32Policy(ops={"log"}, modules=()).activate().remove(), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "deadlocked"
    assert not dropped.active



def test_plans_that_share_kernels_switch_them_apart_each_its_own_ops() -> None:
    """A plan's kernels move on one counter (one switch, not one per kernel); a kernel another plan also holds gets a
    counter of its own that both plans move: switching one plan on never switches the other plan's other ops."""
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    wide, narrow = Fp32Policy(), Fp32Policy(ops={"softmax"})  # the default table holds softmax and layer_norm

    def dtypes():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.softmax(x, -1).dtype, F.layer_norm(x, (8,)).dtype

    with wide.activate(on=False), narrow.activate(on=False):
        assert dtypes() == (torch.bfloat16, torch.bfloat16)  # both off: autocast's own dtypes
        with narrow.switched_on():
            assert dtypes() == (torch.float32, torch.bfloat16)  # the shared softmax on, wide's layer_norm not
        with wide.switched_on():
            assert dtypes() == (torch.float32, torch.float32)
            with narrow.switched_on():
                pass
            assert dtypes() == (torch.float32, torch.float32)  # narrow's end leaves wide's hold on softmax
        assert dtypes() == (torch.bfloat16, torch.bfloat16)
    with narrow.activate(on=False), wide.activate(on=False):  # the other order of registration
        with wide.switched_on():
            assert dtypes() == (torch.float32, torch.float32)
        with narrow.switched_on():
            assert dtypes() == (torch.float32, torch.bfloat16)
