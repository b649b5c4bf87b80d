"""Every op of the default FP32 list returns FP32 under autocast with the policy on, in fp16 and bf16, on the test's
device: the CPU by default, the GPU under ``pytest --device cuda`` (the CUDA suite), where the policy's kernels at
the AutocastCUDA key and CUDA autocast's own FP32 list meet. No Trainer.

What differs on CUDA by design: CUDA autocast runs many of these ops in FP32 by itself (softmax, layer_norm, sum,
exp, the losses, upsampling...; CPU autocast only a few losses, prod and cdist), so there the policy's own kernels
are the rest (mean, batch_norm, rms_norm, binary_cross_entropy...: ``Fp32Policy.kernel_plan()``). The other way
round, the bf16 default leaves the pointwise transcendentals out (``FP16_RANGE_OPS``), and its kernels keep them in
bf16 on CUDA too, where CUDA autocast alone would run them in FP32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_mp import FP16_RANGE_OPS, MixedPrecisionPlugin
from lightning_mp.policy.policy import DEFAULT_FP32_OPS, Fp32Policy
from tests.conftest import device

pytestmark = pytest.mark.on_device

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def _nondeterministic_allowed():
    # a Trainer built with deterministic=True (tests.conftest.trainer_kwargs) leaves torch's deterministic mode on for
    # the rest of the process, and in it a floating-point cumsum on CUDA raises; these tests train nothing
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _inputs(dtype: torch.dtype, dev: str) -> dict[str, torch.Tensor]:
    """16-bit inputs (an FP32 one would make any op's result FP32), built before autocast is entered."""
    g = torch.Generator().manual_seed(0)

    def low(*shape, lo=None, hi=None):
        t = torch.randn(*shape, generator=g) if lo is None else torch.rand(*shape, generator=g) * (hi - lo) + lo
        return t.to(device=dev, dtype=dtype)

    sign = torch.where(torch.rand(4, 8, generator=g) < 0.5, -1.0, 1.0)
    labels = torch.full((4, 8), -1, dtype=torch.long)  # multilabel_margin_loss: the targets, then -1
    labels[:, 0], labels[:, 1] = torch.tensor([0, 3, 5, 7]), torch.tensor([1, 2, 4, 6])
    return {
        "x": low(4, 8), "y": low(4, 8), "z": low(4, 8),
        "positive": low(4, 8, lo=0.1, hi=4.0), "unit": low(4, 8, lo=-0.9, hi=0.9), "prob": low(4, 8, lo=0.05, hi=0.95),
        "sign": sign.to(device=dev, dtype=dtype), "sign4": sign[:, 0].to(device=dev, dtype=dtype),
        "binary": (sign > 0).to(device=dev, dtype=dtype),
        "stats": (torch.zeros(8, device=dev, dtype=dtype), torch.ones(8, device=dev, dtype=dtype)),
        "classes": torch.tensor([0, 3, 5, 7], device=dev), "labels": labels.to(dev),
        # ctc: T=8 steps, N=2 sequences, C=5 classes (0 the blank), targets of length 3
        "log_probs": torch.randn(8, 2, 5, generator=g).log_softmax(-1).to(device=dev, dtype=dtype),
        "ctc_targets": torch.tensor([[1, 2, 3], [4, 1, 2]], device=dev),
        "ctc_lengths": (torch.full((2,), 8, dtype=torch.long, device=dev), torch.full((2,), 3, device=dev)),
    }


# one call per listed name, as a user writes it (the functional or the Tensor method)
CALLS = {
    # softmax family
    "softmax": lambda t: F.softmax(t["x"], dim=-1),
    "log_softmax": lambda t: F.log_softmax(t["x"], dim=-1),
    "softmin": lambda t: F.softmin(t["x"], dim=-1),
    "gumbel_softmax": lambda t: F.gumbel_softmax(t["x"], tau=1.0),
    # normalisation functionals
    "layer_norm": lambda t: F.layer_norm(t["x"], (8,)),
    "group_norm": lambda t: F.group_norm(t["x"].view(4, 8, 1), 2),
    # 16-bit statistics (FP32 ones keep a 16-bit input's batch_norm mixed-dtype: tests/test_fp32_dispatch.py)
    "batch_norm": lambda t: F.batch_norm(t["x"], *t["stats"], training=True),
    "instance_norm": lambda t: F.instance_norm(t["x"].view(2, 4, 4)),
    "rms_norm": lambda t: F.rms_norm(t["x"], (8,)),
    "local_response_norm": lambda t: F.local_response_norm(t["x"].view(4, 8, 1), 2),
    "normalize": lambda t: F.normalize(t["x"], dim=-1),
    # losses
    "cross_entropy": lambda t: F.cross_entropy(t["x"], t["classes"]),
    "nll_loss": lambda t: F.nll_loss(t["x"], t["classes"]),
    "binary_cross_entropy": lambda t: F.binary_cross_entropy(t["prob"], t["binary"]),
    "binary_cross_entropy_with_logits": lambda t: F.binary_cross_entropy_with_logits(t["x"], t["binary"]),
    "kl_div": lambda t: F.kl_div(t["x"], t["prob"], reduction="batchmean"),
    "mse_loss": lambda t: F.mse_loss(t["x"], t["y"]),
    "l1_loss": lambda t: F.l1_loss(t["x"], t["y"]),
    "smooth_l1_loss": lambda t: F.smooth_l1_loss(t["x"], t["y"]),
    "huber_loss": lambda t: F.huber_loss(t["x"], t["y"]),
    "poisson_nll_loss": lambda t: F.poisson_nll_loss(t["x"], t["positive"]),
    "gaussian_nll_loss": lambda t: F.gaussian_nll_loss(t["x"], t["y"], t["positive"]),
    "cosine_embedding_loss": lambda t: F.cosine_embedding_loss(t["x"], t["y"], t["sign4"]),
    "hinge_embedding_loss": lambda t: F.hinge_embedding_loss(t["x"], t["sign"]),
    "margin_ranking_loss": lambda t: F.margin_ranking_loss(t["x"][:, 0], t["y"][:, 0], t["sign4"]),
    "multilabel_margin_loss": lambda t: F.multilabel_margin_loss(t["x"], t["labels"]),
    "multilabel_soft_margin_loss": lambda t: F.multilabel_soft_margin_loss(t["x"], t["binary"]),
    "multi_margin_loss": lambda t: F.multi_margin_loss(t["x"], t["classes"]),
    "soft_margin_loss": lambda t: F.soft_margin_loss(t["x"], t["sign"]),
    "triplet_margin_loss": lambda t: F.triplet_margin_loss(t["x"], t["y"], t["z"]),
    "triplet_margin_with_distance_loss": lambda t: F.triplet_margin_with_distance_loss(t["x"], t["y"], t["z"]),
    "ctc_loss": lambda t: F.ctc_loss(t["log_probs"], t["ctc_targets"], *t["ctc_lengths"]),
    # distances
    "cosine_similarity": lambda t: F.cosine_similarity(t["x"], t["y"]),
    "pairwise_distance": lambda t: F.pairwise_distance(t["x"], t["y"]),
    "pdist": lambda t: F.pdist(t["x"]),
    "cdist": lambda t: torch.cdist(t["x"], t["y"]),
    "dist": lambda t: torch.dist(t["x"], t["y"]),
    "renorm": lambda t: t["x"].renorm(2, 0, 1.0),
    # reductions
    "sum": lambda t: t["x"].sum(),
    "nansum": lambda t: t["x"].nansum(),
    "mean": lambda t: t["x"].mean(),
    "nanmean": lambda t: t["x"].nanmean(),
    "prod": lambda t: t["positive"].prod(),
    "cumsum": lambda t: t["x"].cumsum(0),
    "cumprod": lambda t: t["x"].cumprod(0),
    "logcumsumexp": lambda t: t["x"].logcumsumexp(0),
    "logsumexp": lambda t: torch.logsumexp(t["x"], -1),
    "norm": lambda t: t["x"].norm(),
    "vector_norm": lambda t: torch.linalg.vector_norm(t["x"]),
    "matrix_norm": lambda t: torch.linalg.matrix_norm(t["x"]),
    # pointwise transcendentals
    "exp": lambda t: t["x"].exp(),
    "expm1": lambda t: t["x"].expm1(),
    "log": lambda t: t["positive"].log(),
    "log10": lambda t: t["positive"].log10(),
    "log2": lambda t: t["positive"].log2(),
    "log1p": lambda t: t["positive"].log1p(),
    "pow": lambda t: t["x"] ** 2,
    "reciprocal": lambda t: t["positive"].reciprocal(),
    "rsqrt": lambda t: t["positive"].rsqrt(),
    "acos": lambda t: t["unit"].acos(),
    "asin": lambda t: t["unit"].asin(),
    "cosh": lambda t: t["x"].cosh(),
    "sinh": lambda t: t["x"].sinh(),
    "tan": lambda t: t["unit"].tan(),
    "erfinv": lambda t: t["unit"].erfinv(),
    "softplus": lambda t: F.softplus(t["x"]),
    # resampling
    "interpolate": lambda t: F.interpolate(t["x"].view(1, 1, 4, 8), scale_factor=2.0, mode="bilinear"),
}


def test_every_listed_op_has_a_call_here():
    assert set(CALLS) == set(DEFAULT_FP32_OPS)  # a new entry of the list gets its call in CALLS


def _results(policy: Fp32Policy, dtype: torch.dtype, names=tuple(CALLS)) -> dict[str, torch.dtype]:
    dev = device()
    inputs = _inputs(dtype, dev)
    with torch.autocast(dev, dtype=dtype), policy.op_context():
        results = {name: CALLS[name](inputs) for name in names}
        unlisted = inputs["x"].tanh(), inputs["x"] @ inputs["y"].T
    assert all(out.device.type == dev for out in results.values())
    assert [t.dtype for t in unlisted] == [dtype, dtype]  # what the policy does not list stays in 16 bits
    return {name: out.dtype for name, out in results.items()}


@pytest.fixture(scope="module")
def default_policy() -> Fp32Policy:
    return Fp32Policy(DEFAULT_FP32_OPS)


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("precision", LOW)
def test_every_op_of_the_default_list_returns_fp32(default_policy, precision, name):
    """``DEFAULT_FP32_OPS`` (the fp16 default; bf16 with ``fp32_ops=DEFAULT_FP32_OPS``), one op at a time."""
    assert _results(default_policy, LOW[precision], names=(name,)) == {name: torch.float32}


@pytest.mark.parametrize("precision", LOW)
def test_the_plugins_default_list_returns_fp32_and_keeps_the_bf16_range_ops_in_bf16(precision):
    """The list a ``MixedPrecisionPlugin(precision)`` activates: every op of it returns FP32; in bf16 the pointwise
    transcendentals it leaves out return bf16, also on CUDA, where autocast's own list would run them in FP32."""
    policy = MixedPrecisionPlugin(precision).policy
    dtypes = _results(policy, LOW[precision])
    assert {name for name in policy.ops if dtypes[name] != torch.float32} == set()
    left_out = FP16_RANGE_OPS - policy.ops
    assert left_out == (FP16_RANGE_OPS if precision == "bf16" else frozenset())
    assert {name for name in left_out if dtypes[name] != LOW[precision]} == set()
