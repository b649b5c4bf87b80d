"""The 16-bit copies of :class:`lightning_mp.numerics.master_weights.MasterWeights`: where they live, which forward
shows them, and how their gradients fold into the FP32 ``.grad``.

Where: views of one flat buffer per device (:func:`flat_views`), allocated when the parameter set is built; the
FP32 gradients they fold into are views of another.

Which forward: the covers (:func:`covers_of`) are a watched root and the modules up to two calls below it
(``self.net``, ``self.net.encoder``, ``self.layers[3]``: ``ModuleList`` and ``ModuleDict`` are never called, so they
add no level; compiled modules and their subtrees are left out, as compiled code reads the FP32 Parameters under
autocast). The outermost cover called shows the copies of its whole subtree for the length of its forward; the
covers inside it step aside. A module deeper than that called on its own from outside reads its FP32 Parameters
under autocast (``bf16-mixed`` semantics: the same 16-bit values, exact). Why not one hook pair per module: with
hooks, ``nn.Module.__call__`` takes its slow path, and that path plus the two hooks ran ~350 Python bytecodes per
call. Over the 20 modules of a small ``transformers`` Llama that was 7k bytecodes a step, about as much Python as
the model's own forward (8k); covers run one pair per model call.
"""

from __future__ import annotations

from collections.abc import Iterator
import functools
import operator
from itertools import repeat
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

_REQUIRES_GRAD, _GRAD = operator.attrgetter("requires_grad"), operator.attrgetter("grad")
_IS_NONE = functools.partial(operator.is_, None)


class Cover(NamedTuple):
    """What a cover's forward shows: per converted parameter of its subtree, the owner's instance ``__dict__``, its
    ``_parameters``, the name, the Parameter and its copy; the parameters to re-examine (lazy, frozen 16-bit); the
    covers inside its subtree (their hooks step aside while it runs)."""

    dicts: list[dict]
    registries: list[dict]
    names: list[str]
    params: list[nn.Parameter]
    copies: list[Tensor]
    pending: list[tuple[dict, str, nn.Parameter]]
    nested: tuple[int, ...]

    @classmethod
    def of(cls, cover: nn.Module, subtree: list, copies: list[Tensor], covers: dict) -> Cover:
        live = [(mod, name, p, i) for mod, name, p, i in subtree if i >= 0]
        inner = {id(m) for m in cover.modules()}
        pending = [(m._parameters, name, p) for m, name, p, i in subtree if i < 0]
        return cls([m.__dict__ for m, *_ in live], [m._parameters for m, *_ in live], [e[1] for e in live],
                   [e[2] for e in live], [copies[e[3]] for e in live], pending, tuple(k for k in covers if k in inner))

    def show(self) -> bool:
        """Put the copies in, with C-level passes; ``False`` (nothing shown) where the registered Parameters are not
        those of the build, or a lazy one was materialized or a frozen 16-bit one unfrozen since."""
        if not all(map(operator.is_, map(dict.get, self.registries, self.names), self.params)) or any(
            (p.requires_grad and not is_lazy(p)) or reg.get(name) is not p for reg, name, p in self.pending
        ):
            return False
        if list(map(_REQUIRES_GRAD, self.params)) != list(map(_REQUIRES_GRAD, self.copies)):
            for p, c in zip(self.params, self.copies):  # frozen or unfrozen since the last refresh (BaseFinetuning)
                c.requires_grad_(p.requires_grad)
        list(map(dict.__setitem__, self.dicts, self.names, self.copies))
        return True

    def hide(self) -> None:
        """Take the copies out again (the ``__dict__`` entry under a Parameter's name can only be ours:
        ``nn.Module.__setattr__`` refuses a tensor there and removes the entry when a Parameter is assigned)."""
        list(map(dict.pop, self.dicts, self.names, repeat(None)))


def select_covers(roots: list[nn.Module], owned: dict[int, list]) -> dict[int, tuple[nn.Module, list]]:
    """id(cover) -> (cover, the ``owned`` entries of its subtree) for every cover that shows a converted parameter;
    ``owned``: id(module) -> that module's own (module, name, Parameter, slot) entries."""
    covers: dict[int, tuple[nn.Module, list]] = {}
    for cover in (cover for root in roots for cover in covers_of(root)):
        subtree = [entry for mod in _eager(cover) for entry in owned.get(id(mod), ())]
        if subtree and id(cover) not in covers:
            covers[id(cover)] = (cover, subtree)
    return covers


def covers_of(module: nn.Module, depth: int = 0) -> Iterator[nn.Module]:
    """``module`` and the modules up to two calls below it; ``ModuleList``/``ModuleDict`` (never called) add no
    level."""
    if _compiled(module):
        return
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        yield module
        depth += 1
    if depth <= 2:
        for child in module.children():
            yield from covers_of(child, depth)


def _eager(module: nn.Module) -> Iterator[nn.Module]:
    """``module``'s subtree without the compiled modules in it: compiled code reads the FP32 Parameters."""
    yield module
    for child in module.children():
        if not _compiled(child):
            yield from _eager(child)


def _compiled(module: nn.Module) -> bool:  # torch.compile(module) wraps it; module.compile() compiles in place
    return getattr(module, "_orig_mod", None) is not None or getattr(module, "_compiled_call_impl", None) is not None


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
