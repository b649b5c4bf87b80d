"""Lean bf16's gradients, as FP32 masters have them: one backward leaves bf16 gradients. A second backward into them
(gradient accumulation) makes them FP32 first (:func:`upcast_accumulated`), so micro-batches sum in FP32; clipping
makes the optimizer's FP32 before it reads them (:func:`grads_of` and :func:`retype_grads`), so the norm and the
scaled gradients are FP32 values; the step reads them in place and rounds them back to bf16. That is 16.125 B/param
from the second micro-batch, or from the clipping, to the end of the step. Without a process group only: DDP's
reducer averages bf16 buckets and FSDP2 reduce-scatters into bf16 shards, so there gradients stay bf16 (accumulated
and clipped in bf16), also on a single rank. :class:`~lightning_mp.numerics.lean.LeanBf16` decides when.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Container

import torch
from torch import nn
from torch.optim import Optimizer

_GRAD = operator.attrgetter("grad")
_IS_NONE = functools.partial(operator.is_, None)


def upcast_accumulated(params: list[nn.Parameter]) -> None:
    """A backward is about to add into the gradients already there (an earlier micro-batch's): the bf16 ones
    become FP32 first (exact), so autograd sums this micro-batch into them in FP32, as FP32 masters sum theirs
    (in bf16 each sum would keep 8 significant bits). 4 B per element instead of 2 until the step, which rounds
    them back to bf16. The first backward of a step finds none and costs one C-level pass over the parameters."""
    grads = list(map(_GRAD, params))
    if all(map(_IS_NONE, grads)):
        return
    retype_grads([p for p, g in zip(params, grads) if g is not None and g.dtype == torch.bfloat16], torch.float32)


def grads_of(optimizer: Optimizer, owned: Container[nn.Parameter], dtype: torch.dtype) -> list[nn.Parameter]:
    """This optimizer's parameters in ``owned`` (the converted ones) whose gradient is ``dtype``."""
    return [p for g in optimizer.param_groups for p in g["params"]
            if p in owned and p.grad is not None and p.grad.dtype == dtype]


@torch.no_grad()
def retype_grads(params: list[nn.Parameter], dtype: torch.dtype) -> None:
    """Replace the dense ``.grad`` of ``params`` by copies in ``dtype``, in one fused copy. Each copy is a tensor of its
    own, as autograd's are: views of one buffer would tile it, and the step's gradient layout keeps tiled gradients
    between steps (loose ones it does not), holding the buffer past ``zero_grad``. ``grad_dtype = None`` lets a bf16
    Parameter hold an FP32 gradient and keeps autograd from casting the next micro-batch's bf16 gradient to the
    Parameter's dtype: it adds it into the FP32 one (``grad += new``: an FP32 sum of an exact upcast). Retyped back to
    the Parameter's own dtype (the step's end), ``grad_dtype`` is that dtype again, autograd's default: a gradient the
    backward computes in FP32 (a bf16 weight times an FP32 activation, RMSNorm's) is rounded to bf16 as FP32 masters'
    16-bit copies have it rounded; left ``None``, every later step kept such gradients unrounded and the run drifted
    from FP32 masters' from the first clipped step on."""
    params = [p for p in params if not p.grad.is_sparse]
    if not params:
        return
    grads = [p.grad for p in params]
    copies = [torch.empty_like(g, dtype=dtype) for g in grads]
    torch._foreach_copy_(copies, grads)
    for p, copy in zip(params, copies):
        p.grad_dtype = None
        p.grad = copy
        if dtype == p.dtype:
            p.grad_dtype = dtype


def own_grad_dtype(params: list[nn.Parameter]) -> None:
    """Each Parameter's ``grad_dtype`` set to its own dtype (autograd's default) where its gradient allows: one set
    explicitly for another dtype (FP32 while it was an FP32 Parameter) would make autograd cast every gradient to it."""
    for p in params:
        if p.grad is None or p.grad.dtype == p.dtype:
            p.grad_dtype = p.dtype


__all__ = ["grads_of", "own_grad_dtype", "retype_grads", "upcast_accumulated"]
