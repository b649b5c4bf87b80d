"""Which aten overloads an ``fp32_ops`` name reaches, and which of those autocast already runs in FP32.

The FP32 policy works at the autocast dispatch keys (:mod:`lightning_mp.policy.dispatch`), where ops are aten
overloads, not Python callables. This module maps each op name to the aten overloads its callables lower to
(``softmax`` -> ``aten::softmax.int``, ``aten::_softmax``, ...) and says, per autocast key, which of them
autocast computes in FP32 by itself, so that the policy registers kernels only where autocast differs.

Some names are pure-Python composites with no aten op of their own (``F.softmin`` is ``(-x).softmax()``): they
are FP32 *through* the aten ops they call (``_COMPOSITE_VIA``) when those are listed too; otherwise the policy
falls back to a torch-function mode for them (see :mod:`lightning_mp.policy.mode`). Data, plus a resolution that
runs once per policy; nothing here is on the per-call path.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

# Aten ops reached besides the one of the same name: Python-level callables that lower to other ops.
_ATEN_EXTRA: dict[str, tuple[str, ...]] = {
    "softmax": ("_softmax",),
    "log_softmax": ("_log_softmax",),
    "layer_norm": ("native_layer_norm",),
    "group_norm": ("native_group_norm",),
    "batch_norm": ("native_batch_norm",),
    "rms_norm": ("_fused_rms_norm",),
    "cross_entropy": ("cross_entropy_loss",),
    "nll_loss": ("nll_loss_nd", "nll_loss2d"),
    # torch.norm / Tensor.norm are Python and call the linalg norms (or the legacy norm ops)
    "norm": ("frobenius_norm", "nuclear_norm", "linalg_norm", "linalg_vector_norm", "linalg_matrix_norm"),
    "vector_norm": ("linalg_vector_norm",),
    "matrix_norm": ("linalg_matrix_norm",),
    # F.interpolate (and nn.Upsample) call these; mode="area" calls adaptive_avg_pool instead (not covered)
    "interpolate": (
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    ),
    "true_divide": ("div",),  # x / y is aten::div
}

# Pure-Python composites: the listed op names through which their result is FP32, and what stays 16-bit.
_COMPOSITE_VIA: dict[str, tuple[tuple[str, ...], str]] = {
    "softmin": (("softmax",), "computes (-x).softmax(); the negation is exact"),
    "gumbel_softmax": (
        ("softmax", "log"),
        "the Gumbel noise is drawn in the logits' dtype, its log and the softmax in FP32",
    ),
    "normalize": (("vector_norm",), "x / norm(x): the norm in FP32, the division promotes to FP32"),
    "local_response_norm": (
        ("pow",),
        "as a functional its squares are averaged in 16 bits (fp16 overflows for abs(x) > 256), the pow and division "
        "in FP32; nn.LocalResponseNorm is a listed module and runs wholly in FP32",
    ),
    "gaussian_nll_loss": (("log", "pow"), "the difference input - target is rounded once to 16 bits, the rest FP32"),
    "multilabel_soft_margin_loss": (("sum",), "the per-class log-sigmoid in 16 bits, the sum and mean in FP32"),
    "triplet_margin_with_distance_loss": (
        ("pairwise_distance",),
        "with the default distance; a custom distance_function keeps its own precision",
    ),
}
_NOTES: dict[str, str] = {"interpolate": "mode='area' runs adaptive_avg_pool, which is not intercepted"}

# What autocast already computes in FP32 (its "fp32" and "fp32_set_opt_dtype" lists, torch's autocast_mode),
# overload names without "aten::". The policy registers no kernel for these on that key; one not registered
# in the running torch at all is treated as absent (see _autocast_fp32).
_CPU_FP32 = """
avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int prod.dim_Dimname quantile quantile.scalar
nanquantile nanquantile.scalar stft stft.center cdist grid_sampler_2d grid_sampler_3d trace view_as_complex
cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d max_unpool2d
max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d
replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss poisson_nll_loss
smooth_l1_loss cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss triplet_margin_loss
multi_margin_loss ctc_loss.IntList ctc_loss.Tensor kl_div multilabel_margin_loss binary_cross_entropy_with_logits
fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn
fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_cond.p_str linalg_matrix_rank linalg_solve linalg_cholesky
linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product linalg_tensorinv
linalg_tensorsolve geqrf qr svd triangular_solve fractional_max_pool2d fractional_max_pool3d
adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd linalg_eig
linalg_eigh linalg_lstsq linalg_inv_ex
"""
_CUDA_FP32 = """
acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar
pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm group_norm frobenius_norm.dim nuclear_norm
nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits
dist pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
_upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
_upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa upsample_nearest1d.vec
_upsample_nearest_exact1d.vec upsample_nearest2d.vec _upsample_nearest_exact2d.vec upsample_nearest3d.vec
_upsample_nearest_exact3d.vec upsample_linear1d.vec upsample_bilinear2d.vec _upsample_bilinear2d_aa.vec
upsample_trilinear3d.vec upsample_bicubic2d.vec _upsample_bicubic2d_aa.vec
prod prod.dim_int prod.dim_Dimname softmax.int softmax.Dimname log_softmax.int log_softmax.Dimname cumprod
cumprod.dimname cumsum cumsum.dimname linalg_vector_norm linalg_matrix_norm linalg_matrix_norm.str_ord sum
sum.dim_IntList sum.dim_DimnameList norm.Scalar norm.ScalarOpt_dim norm.names_ScalarOpt_dim
"""
AUTOCAST_KEYS: tuple[str, ...] = ("AutocastCPU", "AutocastCUDA")
_AUTOCAST_FP32_TABLE: dict[str, frozenset[str]] = {
    "AutocastCPU": frozenset(_CPU_FP32.split()),
    "AutocastCUDA": frozenset(_CUDA_FP32.split()),
}

# How a kernel treats an overload (see fp32_dispatch): upcast 16-bit tensors, or pass dtype=float32 (the
# overload has an optional dtype argument at `index`), or batch norm's mixed-dtype check.
UPCAST, SET_DTYPE, BATCH_NORM = "upcast", "set_dtype", "batch_norm"
_BATCH_NORM_PACKETS = frozenset({"batch_norm", "native_batch_norm"})


class Rule(NamedTuple):
    kind: str
    dtype_index: int = -1  # SET_DTYPE: position of dtype in the schema
    dtype_kwarg_only: bool = False
    # an op of the default table the policy leaves out, where autocast itself would run it in FP32: the kernel
    # calls it as given (16 bits), as autocast does for an op on none of its lists; `kind` is what autocast's own
    # FP32 kernel did (for a kernel that no hold switches on)
    lower: bool = False


class OpReach(NamedTuple):
    """Where one op name becomes FP32."""

    packets: tuple[str, ...]  # aten ops it lowers to (none: a pure-Python composite)
    via_names: tuple[str, ...]  # composite: the op names that make its result FP32 when listed
    via: frozenset[str]  # ... and their aten ops: covered when all of them have kernels (or are autocast's)
    note: str


def _packet_exists(packet: str) -> bool:
    return bool(_overloads(packet))


@functools.lru_cache(maxsize=None)
def _overloads(packet: str) -> tuple[tuple[str, Rule], ...]:
    """The functional dispatcher overloads of one aten op and their rules: out=/in-place overloads, TorchScript
    scalar overloads (no tensor argument) and overloads whose dtype is mandatory (an explicit precision) are left
    out."""
    try:
        ops = getattr(torch.ops.aten, packet)
    except (AttributeError, RuntimeError):
        return ()
    found: list[tuple[str, Rule]] = []
    for overload in ops.overloads():
        schema = getattr(ops, overload)._schema
        if schema.is_mutable or any(arg.is_out for arg in schema.arguments):
            continue
        if not any("Tensor" in str(arg.type) for arg in schema.arguments):
            continue
        try:
            torch._C._dispatch_find_schema_or_throw(f"aten::{packet}", "" if overload == "default" else overload)
        except RuntimeError:
            continue
        rule = Rule(BATCH_NORM) if packet in _BATCH_NORM_PACKETS else Rule(UPCAST)
        for index, arg in enumerate(schema.arguments):
            if arg.name == "dtype":  # a ScalarType ("int" in the Python schema)
                if str(arg.type).startswith("Optional"):
                    rule = Rule(SET_DTYPE, index, arg.kwarg_only)
                else:
                    rule = None  # a mandatory dtype: the caller chose the precision
        if rule is not None:
            name = packet if overload == "default" else f"{packet}.{overload}"
            found.append((name, rule))
    return tuple(found)


def reach_of(name: str, aliases: tuple[tuple[str, Callable[..., Any]], ...]) -> OpReach:
    """The aten packets an op name reaches (its own, those in ``_ATEN_EXTRA`` and, for builtin callables, the op
    they are bound to, e.g. ``F.logsigmoid`` -> ``log_sigmoid``), or how a pure-Python composite becomes FP32."""
    packets: list[str] = []
    candidates = ["" if "." in name else name, *_ATEN_EXTRA.get(name, ())]
    for _, func in aliases:
        if not isinstance(func, types.FunctionType):  # a C-bound callable: its __name__ is the aten op
            bound = getattr(func, "__name__", "")
            if not (bound.startswith("special_") and bound[len("special_"):] == name):  # an alias that calls `name`
                candidates.append(bound)
    for packet in candidates:
        if packet and packet not in packets and _packet_exists(packet):
            packets.append(packet)
    if packets:
        return OpReach(tuple(packets), (), frozenset(), _NOTES.get(name, ""))
    via_names, note = _COMPOSITE_VIA.get(name, ((), ""))
    via = frozenset(p for n in via_names for p in (n, *_ATEN_EXTRA.get(n, ())) if _packet_exists(p))
    return OpReach((), via_names, via, note)


def _autocast_fp32(key: str, overload: str) -> bool:
    """Whether autocast itself runs this overload in FP32 on ``key``: listed in the table, and its kernel is
    registered in the running torch (named-tensor overloads, for one, are gone from recent builds)."""
    if overload not in _AUTOCAST_FP32_TABLE[key]:
        return False
    # F.interpolate's upsample_*.vec overloads are composites that call the default overload, where autocast's
    # kernel sits
    packet, _, name = overload.removesuffix(".vec").partition(".")
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{packet}" + (f".{name}" if name else ""), key)
    except RuntimeError:  # no such operator in this build
        return False


def kernel_plan(packets: frozenset[str], lowered: frozenset[str] = frozenset()) -> dict[tuple[str, str], Rule]:
    """(autocast key, overload) -> rule for every overload of ``packets`` that autocast does not already run in
    FP32 on that key, and (``rule.lower``) for every overload of ``lowered`` (the aten ops of the default table's
    names the policy leaves out) that autocast does run in FP32 on that key."""
    plan: dict[tuple[str, str], Rule] = {}
    for packet in sorted(packets):
        for overload, rule in _overloads(packet):
            for key in AUTOCAST_KEYS:
                if not _autocast_fp32(key, overload):
                    plan[(key, overload)] = rule
    for packet in sorted(lowered - packets):
        for overload, rule in _overloads(packet):
            for key in AUTOCAST_KEYS:
                if _autocast_fp32(key, overload) and not overload.endswith(".vec"):
                    plan[(key, overload)] = rule._replace(lower=True)
    return plan
