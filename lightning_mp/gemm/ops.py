"""Which aten ops :mod:`lightning_mp.gemm.emulation` emulates, which of their outputs stay FP32, and the FP32 call that
stands in for an op where it is not the op itself."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

aten = torch.ops.aten

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
