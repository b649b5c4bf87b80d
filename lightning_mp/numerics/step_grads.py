"""What :class:`lightning_mp.numerics.step.MixedPrecisionStep` reads of an optimizer's gradients, and how it checks them.

* :meth:`StepGradients.read`: the gradients as the fused passes read them (:class:`~.grad_layout.GradLayout`, cached per
  optimizer, rebuilt only when the gradients moved).
* :meth:`StepGradients.reduce`: the dense gradients averaged across ranks (DDP with master weights), every rank
  passing the same list: a parameter without a gradient gets a zero buffer of its own, allocated once.
* :func:`non_finite_flag`: the inf/NaN flag without scaling, read-only (:func:`~.grad_layout.non_finite_flag`), or,
  for a few CPU gradients, one fused pass.
* :func:`few_cpu_grads`: a small model's CPU gradients (a sharded one's up to a few million local elements) as they are,
  checked (and unscaled) with no layout at all.

Costs: a steady step runs C-level passes over the parameters, no Python loop per parameter (a Python loop costs
several times more right after a backward, which has evicted the interpreter's data from the caches).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from lightning_mp.numerics import grad_layout
from lightning_mp.numerics.grad_layout import GradLayout, Grads

_GRAD, _IS_SPARSE = operator.attrgetter("grad"), operator.attrgetter("is_sparse")
_REQUIRES_GRAD, _IS_CPU = operator.attrgetter("requires_grad"), operator.attrgetter("is_cpu")
_DTYPE = operator.attrgetter("dtype")
_IS_NONE, _IS_NOT_NONE = partial(operator.is_, None), partial(operator.is_not, None)
_IS_FP32, _IS_PLAIN = partial(operator.is_, torch.float32), partial(operator.is_, Tensor)
_IS_DTENSOR = partial(operator.is_, DTensor)

# Below this many gradient elements on the CPU, the check is one fused pass that rewrites each element as itself
# (an unscale by 1.0): 2 torch calls where the read-only check makes 5 (sums of the runs, a concatenation of the
# small gradients and its sum, the flag over the sums), each 5-10 us right after a backward, where a tiny MLP's step
# is ~1 ms. The write costs about one more read per element: for 2^16 FP32 elements (256 KiB) a few microseconds.
SMALL_CHECK = 1 << 16
# FSDP2's gradients (DTensors) make an irregular layout, rebuilt at every step: a Python pass per parameter (~0.15 ms
# for a 2-layer GPT's 28 shards inside the loop). There the fused pass wins up to a few million local elements (one
# AVX512 core, 28 shards: 0.14 against 0.26 ms for 1M elements, 0.54 against 0.69 ms for 3.7M; the layout's read-only
# sums win from about 10M).
SHARDED_CHECK = 1 << 22
_ONE = torch.ones(())


def few_cpu_grads(params: list[Tensor]) -> list[Tensor] | None:
    """The gradients of ``params`` as they are (FSDP2's: this rank's non-empty shards), where one fused pass over them
    is all a check (or an unscale) needs: at most :data:`SMALL_CHECK` elements in all (shards: :data:`SHARDED_CHECK`),
    each a dense FP32 CPU tensor outside any graph. ``None`` otherwise: the layout's path (runs of a flat buffer,
    sparse, complex and 16-bit gradients). A few C-level passes and no layout to validate or rebuild (the layout's
    read cost ~15 us of a tiny MLP's ~1.1 ms CPU step; its rebuild for DTensor gradients, every step, ~90 us). Call it
    outside grad mode.

    Uneven shards can send ranks down different paths here; that decides nothing: neither path runs a collective,
    both unscale each element alike, and the flag is agreed across ranks afterwards (``agree_on_overflow_``)."""
    grads = list(filter(_IS_NOT_NONE, map(_GRAD, params)))
    limit = SMALL_CHECK
    if grads and all(map(_IS_DTENSOR, map(type, grads))):
        grads = list(filter(Tensor.numel, map(DTensor.to_local, grads)))  # a view of each shard (no autograd)
        limit = SHARDED_CHECK
    if all(map(_IS_CPU, grads)) and all(map(_IS_FP32, map(_DTYPE, grads))) and all(
        map(_IS_PLAIN, map(type, grads))
    ) and not any(map(_IS_SPARSE, grads)) and not any(map(_REQUIRES_GRAD, grads)):
        return grads if sum(map(Tensor.numel, grads)) <= limit else None
    return None


def fused_flag(tensors: list[Tensor]) -> Tensor:
    """1.0 if any of these CPU tensors (none part of a graph) holds an inf or NaN, else 0.0: torch's fused
    ``_amp_foreach_non_finite_check_and_unscale_`` with a scale of 1.0, which writes each element back unchanged."""
    flag = torch.zeros(())
    if tensors:  # an FSDP2 rank can hold no elements of a tiny model
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, _ONE)
    return flag


def non_finite_flag(grads: Grads) -> Tensor:
    """1.0 if any of the step's gradients holds an inf or NaN, else 0.0 (a 0-dim tensor; no host read, no scaling).

    A few CPU gradients (at most :data:`SMALL_CHECK` elements, none part of a graph): :func:`fused_flag` (not for
    gradients built with ``create_graph=True``: an in-place write would spoil their graph). Otherwise the read-only
    check of :func:`lightning_mp.numerics.grad_layout.non_finite_flag`."""
    groups = grads.groups
    if len(groups) == 1 and next(iter(groups))[0].type == "cpu":
        tensors = grads.tensors
        if sum(map(Tensor.numel, tensors)) <= SMALL_CHECK and not any(map(_REQUIRES_GRAD, tensors)):
            return fused_flag(tensors)
    return grad_layout.non_finite_flag(groups)


class StepGradients:
    """The step's per-optimizer gradient layouts and the zero buffers ``reduce`` gives missing gradients."""

    def __init__(self) -> None:
        self._layouts: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizer -> GradLayout
        self._last: tuple[int, GradLayout | None] = (0, None)  # (id(optimizer), its layout), the last one read
        self._zero_grads: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its zero gradient (reduce)

    def read(self, optimizer: Optimizer, params: list[Tensor], refuse_16_bit: bool) -> Grads:
        """This optimizer's gradients as the fused passes read them; the layout is rebuilt only when they moved."""
        key, layout = self._last
        if key != id(optimizer):  # the one-entry cache spares the weak dictionary's Python on every step
            layout = self._layouts.get(optimizer)
        grads = layout.read(params) if layout is not None else None  # checks the parameters: a reused id misses
        if grads is None:
            layout = self._layouts[optimizer] = GradLayout(params, refuse_16_bit=refuse_16_bit)
            grads = layout.read(params)
        self._last = (id(optimizer), layout)
        return grads

    def reduce(self, params: list[Tensor], reduce_: Callable[[list[Tensor]], None]) -> bool:
        """Average the dense gradients across ranks with ``reduce_``; every rank reduces the same list. Whether every
        gradient the step reads went through it (a sparse one does not)."""
        grads = list(map(_GRAD, params))
        if not any(map(_IS_NONE, grads)) and not any(map(_IS_SPARSE, grads)):  # the steady step: C-level passes only
            reduce_(grads)
            return True
        reducible, everything = [], True
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = self._zero_grad(p)
            if p.grad is not None:
                if p.grad.is_sparse:
                    everything = False
                else:
                    reducible.append(p.grad)
        reduce_(reducible)
        return everything

    def _zero_grad(self, p: Tensor) -> Tensor:
        """A zero gradient for ``p``, the same buffer every step (no allocation, no zeroing of new pages by the
        kernel; the layout cache keeps it too)."""
        buf = self._zero_grads.get(p)
        if buf is None or buf.shape != p.shape or buf.dtype != p.dtype or buf.device != p.device:
            buf = self._zero_grads[p] = torch.zeros_like(p)
        else:
            buf.zero_()  # the optimizer or the user may have written it since
        return buf

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn, torch.save(trainer): no caches (weak references, tensors)
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()
