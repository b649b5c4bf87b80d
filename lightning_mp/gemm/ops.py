"""Which aten ops :mod:`lightning_mp.gemm.emulation` emulates, the op family each belongs to, which of their outputs
stay FP32, the FP32 call that stands in for an op where it is not the op itself, and how one op is computed emulated.

Op families are decided apart (:mod:`lightning_mp.gemm.support` times each): one CPU can have a fast 16-bit kernel
for some and a fallback for others (fp16 on an Intel Xeon with AVX512-FP16: oneDNN runs the convolution's weight
gradient in its reference implementation, 50-400x FP32, and the rest at 0.9-1.6x FP32).

=====================  =========================================================================================
family                 ops
=====================  =========================================================================================
``matmul``             ``mm``, ``addmm``, ``bmm`` and the other matrix products; the CPU flash attention forward and
                       backward; the fused inference kernels of ``nn.MultiheadAttention`` and the encoder layer
``conv forward``       ``convolution``
``conv input grad``    ``convolution_backward``'s input gradient
``conv weight grad``   ``convolution_backward``'s weight gradient and the bias gradient computed beside it
=====================  =========================================================================================
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mp.gemm.staging import _Staging, _upcast

aten = torch.ops.aten
_BELOW = torch._C._AutoDispatchBelowADInplaceOrView  # dispatch below autograd and ADInplaceOrView (emulation._kernel)

MATMUL, CONV_FORWARD, CONV_INPUT_GRAD, CONV_WEIGHT_GRAD = FAMILIES = (
    "matmul", "conv forward", "conv input grad", "conv weight grad"
)
ALL_FAMILIES = frozenset(FAMILIES)

# Every aten GEMM a transformer or a convnet runs on the CPU, forward and backward (checked with a logging
# dispatch mode on Linear, matmul of 1-4 dims, einsum, Conv1d/2d/ConvTranspose2d, SDPA with and without mask
# and dropout, nn.MultiheadAttention, TransformerEncoderLayer in train and eval, LSTM/GRU): linear, matmul and
# einsum decompose into mm/addmm/bmm/mv/dot before they reach the dispatcher.
EMULATED_OPS: frozenset = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten._addmm_activation.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.addbmm.default,
        aten.mv.default,
        aten.addmv.default,
        aten.dot.default,
        aten.vdot.default,
        aten.convolution.default,
        aten.convolution_backward.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        # fused inference kernels (nn.MultiheadAttention / TransformerEncoderLayer fast path in eval): their
        # inner GEMMs run inside the kernel, out of the mode's sight, so the whole kernel runs in FP32
        aten._native_multi_head_attention.default,
        aten._transformer_encoder_layer_fwd.default,
    }
)

# outputs that the native 16-bit kernel returns in FP32 already: they stay FP32 (the flash kernel's logsumexp)
_FP32_OUTPUTS = {aten._scaled_dot_product_flash_attention_for_cpu.default: (1,)}


def _convolution_backward(
    grad_output: Tensor, input: Tensor, weight: Tensor, bias_sizes: Any, stride: Any, padding: Any,  # noqa: A002
    dilation: Any, transposed: bool, output_padding: Any, groups: int, output_mask: Any,
) -> tuple:
    """The FP32 ``convolution_backward`` with exactly the gradients ``output_mask`` asks for, as the 16-bit kernel it
    stands in for returns. oneDNN's FP32 kernel computes the weight gradient whenever the bias gradient is asked for
    and returns it unasked: a frozen weight with a trainable bias (autograd's mask ``[*, False, True]``) would pay a
    whole weight-gradient GEMM. There the bias gradient is the sum of ``grad_output`` over all but its channel
    dimension, in FP32 like oneDNN's own."""
    want_input, want_weight, want_bias = output_mask
    rest = (stride, padding, dilation, transposed, output_padding, groups)
    if want_bias and not want_weight:
        grad_input = None
        if want_input:
            grad_input = aten.convolution_backward(grad_output, input, weight, None, *rest, [True, False, False])[0]
        return grad_input, None, grad_output.sum([0, *range(2, grad_output.dim())])
    grads = aten.convolution_backward(grad_output, input, weight, bias_sizes, *rest, output_mask)
    return tuple(g if want else None for g, want in zip(grads, output_mask))


# ops whose FP32 call is not the op itself
_FP32_CALLS = {aten.convolution_backward.default: _convolution_backward}


_CONV_BACKWARD = aten.convolution_backward.default
# each op's family; convolution_backward is two (its input and its weight gradient), see _convolution_backward_split
_FAMILY = {op: MATMUL for op in EMULATED_OPS} | {aten.convolution.default: CONV_FORWARD, _CONV_BACKWARD: None}


def _emulate(func, dtype: torch.dtype, args: Any, kwargs: dict, staging: _Staging | None, below: bool = False):
    """``func`` in FP32 on the ``dtype`` operands, its results rounded (nearest-even) back to ``dtype``; ``below``:
    called from the ADInplaceOrView kernel, so the FP32 call goes on below that key.

    Operands of a tensor subclass are upcast with plain ``.to`` instead of through ``staging``: ``torch.compile``
    traces this function with fake and functional tensors (Dynamo, AOTAutograd), which have no memory to reuse. The
    traced graph holds the same upcast, FP32 GEMM and rounding as eager emulation, which inductor fuses and runs
    without Python (so for ``DTensor`` operands too; other subclasses never get here: ``staging._traced``)."""
    for a in args:  # a loop, not all(<generator>): this runs for every emulated GEMM
        if isinstance(a, Tensor) and type(a) is not Tensor and type(a) is not nn.Parameter:
            staging = None
            break
    take = _upcast if staging is None else staging.take  # a few us of Python per op in all: GEMMs take tens
    args = [take(a) if isinstance(a, Tensor) and a.dtype == dtype else a for a in args]
    if kwargs:
        kwargs = {k: take(v) if isinstance(v, Tensor) and v.dtype == dtype else v for k, v in kwargs.items()}
    with _BELOW() if below else contextlib.nullcontext():
        out = _FP32_CALLS.get(func, func)(*args, **kwargs)
    if isinstance(out, Tensor):
        result = out.to(dtype)
    else:
        keep = _FP32_OUTPUTS.get(func, ())
        result = type(out)(
            o.to(dtype) if isinstance(o, Tensor) and o.dtype == torch.float32 and i not in keep else o
            for i, o in enumerate(out)
        )
    if staging is not None:
        staging.done(result)
    return result


def compute(func, dtype: torch.dtype, families: frozenset, args: Any, kwargs: dict, staging: _Staging | None,
            below: bool = False):
    """``func`` (an op of :data:`EMULATED_OPS` on ``dtype`` operands) with the parts whose family is in ``families``
    emulated (:func:`_emulate`) and the others on the native 16-bit kernel. ``families`` is the set itself, not a
    copy, where every family is emulated: then this is one identity test and one call."""
    if families is ALL_FAMILIES or _FAMILY.get(func, MATMUL) in families:
        return _emulate(func, dtype, args, kwargs, staging, below)
    if func is _CONV_BACKWARD and (CONV_INPUT_GRAD in families or CONV_WEIGHT_GRAD in families):
        return _convolution_backward_split(dtype, families, args, kwargs, staging, below)
    with _BELOW() if below else contextlib.nullcontext():
        return func(*args, **kwargs)


def _convolution_backward_split(dtype: torch.dtype, families: frozenset, args: Any, kwargs: dict,
                                staging: _Staging | None, below: bool) -> tuple:
    """``convolution_backward`` with its input gradient and its weight (and bias) gradient each computed as its family
    is: two calls where one is emulated and the other native, each asked only for its own gradients (the
    16-bit kernels compute nothing unasked, and the FP32 call is :func:`_convolution_backward`)."""
    args = list(args)
    mask = list(args[10] if len(args) > 10 else kwargs["output_mask"])
    emulate_input, emulate_weight = CONV_INPUT_GRAD in families, CONV_WEIGHT_GRAD in families
    emulated = [mask[0] and emulate_input, mask[1] and emulate_weight, mask[2] and emulate_weight]
    native = [asked and not e for asked, e in zip(mask, emulated)]

    def call(part_mask: list[bool]) -> tuple[list[Any], dict]:
        if len(args) > 10:
            return [*args[:10], part_mask, *args[11:]], kwargs
        return args, {**kwargs, "output_mask": part_mask}

    if not any(native):
        return _emulate(_CONV_BACKWARD, dtype, *call(mask), staging, below)
    ours = _emulate(_CONV_BACKWARD, dtype, *call(emulated), staging, below) if any(emulated) else (None,) * 3
    with _BELOW() if below else contextlib.nullcontext():
        theirs = _CONV_BACKWARD(*call(native)[0], **call(native)[1])
    return tuple(o if e else (t if n else None) for o, t, e, n in zip(ours, theirs, emulated, native))
