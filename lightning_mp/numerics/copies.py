"""The 16-bit copies of :class:`lightning_mp.numerics.master_weights.MasterWeights`: where they live and how their
gradients fold into the FP32 ``.grad``.

Where: views of one flat buffer per device (:func:`flat_views`), allocated when the parameter set is built; the
FP32 gradients they fold into are views of another, for the trainable parameters only (:func:`grad_views`). Both
steady-state passes over them (the refresh in ``MasterWeights``, the fold here) are C-level ``map`` passes over the
parameters: a Python loop per parameter costs several times more inside a fit, where the backward has evicted the
interpreter's data from the caches.

A copy that a live graph still holds (:func:`held`) is not written in place: autograd checks the version of every
tensor it saved, so a refresh in place would make that graph's backward raise ("modified by an inplace operation"),
where Lightning's ``bf16-mixed`` casts a fresh tensor per forward and back-propagates through the old values. The
case is a GAN's: the generator's graph (``fake = G(z)``) is built before the discriminator's step and
back-propagated after it. Such a copy is refreshed into another tensor and the held one *retired*: its gradient,
when that graph's backward comes, folds into the same FP32 ``.grad`` (:func:`fold_retired`). The check is one
C-level pass of ``Tensor._use_count`` over the copies at the refresh; the steady step allocates nothing.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable
from itertools import repeat

import torch
from torch import Tensor, nn

_REQUIRES_GRAD, _GRAD = operator.attrgetter("requires_grad"), operator.attrgetter("grad")
_IS_NONE = functools.partial(operator.is_, None)
_USE_COUNT = Tensor._use_count  # references to the TensorImpl from C++ (its Python object counts once)


def held(copy: Tensor) -> bool:
    """Whether anything besides the store holds ``copy``: a graph not yet back-propagated that saved it (or a view of
    it, ``weight.t()``) for its backward, or a view the user kept. The TensorImpl's references: one from its Python
    object (however many Python names it has), one from its gradient accumulator while any graph that used it is
    alive (a copy that requires grad; a graph already back-propagated keeps this one while its output lives), one per
    saved tensor or live view. A false "held" costs an allocation, never a wrong value."""
    return _USE_COUNT(copy) > 1 + copy.requires_grad


def in_a_graph(copy: Tensor) -> bool:
    """Whether a graph may still back-propagate into ``copy``: anything besides its Python object holds it (its
    gradient accumulator lives while a graph that used it does, also where the graph saved nothing of it: a bias)."""
    return _USE_COUNT(copy) > 1


def none_held(copies: list[Tensor], all_require_grad: bool) -> bool:
    """Whether :func:`held` is false for every copy, in C-level passes: one where ``all_require_grad`` says that every
    copy requires grad (a training step's refresh: ~40 ns a copy, where the cast-copy itself takes ~600 ns), else two
    more."""
    if all_require_grad:
        return max(map(_USE_COUNT, copies), default=0) <= 2
    return all(map(operator.le, map(_USE_COUNT, copies), map(operator.add, repeat(1), map(_REQUIRES_GRAD, copies))))


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
            p.grad = view = view if view is not None else torch.empty_like(p)  # frozen at the last refresh
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


def fold_retired(retired: list[tuple[nn.Parameter, Tensor]], slot_of: dict[int, int], views: list[Tensor]
                 ) -> list[tuple[nn.Parameter, Tensor]]:
    """Fold the gradients of retired copies (refreshed out of place while a graph held them, each with the Parameter
    it stood for) into the FP32 ``.grad`` as :func:`fold_grads` does; the ones that a graph may still
    back-propagate into (anything besides this list holds them)."""
    with torch.no_grad():
        for p, c in retired:
            g16 = c.grad
            if g16 is None:
                continue
            c.grad = None
            if p.grad is not None:
                p.grad.add_(g16.to(p.grad.device))
            else:
                slot = slot_of.get(id(p))
                view = views[slot] if slot is not None else None
                if view is None:  # a Parameter dropped or frozen since
                    view = torch.empty_like(p)
                p.grad = view
                view.copy_(g16)
    return [(p, c) for p, c in retired if in_a_graph(c)]


def refresh_apart(stale: Iterable[int], params: list[nn.Parameter], copies: list[Tensor], homes: list[Tensor],
                  uses: list[list[tuple[dict, str]]], retired: list[tuple[nn.Parameter, Tensor]]
                  ) -> list[tuple[nn.Parameter, Tensor]]:
    """Refresh ``copies[i]`` for each ``i`` in ``stale`` from its Parameter, in its home (its view of the flat buffer)
    unless a live graph holds that home; then in another tensor: the one it is in now if nothing holds it, else a
    new one, put in its place in ``copies`` and in every install dict of ``uses[i]``. Returns the retired copies
    (``retired`` plus the ones replaced here) that a graph may still back-propagate into, for :func:`fold_retired`."""
    stale, dst = list(stale), []
    for i in stale:
        now = copies[i]
        to = homes[i]
        if held(to):
            to = now if now is not to and not held(now) else torch.empty_like(to)
        if to is not now:
            to.requires_grad_(now.requires_grad)
            if in_a_graph(now):
                retired.append((params[i], now))
            copies[i] = to
            for install, name in uses[i]:
                install[name] = to
        dst.append(to)
    if dst:
        with torch.no_grad():
            torch._foreach_copy_(dst, [params[i] for i in stale])
    if not retired:
        return retired
    # a home in use again folds as a copy; one that nothing holds gets no more gradients
    current = set(map(id, copies))
    return [(p, c) for p, c in retired if id(c) not in current and (in_a_graph(c) or c.grad is not None)]


def grad_views(params: list[nn.Parameter], views: list[Tensor | None] | None = None) -> list[Tensor | None]:
    """The FP32 gradients :func:`fold_grads` fills: a view of a flat buffer per trainable parameter, ``None`` for a
    frozen one, which never gets a gradient (a buffer for it would hold 4 B of zeros per parameter: LoRA's frozen base
    is most of a model). ``views``: the ones a parameter has already, kept; those unfrozen since share a new buffer."""
    views = list(views) if views is not None else [None] * len(params)
    missing = [i for i, p in enumerate(params) if p.requires_grad and views[i] is None]
    for i, view in zip(missing, flat_views([params[i] for i in missing], torch.float32, leaf=False)):
        views[i] = view
    return views


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
