"""The 16-bit copies of :class:`lightning_mp.numerics.master_weights.MasterWeights`: where they live and how their
gradients fold into the FP32 ``.grad``.

Where: views of one flat buffer per device (:func:`flat_views`), allocated when the parameter set is built; the
FP32 gradients they fold into are views of another. Both steady-state passes over them (the refresh in
``MasterWeights``, the fold here) are C-level ``map`` passes over the parameters: a Python loop per parameter costs
several times more inside a fit, where the backward has evicted the interpreter's data from the caches.
"""

from __future__ import annotations

import functools
import operator
from itertools import repeat

import torch
from torch import Tensor, nn

_REQUIRES_GRAD, _GRAD = operator.attrgetter("requires_grad"), operator.attrgetter("grad")
_IS_NONE = functools.partial(operator.is_, None)


def fold_grads(params: list[nn.Parameter], copies: list[Tensor], views: list[Tensor]) -> None:
    """Add the copies' 16-bit gradients into the Parameters' FP32 ``.grad`` and drop them: where ``.grad`` is
    ``None`` it becomes the parameter's view of the flat FP32 gradient buffer (``views``) and takes a copy, else the
    16-bit gradient is added to it. One fused pass each, FP32 sums."""
    g16 = list(map(_GRAD, copies))
    absent = sum(map(_IS_NONE, g16))
    if absent == len(g16):
        return
    g32 = list(map(_GRAD, params))
    fresh = sum(map(_IS_NONE, g32))
    # the common case in C-level passes (a Python loop per parameter costs several times more inside a fit, where the
    # backward has evicted the interpreter's data from the caches), no grad-mode switch: every copy has a gradient,
    # all Parameters or none have one, and no gradient is part of a graph (a backward with create_graph=True)
    if not absent and (fresh == len(g32) or (not fresh and not any(map(_REQUIRES_GRAD, g32)))) and not any(
        map(_REQUIRES_GRAD, g16)
    ):
        list(map(setattr, copies, repeat("grad"), repeat(None)))
        if fresh:
            list(map(setattr, params, repeat("grad"), views))
            torch._foreach_copy_(views, g16)
        else:
            torch._foreach_add_(g32, g16)
        return
    fresh_dst, fresh_src, acc_dst, acc_src = [], [], [], []
    for p, c, view, g16_, g32_ in zip(params, copies, views, g16, g32):
        if g16_ is None:
            continue
        c.grad = None
        if g32_ is None:
            p.grad = view
            fresh_dst.append(view)
            fresh_src.append(g16_)
        else:
            acc_dst.append(g32_)
            acc_src.append(g16_)
    with torch.no_grad():
        if fresh_dst:
            torch._foreach_copy_(fresh_dst, fresh_src)
        if acc_dst:
            torch._foreach_add_(acc_dst, acc_src)


def flat_views(params: list[Tensor], dtype: torch.dtype, leaf: bool) -> list[Tensor]:
    """Tensors shaped like ``params`` in ``dtype``, views of one buffer per device. ``leaf``: each is a ``.data``
    view (its own version counter, so refreshing one copy never invalidates a graph that saved another)."""
    out: list[Tensor] = [None] * len(params)  # type: ignore[list-item]
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(params):
        by_device.setdefault(p.device, []).append(i)
    for device, idx in by_device.items():
        sizes = [params[i].numel() for i in idx]
        flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
        for i, view in zip(idx, flat.split(sizes)):
            view = view.view(params[i].shape)
            out[i] = view.data if leaf else view
    return out
