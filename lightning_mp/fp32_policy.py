"""Explicit, user-editable FP32 policy for mixed precision training.

Why this module exists
----------------------
``torch.autocast`` decides per op whether it runs in 16 bits or in FP32, and the
lists differ per device. Measured with torch 2.13 on CPU, autocast leaves
``softmax``, ``log_softmax``, ``layer_norm``, ``group_norm``, ``sum``, ``mean``,
``cumsum``, ``exp``, ``norm`` and ``logsumexp`` in 16 bits (only the losses are
moved to FP32), while CUDA autocast runs all of them but ``mean`` in FP32. The same model
therefore trains with different numerics on the two devices. This module makes
the FP32 part explicit and identical everywhere:

* ``DEFAULT_FP32_OPS`` -- op names that always compute in FP32 (everything on
  autocast's CUDA FP32 lists, plus ``mean`` and the other norm functionals).
* ``DEFAULT_FP32_MODULES`` -- module classes whose own parameters stay FP32 and
  whose forward runs in FP32 (normalisation layers and recurrent layers).
* ``Fp32Policy`` -- validates a custom selection and applies it:
  ``op_context()`` for ops, ``install()`` for modules, ``describe()`` for docs.

Users edit the lists with ordinary set/tuple operations::

    Fp32Policy(ops=DEFAULT_FP32_OPS - {"softmax"})
    Fp32Policy(ops=DEFAULT_FP32_OPS | {"tanh", torch.sigmoid})
    Fp32Policy(modules=NORM_MODULES)                      # RNNs back to 16 bits

What "an op runs in FP32" means
-------------------------------
The contract is the one of autocast's FP32 list: every 16-bit floating tensor
argument (float16 / bfloat16, also inside tuples, lists and dicts) is upcast to
float32, the op runs with autocast disabled for the devices of its tensors (so
an op that autocast would lower, e.g. a user-added ``"matmul"``, is not cast
back down), and the result is therefore FP32. (Ops that take a ``dtype=``
argument -- softmax, log_softmax, sum, mean, prod, cumsum, cumprod, the linalg
norms -- are instead called with ``dtype=torch.float32``, as CUDA autocast does:
same result, and kernels that can convert on the fly skip the FP32 copy of the
input.) Integer and bool tensors, FP32
and FP64 tensors are passed through unchanged. Calls with an explicit ``dtype=``
or ``out=`` are left exactly as written (the caller chose the precision;
autocast does the same). In-place variants (``exp_``, ``__ipow__``) can never
be FP32 -- they must write into the 16-bit tensor -- and are rejected.

How ops are intercepted, and what it costs
------------------------------------------
``op_context()`` pushes a ``torch.overrides.TorchFunctionMode``. While it is
active *every* torch call made from Python (functions, ``Tensor`` methods,
even attribute reads such as ``x.shape``) first goes through the mode's
``__torch_function__``. For an op that is not listed, that costs one dict lookup
plus the re-call of the function. The mode is pure Python, so this is a fixed
cost per torch call, independent of tensor size: measured on a 2-core CPU,
~1.3-2 us for C-level ops, methods and attribute reads, ~3-4.5 us for torch
functions written in Python (torch's own ``handle_torch_function`` path). A
small GPT forward makes ~100-150 such calls, i.e. ~0.2 ms per step.
A listed op additionally pays ~4-10 us of bookkeeping, the upcast copies (read 2
bytes, write 4 bytes per element of each 16-bit input), two autocast state
toggles and an FP32 output that is twice the size of the 16-bit one (autograd
may save it for the backward pass, e.g. the softmax probabilities). These are
the same copies and sizes CUDA autocast has for its FP32 ops.

Measured on a 2-core CPU (one thread, CPU time, paired steps): on the demo GPT
(4 layers x 256, batch 16 x 128, fused ``scaled_dot_product_attention``)
``op_context()`` + ``install()`` cost +1% per training step, within the noise.
Attention written with an explicit ``F.softmax`` pays for the FP32 probabilities:
+2.8 ms per layer for a 16x4x128x128 score matrix (forward + backward), ~7-10% of
that step. CUDA autocast pays the same; the probabilities are rounded to 16 bits
again for the following matmul, so ``DEFAULT_FP32_OPS - {"softmax"}`` is a
reasonable trade there.
All callables that reach the mode for one op name -- ``torch.X``,
``torch.nn.functional.X``, ``Tensor.X``, ``torch.special.X``, ``torch.linalg.X``
and operator dunders such as ``Tensor.__pow__`` -- are precomputed into one dict,
so the per-call test never looks at names.

Known limitation: the body of a Python-level torch function runs with the mode
suspended (that is how ``TorchFunctionMode`` re-dispatch works). Ops called from
*inside* such a composite are therefore not seen, e.g. the softmax inside
``F.multi_head_attention_forward(need_weights=True)``. Composites whose result
should be FP32 are listed themselves (``softmin``, ``normalize``,
``gumbel_softmax``, ``local_response_norm``, the ``*_loss`` functions). Fused
kernels (``scaled_dot_product_attention``) are not affected by any of this.
Activation checkpointing recomputes the forward outside the mode; use
``torch.utils.checkpoint(..., use_reentrant=False,
context_fn=policy.checkpoint_context_fn())``. The mode is meant for eager
execution; it is not designed for ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.overrides import TorchFunctionMode

from lightning_mp.formats import HALF_DTYPES

__all__ = [
    "DEFAULT_FP32_MODULES",
    "DEFAULT_FP32_OPS",
    "EMBEDDING_MODULES",
    "NORM_MODULES",
    "RECURRENT_MODULES",
    "Fp32ModuleHandle",
    "Fp32Policy",
]

OpSpec = Union[str, Callable[..., Any]]

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
        # F.upsample* and nn.Upsample call F.interpolate, which the mode sees.
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
other transcendentals, the distances, upsampling), plus what CUDA gets through
dispatcher-level casting but a Python-level mode has to name explicitly
(``softmin``, ``normalize``, ``gumbel_softmax``, ``local_response_norm``,
``instance_norm``, ``rms_norm``, ``batch_norm``) and ``mean``/``nanmean``/``nansum``
(same numerics as ``sum``). ``var``/``std`` are left out, as on CUDA: their
16-bit results are only wrong when the variance itself exceeds the range.
Entries are plain names; see ``Fp32Policy`` for what a name covers.
"""

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
* Cost: the recurrent layer gives up the 16-bit speed-up. On this 2-core
  AVX512-BF16 CPU an LSTM(256, 256), seq 128 x batch 16, forward+backward took
  ~43 ms in FP32 vs ~24 ms under bf16 autocast (~1.8x); on CUDA the loss of
  tensor-core fp16 can cost more for RNN-dominated models. Such models can opt
  out with ``Fp32Policy(modules=NORM_MODULES + EMBEDDING_MODULES)``.

``EMBEDDING_MODULES`` (Embedding, EmbeddingBag) keep an FP32 table, so the residual
stream of a transformer starts, and stays, in FP32: ``x = x + block(x)`` with an FP32
``x`` and a 16-bit block output adds in FP32, as under Lightning's ``bf16-mixed``
(autocast leaves embeddings alone) and Megatron's ``fp32_residual_connection``. With a
16-bit table every residual add rounds to 16 bits and the rounding compounds over the
layers: the demo GPT (4 layers, 800 steps, bf16) reached a validation loss of 2.210
with a bf16 embedding against 2.134 with an FP32 one (FP32 training: 2.133). A lookup
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

# --------------------------------------------------------------------------------------
# Resolution of op names and callables.
# --------------------------------------------------------------------------------------

# Namespaces searched for a plain op name, with the label shown by describe().
_PLAIN_NAMESPACES: tuple[tuple[str, Any], ...] = (
    ("torch", torch),
    ("F", F),
    ("Tensor", torch.Tensor),
    ("torch.special", torch.special),
    ("torch.linalg", torch.linalg),
)
_NAMESPACE_BY_LABEL = dict(_PLAIN_NAMESPACES)


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _is_inplace(name: str) -> bool:
    if _is_dunder(name):
        # __iadd__, __ipow__, ... (but not __invert__, __index__, __int__, __init__)
        return name[2] == "i" and name[3:-2] in {
            "add", "sub", "mul", "truediv", "floordiv", "div", "mod", "pow", "matmul",
            "and", "or", "xor", "lshift", "rshift",
        }
    return name.endswith("_") and not name.startswith("_")


@functools.lru_cache(maxsize=None)
def _interceptable() -> frozenset[Callable[..., Any]]:
    """Every callable that dispatches through ``__torch_function__`` (and so reaches a mode)."""
    funcs: set[Callable[..., Any]] = set()
    for listed in torch.overrides.get_overridable_functions().values():
        funcs.update(listed)
    return frozenset(funcs)


def _can_intercept(obj: Any) -> bool:
    if not callable(obj) or isinstance(obj, type):
        return False
    try:
        return obj in _interceptable()
    except TypeError:  # unhashable callable
        return False


def _lookup(namespace: Any, name: str) -> Any:
    # Module namespaces are read through vars() so that a lookup never triggers a
    # module-level __getattr__ (torch lazily imports submodules that way).
    if namespace is torch.Tensor:
        if name.startswith("_") and not _is_dunder(name):
            return None
        return getattr(torch.Tensor, name, None)
    if name.startswith("_"):
        return None
    return vars(namespace).get(name)


def _aliases_of_name(name: str) -> tuple[tuple[str, Callable[..., Any]], ...]:
    """All interceptable callables that an op name stands for, with display labels."""
    found: list[tuple[str, Callable[..., Any]]] = []
    seen: set[int] = set()
    candidates = [(label, name) for label, _ in _PLAIN_NAMESPACES] + list(_EXTRA_ALIASES.get(name, ()))
    for label, attr in candidates:
        obj = _lookup(_NAMESPACE_BY_LABEL[label], attr)
        if obj is not None and id(obj) not in seen and _can_intercept(obj):
            seen.add(id(obj))
            found.append((f"{label}.{attr}", obj))
    return tuple(found)


@functools.lru_cache(maxsize=None)
def _reverse_index() -> dict[Callable[..., Any], str]:
    """Callable -> canonical op name, built once on first use (~20 ms)."""
    index: dict[Callable[..., Any], str] = {}
    for _, namespace in _PLAIN_NAMESPACES:
        names = dir(torch.Tensor) if namespace is torch.Tensor else list(vars(namespace))
        for name in names:
            obj = _lookup(namespace, name)
            if obj is not None and _can_intercept(obj):
                index.setdefault(obj, _DUNDER_TO_OP.get(name, name))
    # Interceptable callables outside the plain namespaces (torch.fft, ...) get a
    # dotted canonical name that resolves back to them.
    for namespace, listed in torch.overrides.get_overridable_functions().items():
        if not isinstance(namespace, types.ModuleType):
            continue
        wanted = set(listed)
        for name, obj in vars(namespace).items():
            if not name.startswith("_") and _hashable(obj) and obj in wanted:
                index.setdefault(obj, f"{namespace.__name__}.{name}")
    return index


def _hashable(obj: Any) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True


def _resolve_dotted(path: str) -> Any:
    parts = path.split(".")
    if parts[0] != "torch" or len(parts) < 2:
        return None
    obj: Any = torch
    for part in parts[1:]:
        if isinstance(obj, types.ModuleType):
            obj = vars(obj).get(part)
        elif obj is torch.Tensor:
            obj = getattr(obj, part, None)
        else:
            return None
        if obj is None:
            return None
    return obj


def _known_names_hint() -> str:
    return (
        "Known names: every default ("
        + ", ".join(sorted(DEFAULT_FP32_OPS))
        + ") and any public op of torch, torch.nn.functional, torch.special, torch.linalg "
        "or a torch.Tensor method (e.g. 'tanh', 'sigmoid', 'var', 'matmul'); other torch "
        "functions by dotted path (e.g. 'torch.fft.rfft')."
    )


def _unknown_name_error(spec: str) -> ValueError:
    pool = set(DEFAULT_FP32_OPS)
    pool.update(_reverse_index().values())
    pool.discard(spec)
    close = difflib.get_close_matches(spec, sorted(pool), n=3, cutoff=0.75)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"fp32_ops: unknown op name {spec!r}.{hint} {_known_names_hint()}")


def _canonical_name(spec: Any) -> str:
    """Map one fp32_ops entry (name or torch callable) to its canonical op name."""
    if isinstance(spec, str):
        name = spec.strip()
        if "." in name:
            obj = _resolve_dotted(name)
            if obj is None or not _can_intercept(obj):
                raise _unknown_name_error(spec)
            name = _reverse_index().get(obj, name)
        else:
            name = _DUNDER_TO_OP.get(name, name)
    elif isinstance(spec, type):
        hint = " Module classes belong in fp32_modules." if issubclass(spec, nn.Module) else ""
        raise TypeError(f"fp32_ops: expected op names or torch functions, got the class {spec!r}.{hint}")
    elif callable(spec):
        name = _reverse_index().get(spec) if _can_intercept(spec) else None
        if name is None:
            raise ValueError(
                f"fp32_ops: {spec!r} is not a torch function this policy can intercept. Pass a "
                "public function of torch, torch.nn.functional, torch.special, torch.linalg or "
                "torch.fft, or a torch.Tensor method (user-defined functions, lambdas and "
                "torch.ops.aten overloads never reach the interception point)."
            )
    else:
        raise TypeError(f"fp32_ops: entries must be op names (str) or torch functions, got {spec!r}.")

    if _is_inplace(name.rsplit(".", 1)[-1]):
        raise ValueError(
            f"fp32_ops: {spec!r} is an in-place op; it has to write into its (possibly 16-bit) "
            "input, so it cannot produce an FP32 result. List the out-of-place op instead."
        )
    if "." not in name and not _aliases_of_name(name):
        raise _unknown_name_error(spec if isinstance(spec, str) else name)
    return name


def _aliases_of_canonical(name: str) -> tuple[tuple[str, Callable[..., Any]], ...]:
    if "." in name:
        return ((name, _resolve_dotted(name)),)
    return _aliases_of_name(name)


# --------------------------------------------------------------------------------------
# Upcasting and autocast toggling (shared by the op mode and the module hooks).
# --------------------------------------------------------------------------------------


def _to_fp32(obj: Any, devices: set[str] | None) -> Any:
    """Return ``obj`` with 16-bit floating tensors upcast to float32, recursing into
    tuples (incl. namedtuples such as PackedSequence), lists and dicts. Containers
    that hold nothing to upcast are returned as the same object. If ``devices`` is
    given, the device type of every tensor seen is added to it."""
    if isinstance(obj, torch.Tensor):
        if devices is not None:
            # is_cpu is ~0.07 us; building device.type is ~0.5 us, so only for non-CPU.
            devices.add("cpu" if obj.is_cpu else obj.device.type)
        # .float() is differentiable: the backward casts the gradient back to 16 bits.
        return obj.float() if obj.dtype in HALF_DTYPES else obj
    if isinstance(obj, (tuple, list)):
        return _to_fp32_seq(obj, devices)
    if isinstance(obj, dict):
        changed = {key: _to_fp32(value, devices) for key, value in obj.items()}
        if all(changed[key] is value for key, value in obj.items()):
            return obj
        result = obj.copy()  # keeps the dict subclass (e.g. OrderedDict)
        result.update(changed)
        return result
    return obj


def _to_fp32_seq(seq: tuple[Any, ...] | list[Any], devices: set[str] | None) -> Any:
    # A plain loop: this runs on every listed op, and a comprehension + all(zip(...))
    # costs about a microsecond more for the usual 1-3 arguments.
    items: list[Any] | None = None
    for i, item in enumerate(seq):
        new = _to_fp32(item, devices)
        if new is not item:
            if items is None:
                items = list(seq)
            items[i] = new
    if items is None:
        return seq
    if type(seq) is tuple:
        return tuple(items)
    if type(seq) is list:
        return items
    if isinstance(seq, tuple) and hasattr(seq, "_fields"):  # namedtuple, PackedSequence
        return type(seq)(*items)
    return type(seq)(items)


_NO_AUTOCAST_DEVICES: set[str] = set()  # device types autocast does not know (meta, ...)
_any_autocast_enabled: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast_enabled(device_type: str) -> bool:
    if device_type in _NO_AUTOCAST_DEVICES:
        return False
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        _NO_AUTOCAST_DEVICES.add(device_type)
        return False


# Batch norm in mixed dtype. torch 2.13's CPU kernels and CUDA's (native and cuDNN) take a 16-bit input with
# FP32 weight, bias and running statistics: mean and variance are accumulated in FP32 inside the kernel, the
# running statistics are updated in FP32, the output and the input gradient are 16-bit, the weight and bias
# gradients FP32 (the arrangement cuDNN and autocast use). That is everything _WHY_NORM_LAYER asks for, and it
# saves what an upcast costs: autograd keeps the tensor batch_norm was given, so a `.float()` before it stores
# an FP32 copy of every normalised activation (in a ResNet, about half of all saved activations) and hands an
# FP32 output to the next layer. Other devices (and 16-bit weights or statistics) keep the upcast.
_NATIVE_MIXED_BATCH_NORM_DEVICES = frozenset({"cpu", "cuda"})
_BATCH_NORM_FUNCS = frozenset({F.batch_norm, torch.batch_norm, torch.native_batch_norm})


def _native_mixed_batch_norm(input: Any, others: Iterable[Any]) -> bool:  # noqa: A002 (torch's name)
    """Whether batch norm can take ``input`` as it is: a 16-bit tensor on a device whose kernels run mixed
    dtype, and every floating tensor in ``others`` (nested tuples/lists/dicts, or a module's parameters and
    buffers) FP32. ``None`` and non-floating entries (``num_batches_tracked``, flags, eps) do not matter."""
    if not isinstance(input, torch.Tensor) or input.dtype not in HALF_DTYPES:
        return False
    if not (input.is_cpu or input.device.type in _NATIVE_MIXED_BATCH_NORM_DEVICES):
        return False
    stack = list(others)
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.is_floating_point() and item.dtype != torch.float32:
                return False
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return True


def _call_fp32(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None, set_dtype: bool
) -> Any:
    """Run one listed op in FP32 (see the module docstring for the contract).

    ``set_dtype``: the op takes ``dtype=`` (softmax, sum, cumsum, ...). Then a 16-bit
    input is not copied to FP32 first; the op is called with ``dtype=torch.float32``
    instead, as CUDA autocast does. Same result, but kernels that convert on the fly
    skip a full FP32 copy of the input (CUDA softmax reads fp16 and writes fp32 in
    one pass); where a kernel cannot (CPU softmax), ATen makes the copy itself.

    Batch norm with a 16-bit input and FP32 weight/statistics is called as it is (its kernels compute the
    statistics in FP32; see ``_native_mixed_batch_norm``): the result is then 16-bit, not FP32."""
    if kwargs and (kwargs.get("dtype") is not None or kwargs.get("out") is not None):
        # An explicit precision or output buffer is the caller's decision.
        return func(*args, **kwargs)
    for arg in args:
        if isinstance(arg, torch.dtype):  # dtype given positionally: explicit as well
            return func(*args, **kwargs) if kwargs else func(*args)

    first = args[0] if args else None
    if func in _BATCH_NORM_FUNCS and _native_mixed_batch_norm(first, (args[1:], kwargs)):
        # 16-bit input, FP32 weight and running stats: statistics in FP32 inside the kernel, no FP32 copy of
        # the input for autograd to save (see _native_mixed_batch_norm). Autocast still goes off for the call.
        devices = {"cpu" if first.is_cpu else first.device.type} if _any_autocast_enabled() else ()
    elif set_dtype and isinstance(first, torch.Tensor) and first.dtype in HALF_DTYPES:
        kwargs = dict(kwargs) if kwargs else {}
        kwargs["dtype"] = torch.float32
        devices = {"cpu" if first.is_cpu else first.device.type} if _any_autocast_enabled() else ()
    elif _any_autocast_enabled():
        devices = set()
        args = _to_fp32_seq(args, devices)
        if kwargs:
            kwargs = _to_fp32(kwargs, devices)
    else:
        args = _to_fp32_seq(args, None)
        if kwargs:
            return func(*args, **_to_fp32(kwargs, None))
        return func(*args)

    # Autocast would otherwise re-cast ops on its lower-precision list (a user may
    # list "matmul"). Toggling is a cheap C call per device, undone in finally so an
    # exception inside the op cannot leave autocast off.
    disabled = [device_type for device_type in devices if _autocast_enabled(device_type)]
    for device_type in disabled:
        torch.set_autocast_enabled(device_type, False)
    try:
        return func(*args, **kwargs) if kwargs else func(*args)
    finally:
        for device_type in disabled:
            torch.set_autocast_enabled(device_type, True)


class _Fp32OpMode(TorchFunctionMode):
    """Routes the listed callables through ``_call_fp32``; everything else passes through.

    ``__torch_function__`` is entered for *every* torch call while the mode is
    active, so the unlisted path is kept to one dict lookup and the re-call.
    The mode is popped while ``__torch_function__`` runs, so the re-call does not
    recurse into it."""

    def __init__(self, table: dict[Callable[..., Any], bool]) -> None:
        super().__init__()
        self._lookup = table.get  # listed callable -> whether it accepts dtype=; None if unlisted

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: A002 (torch's signature)
        try:
            set_dtype = self._lookup(func)
        except TypeError:  # an unhashable callable cannot be listed
            set_dtype = None
        if set_dtype is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        return _call_fp32(func, args, kwargs, set_dtype)


# --------------------------------------------------------------------------------------
# Module hooks.
# --------------------------------------------------------------------------------------

# Per-thread stack of (module, device_type, autocast_was_enabled) for FP32 forwards in
# progress. Autocast state is thread-local, so the bookkeeping is too; kept at module
# level (not on the hook object) so that installed models stay deep-copyable/picklable.
_FORWARD_FRAMES = threading.local()


def _frames() -> list[tuple[nn.Module, str, bool]]:
    frames = getattr(_FORWARD_FRAMES, "stack", None)
    if frames is None:
        frames = _FORWARD_FRAMES.stack = []
    return frames


class _Fp32ForwardHooks:
    """Forward pre-hook + always-called forward hook that run a module's forward in FP32.

    The pre-hook upcasts 16-bit floating inputs (args and kwargs, nested, e.g.
    LSTM's ``(h, c)``) and disables autocast for ``device_type``; the post-hook is
    registered with ``always_call=True`` so it restores autocast even when forward
    raises. (A BaseException such as KeyboardInterrupt skips it, but the enclosing
    ``torch.autocast`` block restores its state on exit anyway.) Cost per call: two
    Python hook calls (~a few microseconds) plus the input upcast copies.

    BatchNorm layers (``_BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm, the lazy ones) whose parameters and
    running statistics are FP32 take a 16-bit input as it is, on devices whose kernels run batch norm in
    mixed dtype (see ``_native_mixed_batch_norm``): statistics in FP32 inside, 16-bit output, and no FP32
    copy of the activation for autograd to keep."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if isinstance(module, _BatchNorm) and args and _native_mixed_batch_norm(
            args[0], (*module._parameters.values(), *module._buffers.values())
        ):
            new_args, new_kwargs = args, kwargs
        else:
            new_args = _to_fp32(args, None)
            new_kwargs = _to_fp32(kwargs, None)
        was_enabled = _autocast_enabled(self.device_type)
        _frames().append((module, self.device_type, was_enabled))
        if was_enabled:
            torch.set_autocast_enabled(self.device_type, False)
        if new_args is args and new_kwargs is kwargs:
            return None
        return new_args, new_kwargs

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        frames = _frames()
        # Only undo a frame this module pushed: if our own pre-hook never ran (an
        # earlier pre-hook raised), there is nothing to restore.
        if frames and frames[-1][0] is module:
            _, device_type, was_enabled = frames.pop()
            if was_enabled:
                torch.set_autocast_enabled(device_type, True)
        return None


class Fp32ModuleHandle:
    """Returned by ``Fp32Policy.install``; ``remove()`` takes every hook out again.

    Also a context manager (``with policy.install(model, "cpu"): ...``).
    Copies of the model made while installed (``copy.deepcopy``) carry the hooks
    with them and keep running those modules in FP32; ``remove()`` only affects
    the original modules."""

    def __init__(self, modules: tuple[nn.Module, ...], handles: list[Any]) -> None:
        self.modules = modules
        self._handles = handles

    def remove(self) -> None:
        """Restore the original forward behaviour exactly (idempotent)."""
        while self._handles:
            self._handles.pop().remove()

    def __enter__(self) -> Fp32ModuleHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "installed" if self._handles else "removed"
        return f"Fp32ModuleHandle({len(self.modules)} modules, {state})"


# --------------------------------------------------------------------------------------
# The policy.
# --------------------------------------------------------------------------------------


def _validate_modules(modules: Any) -> tuple[type[nn.Module], ...]:
    if isinstance(modules, type):
        raise TypeError(
            f"fp32_modules must be a tuple of nn.Module subclasses, got the class {modules!r} "
            f"itself; wrap it: ({modules.__name__},)."
        )
    if isinstance(modules, (str, bytes)) or not isinstance(modules, Iterable):
        raise TypeError(f"fp32_modules must be a tuple of nn.Module subclasses, got {modules!r}.")
    result: list[type[nn.Module]] = []
    for cls in modules:
        if isinstance(cls, nn.Module):
            raise TypeError(
                f"fp32_modules entries must be classes, got the instance {type(cls).__name__}(...); "
                f"pass {type(cls).__name__} instead."
            )
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"fp32_modules entries must be nn.Module subclasses, got {cls!r}.")
        if cls is nn.Module:
            raise ValueError(
                "fp32_modules: nn.Module itself would keep every module, the root included, in "
                "FP32 and switch mixed precision off; list specific classes."
            )
        if cls not in result:
            result.append(cls)
    return tuple(result)


def _validate_ops(ops: Any) -> dict[str, tuple[tuple[str, Callable[..., Any]], ...]]:
    if isinstance(ops, (str, bytes)):
        raise TypeError(
            f"fp32_ops must be a collection of op names or torch functions, not the single string "
            f"{ops!r}; did you mean {{{ops!r}}}?"
        )
    if not isinstance(ops, Iterable) or callable(ops):
        raise TypeError(f"fp32_ops must be a collection of op names or torch functions, got {ops!r}.")
    resolved: dict[str, tuple[tuple[str, Callable[..., Any]], ...]] = {}
    for spec in ops:
        name = _canonical_name(spec)
        if name not in resolved:
            resolved[name] = _aliases_of_canonical(name)
    return resolved


_NULL_CONTEXT = contextlib.nullcontext()


class Fp32Policy:
    """Which ops and which modules run in FP32 under mixed precision.

    Args:
        ops: op names and/or torch callables computed in FP32 (see the module
            docstring for the exact contract). A name stands for every public
            callable of that name in ``torch``, ``torch.nn.functional``,
            ``torch.special``, ``torch.linalg`` and the ``torch.Tensor`` methods,
            plus its operator dunders (``"pow"`` covers ``x ** 2``). A callable is
            normalised to its name, so ``torch.tanh`` also covers ``x.tanh()``.
            Other torch functions are given by dotted path (``"torch.fft.rfft"``).
            Invalid entries raise ``TypeError``/``ValueError`` naming ``fp32_ops``.
        modules: ``nn.Module`` subclasses whose instances keep FP32 parameters and
            run their forward in FP32 (``isinstance`` check, so subclasses count).
            Invalid entries raise ``TypeError``/``ValueError`` naming ``fp32_modules``.
    """

    def __init__(
        self,
        ops: Iterable[OpSpec] = DEFAULT_FP32_OPS,
        modules: Iterable[type[nn.Module]] = DEFAULT_FP32_MODULES,
    ) -> None:
        self._aliases = _validate_ops(ops)
        self._modules = _validate_modules(modules)
        self._ops = frozenset(self._aliases)
        # callable -> whether it takes dtype= (see _call_fp32); the mode's only lookup.
        self._table: dict[Callable[..., Any], bool] = {
            func: name in _DTYPE_OPS
            for name, aliases in self._aliases.items()
            for _, func in aliases
        }
        self._mode: _Fp32OpMode | None = None

    def __getstate__(self) -> dict[str, Any]:
        # by names: the resolved callables include Tensor methods (TensorBase.pow...) that cannot be pickled,
        # and a policy travels with the plugin to ddp_spawn workers
        return {"ops": sorted(self._ops), "modules": self._modules}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["ops"], state["modules"])

    @property
    def ops(self) -> frozenset[str]:
        """Canonical names of the FP32 ops (accepted back by ``Fp32Policy(ops=...)``)."""
        return self._ops

    @property
    def modules(self) -> tuple[type[nn.Module], ...]:
        """The FP32 module classes, in the given order, without duplicates."""
        return self._modules

    def keeps_fp32(self, module: nn.Module) -> bool:
        """Whether this module's own parameters stay FP32 (``isinstance`` of a listed class)."""
        return bool(self._modules) and isinstance(module, self._modules)

    def op_context(self) -> contextlib.AbstractContextManager[Any]:
        """Context in which every listed op receives FP32 inputs and returns FP32.

        Works with and inside ``torch.autocast`` on any device; nothing leaks out of
        the block, also when it raises. An empty op list gives a no-op context."""
        if not self._table:
            return _NULL_CONTEXT
        # one mode object for the policy's lifetime: torch.compile guards on the active mode, so a new object per
        # step would invalidate every compiled graph (recompiling each step until Dynamo gives up)
        if self._mode is None:
            self._mode = _Fp32OpMode(self._table)
        return self._mode

    def checkpoint_context_fn(self) -> Callable[[], tuple[Any, Any]]:
        """``context_fn`` for ``torch.utils.checkpoint(..., use_reentrant=False)``.

        Activation checkpointing recomputes the forward during backward, outside
        ``op_context()`` (torch only carries autocast and device modes over). The
        listed ops would then come out 16-bit and checkpoint raises a CheckpointError
        ("Recomputed values ... have different metadata"). Passing
        ``context_fn=policy.checkpoint_context_fn()`` re-enters the op policy for the
        recomputation. (Reentrant checkpointing has no such hook: it silently
        recomputes the listed ops in 16 bits; prefer ``use_reentrant=False``.)"""

        def context_fn() -> tuple[Any, Any]:
            return contextlib.nullcontext(), self.op_context()

        return context_fn

    def install(self, root: nn.Module, device_type: str) -> Fp32ModuleHandle:
        """Run the forward of every submodule with ``keeps_fp32(m)`` in FP32.

        16-bit floating inputs (args and kwargs, nested) are upcast to float32 and
        autocast is disabled for ``device_type`` during that forward; outputs stay
        FP32. Implemented with forward hooks, so the modules' ``forward`` is never
        replaced; ``handle.remove()`` takes the hooks out again."""
        if not isinstance(root, nn.Module):
            raise TypeError(f"install() expects an nn.Module as root, got {type(root).__name__}.")
        if isinstance(device_type, torch.device):
            device_type = device_type.type
        if not isinstance(device_type, str):
            raise TypeError(f"device_type must be a str such as 'cpu' or 'cuda', got {device_type!r}.")
        device_type = device_type.split(":", 1)[0]
        try:
            torch.is_autocast_enabled(device_type)
        except RuntimeError as err:
            raise ValueError(f"device_type {device_type!r} is not supported by torch.autocast: {err}") from None

        hooks = _Fp32ForwardHooks(device_type)
        modules: list[nn.Module] = []
        handles: list[Any] = []
        for module in root.modules():
            if self.keeps_fp32(module):
                modules.append(module)
                # Pre-hook appended (runs right before forward), post-hook prepended
                # (runs right after it): the FP32 region is as tight as hooks allow.
                handles.append(module.register_forward_pre_hook(hooks.pre, with_kwargs=True))
                handles.append(module.register_forward_hook(hooks.post, prepend=True, always_call=True))
        return Fp32ModuleHandle(tuple(modules), handles)

    def describe(self) -> str:
        """Markdown tables of the FP32 ops and modules (for printing or a README)."""
        lines = [
            "#### Ops computed in FP32",
            "",
            "16-bit floating inputs are upcast, autocast is off for the call, the result is FP32. "
            "`F` is `torch.nn.functional`.",
            "",
        ]
        if self._aliases:
            groups: dict[str, list[str]] = {}
            for name in sorted(self._aliases):
                groups.setdefault(_OP_GROUP_OF.get(name, "user-added"), []).append(name)
            ordered = [g for g, _, _ in _OP_GROUPS if g in groups] + (["user-added"] if "user-added" in groups else [])
            lines += ["| Group | Ops | Why FP32 |", "|---|---|---|"]
            for group in ordered:
                names = ", ".join(f"`{n}`" for n in groups[group])
                lines.append(f"| {group} | {names} | {_GROUP_NOTES.get(group, 'selected by the user')} |")
            lines += ["", "| Op | Intercepted callables |", "|---|---|"]
            for group in ordered:
                for name in groups[group]:
                    callables = ", ".join(f"`{label}`" for label, _ in self._aliases[name])
                    lines.append(f"| `{name}` | {callables} |")
        else:
            lines.append("_None: every op follows autocast's own lists._")
        lines += ["", "#### Modules kept in FP32 (parameters and forward)", ""]
        if self._modules:
            lines += ["| Module class | Covers | Why FP32 |", "|---|---|---|"]
            for cls in self._modules:
                covers = ", ".join(_public_subclasses(cls)) or cls.__name__
                lines.append(f"| `{_class_path(cls)}` | {covers} | {_module_reason(cls)} |")
        else:
            lines.append("_None: every parameter follows the precision setting._")
        return "\n".join(lines)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Fp32Policy):
            return NotImplemented
        return self._ops == other._ops and set(self._modules) == set(other._modules)

    def __hash__(self) -> int:
        return hash((self._ops, frozenset(self._modules)))

    def __repr__(self) -> str:
        ops = "DEFAULT_FP32_OPS" if self._ops == DEFAULT_FP32_OPS else f"<{len(self._ops)} ops>"
        mods = ", ".join(cls.__name__ for cls in self._modules)
        return f"Fp32Policy(ops={ops}, modules=({mods}))"


def _class_path(cls: type) -> str:
    if getattr(nn, cls.__name__, None) is cls:
        return f"torch.nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _public_subclasses(cls: type) -> list[str]:
    """Public torch.nn classes covered by an isinstance check against ``cls``."""
    return [
        name
        for name, obj in vars(nn).items()
        if isinstance(obj, type) and issubclass(obj, cls) and not name.startswith("_")
        and not (name.endswith("Base") and obj is not cls)
    ]


def _module_reason(cls: type) -> str:
    if issubclass(cls, (nn.RNNBase, nn.RNNCellBase)):
        return (
            "state fed back every step compounds 16-bit rounding; under fp16 autocast on CPU "
            "oneDNN's LSTM fails on FP32 inputs; costs the 16-bit speed-up of the recurrence"
        )
    if cls in NORM_MODULES or any(issubclass(cls, norm) for norm in NORM_MODULES):
        return _WHY_NORM_LAYER + "; few or no parameters, so FP32 weights are nearly free"
    if issubclass(cls, EMBEDDING_MODULES):
        return (
            "a lookup, no arithmetic to speed up; an FP32 table keeps the residual stream it starts in FP32 "
            "(a 16-bit one rounds every residual add)"
        )
    return "selected by the user"

