"""The default FP32 op and module lists, each entry with the reason it is FP32 (``describe()`` prints them).

Data only: what a name covers is resolved in :mod:`lightning_mp.policy.names`, how a listed op runs in FP32 is
:mod:`lightning_mp.policy.mode`, how a listed module does is :mod:`lightning_mp.policy.modules`.
"""

from __future__ import annotations

import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

# --------------------------------------------------------------------------------------
# Default op list. Every entry carries the reason it is FP32; describe() prints it.
# --------------------------------------------------------------------------------------

_WHY_SOFTMAX = (
    "exp of the logits then a normalising sum over the row; a 16-bit result keeps "
    "only 8 (bf16) / 11 (fp16) significant bits of each (log-)probability, and fp16 "
    "rounds probabilities below 3e-8 to zero (below 6e-5 it is subnormal, fewer bits)"
)
_WHY_NORM_LAYER = (
    "mean and variance over many elements; squares of activations above 256 "
    "overflow fp16, and 1/sqrt(var + eps) amplifies the rounding of a small variance"
)
_WHY_LOSS = (
    "log/exp of probabilities and a reduction over the batch; the scalar loss that "
    "seeds backward and gets logged should be exact (CPU autocast already does this "
    "for most losses, CUDA autocast for all; CUDA autocast even refuses "
    "binary_cross_entropy in 16 bits as unsafe)"
)
_WHY_DISTANCE = "sums of squares or products over a vector: overflow fp16 and round to 16 bits"
_WHY_REDUCTION = (
    "a long reduction rounded to 16 bits: bf16 keeps 8 significant bits (the sum of "
    "257 ones is 256), fp16 overflows at 65504; cumulative ops round every partial "
    "result and products over/underflow quickly"
)
_WHY_POINTWISE = (
    "wide dynamic range: exp overflows fp16 above x = 11.09, pow(x, 2) once abs(x) > 256, "
    "log/log1p/expm1/erfinv lose relative precision near their special points "
    "(autocast's CUDA FP32 list)"
)

_WHY_RESAMPLE = (
    "CUDA autocast runs upsampling in FP32 (interpolation weights and the antialiased "
    "weighted sums round in 16 bits); listed so every device matches. For mode='nearest' "
    "it only costs memory (FP32 output)"
)

_OP_GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "softmax family",
        _WHY_SOFTMAX,
        ("softmax", "log_softmax", "softmin", "gumbel_softmax"),
    ),
    (
        "normalisation functionals",
        _WHY_NORM_LAYER,
        (
            "layer_norm",
            "group_norm",
            "batch_norm",
            "instance_norm",
            "rms_norm",
            "local_response_norm",
            "normalize",
        ),
    ),
    (
        "losses",
        _WHY_LOSS,
        (
            "cross_entropy",
            "nll_loss",
            "binary_cross_entropy",
            "binary_cross_entropy_with_logits",
            "kl_div",
            "mse_loss",
            "l1_loss",
            "smooth_l1_loss",
            "huber_loss",
            "poisson_nll_loss",
            "gaussian_nll_loss",
            "cosine_embedding_loss",
            "hinge_embedding_loss",
            "margin_ranking_loss",
            "multilabel_margin_loss",
            "multilabel_soft_margin_loss",
            "multi_margin_loss",
            "soft_margin_loss",
            "triplet_margin_loss",
            "triplet_margin_with_distance_loss",
            "ctc_loss",
        ),
    ),
    (
        "distances",
        _WHY_DISTANCE,
        ("cosine_similarity", "pairwise_distance", "pdist", "cdist", "dist", "renorm"),
    ),
    (
        "reductions",
        _WHY_REDUCTION,
        (
            "sum",
            "nansum",
            "mean",
            "nanmean",
            "prod",
            "cumsum",
            "cumprod",
            "logcumsumexp",
            "logsumexp",
            "norm",
            "vector_norm",
            "matrix_norm",
        ),
    ),
    (
        "pointwise transcendentals",
        _WHY_POINTWISE,
        (
            "exp",
            "expm1",
            "log",
            "log10",
            "log2",
            "log1p",
            "pow",
            "reciprocal",
            "rsqrt",
            "acos",
            "asin",
            "cosh",
            "sinh",
            "tan",
            "erfinv",
            "softplus",
        ),
    ),
    (
        "resampling",
        _WHY_RESAMPLE,
        # F.upsample* and nn.Upsample call F.interpolate, which lowers to the aten upsample_* ops.
        ("interpolate",),
    ),
)

_OP_NOTES: dict[str, str] = {name: why for _, why, names in _OP_GROUPS for name in names}
_GROUP_NOTES: dict[str, str] = {group: why for group, why, _ in _OP_GROUPS}
_OP_GROUP_OF: dict[str, str] = {name: group for group, _, names in _OP_GROUPS for name in names}

DEFAULT_FP32_OPS: frozenset[str] = frozenset(_OP_NOTES)
"""Op names computed in FP32 by default.

Covers autocast's CUDA FP32 lists (softmax/log_softmax, layer_norm/group_norm,
the losses, sum/prod/cumsum/cumprod, the norms, logsumexp, exp/log/pow and the
other transcendentals, the distances, upsampling), plus the pure-Python composites
of those (``softmin``, ``normalize``, ``gumbel_softmax``, ``local_response_norm``: FP32
through the listed ops they call), ``instance_norm``, ``rms_norm``, ``batch_norm``
and ``mean``/``nanmean``/``nansum`` (same numerics as ``sum``). ``var``/``std`` are left out, as on CUDA: their
16-bit results are only wrong when the variance itself exceeds the range.
Entries are plain names; see ``Fp32Policy`` for what a name covers.
"""

FP16_RANGE_OPS: frozenset[str] = frozenset(
    next(names for group, _, names in _OP_GROUPS if group == "pointwise transcendentals")
)
"""The pointwise transcendentals: listed for fp16's range (``exp`` overflows above 11.09, ``pow(x, 2)`` above 256).
bf16 has FP32's exponent range, and torch computes a 16-bit pointwise op in FP32 inside the kernel (its "opmath"
type, on CPU and CUDA) and rounds the result to bf16: within half a bf16 ulp of the exact value, 1.5 for ``pow``
with an integer exponent of 3 or more and the CPU's vectorised ``rsqrt`` (tests/test_fp32_dispatch.py). So in bf16
listing one buys about an ulp of the op's own result and changes its output's dtype: an FP32 output turns the ops that consume it into mixed-dtype FP32 ops
(GPT-2's GELU, ``x * (1 + tanh(c * (x + a * x**3)))``, then runs in FP32: 1.9 against 1.1 ms for its forward and
backward at 512 x 256 on a CPU, where Lightning's ``bf16-mixed`` keeps it in 16 bits)."""

BF16_FP32_OPS: frozenset[str] = DEFAULT_FP32_OPS - FP16_RANGE_OPS - {
    # pure-Python composites FP32 only through a range op they call (see policy.aten._COMPOSITE_VIA); their
    # reductions, softmax and losses stay FP32
    "gaussian_nll_loss", "gumbel_softmax", "local_response_norm",
}
"""The bf16 default: ``DEFAULT_FP32_OPS`` without ``FP16_RANGE_OPS``, which run in bf16 on every device (where
autocast's own list runs one in FP32, CUDA's does for all of them, the policy keeps it in bf16: see
``Fp32Policy``). The softmax family, normalisation, losses, distances and reductions, the ops whose accuracy FP32
buys, stay."""

# Extra callables that belong to an op name but are not found under that name in
# the torch namespaces (operator dunders, native aliases).
_EXTRA_ALIASES: dict[str, tuple[tuple[str, str], ...]] = {
    "pow": (("Tensor", "__pow__"), ("Tensor", "__rpow__")),
    "matmul": (("Tensor", "__matmul__"), ("Tensor", "__rmatmul__")),
    "add": (("Tensor", "__add__"), ("Tensor", "__radd__")),
    "sub": (("Tensor", "__sub__"), ("Tensor", "__rsub__")),
    "mul": (("Tensor", "__mul__"), ("Tensor", "__rmul__")),
    "div": (("Tensor", "__truediv__"), ("Tensor", "__rtruediv__")),
    "true_divide": (("Tensor", "__truediv__"), ("Tensor", "__rtruediv__")),
    "floor_divide": (("Tensor", "__floordiv__"), ("Tensor", "__rfloordiv__")),
    "remainder": (("Tensor", "__mod__"), ("Tensor", "__rmod__")),
    "layer_norm": (("torch", "native_layer_norm"),),
    "batch_norm": (("torch", "native_batch_norm"),),
    "norm": (("torch", "frobenius_norm"), ("torch", "nuclear_norm")),
}
_DUNDER_TO_OP: dict[str, str] = {
    attr: op for op, extras in _EXTRA_ALIASES.items() for ns, attr in extras if attr.startswith("__")
}
# "div" and "true_divide" share dunders; a dunder maps to the shorter, common name.
_DUNDER_TO_OP["__truediv__"] = _DUNDER_TO_OP["__rtruediv__"] = "div"

# --------------------------------------------------------------------------------------
# Default module list.
# --------------------------------------------------------------------------------------

NORM_MODULES: tuple[type[nn.Module], ...] = tuple(
    cls
    for cls in (
        nn.LayerNorm,
        nn.GroupNorm,
        _BatchNorm,  # BatchNorm1d/2d/3d, SyncBatchNorm, LazyBatchNorm*
        _InstanceNorm,  # InstanceNorm1d/2d/3d, LazyInstanceNorm*
        getattr(nn, "RMSNorm", None),  # torch >= 2.4
        nn.LocalResponseNorm,
    )
    if cls is not None
)
"""Normalisation layers: their statistics need FP32 (see ``_WHY_NORM_LAYER``)."""

RECURRENT_MODULES: tuple[type[nn.Module], ...] = (nn.RNNBase, nn.RNNCellBase)
"""RNN, LSTM, GRU and their Cell variants."""

EMBEDDING_MODULES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)
"""Embedding tables: a lookup has no arithmetic for 16 bits to speed up, and its output starts the residual stream."""

DEFAULT_FP32_MODULES: tuple[type[nn.Module], ...] = NORM_MODULES + RECURRENT_MODULES + EMBEDDING_MODULES
"""Module classes whose own parameters stay FP32 and whose forward runs in FP32.

``NORM_MODULES`` (LayerNorm, GroupNorm, BatchNorm*/SyncBatchNorm, InstanceNorm*,
RMSNorm, LocalResponseNorm): statistics over many elements, tiny parameter count,
so FP32 is nearly free.

``RECURRENT_MODULES`` (RNN/LSTM/GRU and the Cell variants) are in the default,
deliberately:

* It makes fp16 training *work*: under ``torch.autocast("cpu", dtype=torch.float16)``
  an ``nn.LSTM`` fed an FP32 tensor fails inside oneDNN ("could not create a
  primitive descriptor for the LSTM forward propagation primitive"). FP32 inputs
  are exactly what this policy's own FP32 norm layers and ops produce (and what an
  embedding or the raw data give), so e.g. Embedding -> LayerNorm -> LSTM trains
  in fp16 on CPU with this default and crashes with ``NORM_MODULES`` alone
  (verified with a Lightning Trainer). A user who switches a CPU run to fp16
  expects it to just work; a default that crashes is worse than one that is slower.
* Numerics: the hidden/cell state is fed back every time step, so 16-bit rounding
  of the state compounds over the sequence length.
* Consistency: CPU autocast already runs GRU, LSTMCell and GRUCell in FP32 and only
  LSTM/RNN(Cell) in 16 bits; listing all of them makes every device alike.
* Cost: the recurrent layer gives up the 16-bit speed-up (on a CPU with native bf16
  about 1.8x for an LSTM's forward+backward; on CUDA the loss of tensor-core fp16
  can cost more for RNN-dominated models). Such models can opt out with
  ``Fp32Policy(modules=NORM_MODULES + EMBEDDING_MODULES)``.

``EMBEDDING_MODULES`` (Embedding, EmbeddingBag) keep an FP32 table, so the residual
stream of a transformer starts, and stays, in FP32: ``x = x + block(x)`` with an FP32
``x`` and a 16-bit block output adds in FP32, as under Lightning's ``bf16-mixed``
(autocast leaves embeddings alone) and Megatron's ``fp32_residual_connection``. With a
16-bit table every residual add rounds to 16 bits and the rounding compounds over the
layers. A lookup
does no arithmetic 16 bits could speed up; the cost is 2 more bytes per embedding
parameter, and an output head tied to the table stays FP32 too (autocast casts it for
the matmul, as it does for every FP32 weight).
"""


# Ops whose callables take a ``dtype=`` that casts the input before computing; the
# policy passes dtype=torch.float32 instead of copying a 16-bit input (CUDA autocast's
# "fp32_set_opt_dtype" treatment). Every alias of these names takes dtype= (ATen schema
# "ScalarType? dtype=None"; F.softmax/F.log_softmax forward it); a test checks each.
_DTYPE_OPS = frozenset(
    {"softmax", "log_softmax", "sum", "nansum", "mean", "nanmean", "prod", "cumsum", "cumprod",
     "vector_norm", "matrix_norm"}
)
