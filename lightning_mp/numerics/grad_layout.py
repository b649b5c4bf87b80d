"""An optimizer's gradients laid out once for the fused passes, and the read-only inf/NaN check over them.

Master weights fold most gradients into views of one flat FP32 buffer per device, the same tensors every step.
Parameters kept in FP32 (norms, embeddings) and parameters read outside their module's forward get ordinary
gradients from autograd: new tensors after every ``zero_grad()``. :class:`GradLayout` sorts an optimizer's
gradients once, per (device, dtype), into

* runs: gradients that tile one buffer back to back, passed as one 1-D view per run (in practice the flat buffer:
  one tensor for a fused kernel instead of one per parameter);
* loose gradients: every other one, kept by its position in the optimizer's parameter list and re-read each step;
  small ones (up to 4096 elements: norm weights, biases) apart from large ones (a kept-FP32 embedding).

:meth:`GradLayout.read` checks with C-level ``map`` passes (no Python loop over the parameters) that the optimizer
holds the same parameters, that the tiled gradients are the same tensors, that no gradient appeared or went away,
and that the loose ones are dense tensors of the same type and dtype; then it hands out this step's tensors. It
keeps none of the loose ones between steps (that would hold their memory through the next backward).

Rebuilt when: a parameter is added, removed or replaced in ``param_groups``; a tiled gradient is replaced (its
buffer re-allocated); a gradient appears, goes away, changes dtype or turns sparse. Sparse, complex and sharded
(``DTensor``) gradients make a layout irregular: rebuilt every step. Not seen: storage swapped under an unchanged
gradient tensor with ``grad.data = ...`` (neither torch nor Lightning does that).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator
from itertools import chain
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors
from torch.optim import Optimizer

from lightning_mp.numerics import without_grad
from lightning_mp.numerics.distributed import run_view
from lightning_mp.formats import HALF_DTYPES
from lightning_mp.numerics.sharding import local

_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_IS_SPARSE = operator.attrgetter("is_sparse")
_IS_NONE = functools.partial(operator.is_, None)
_PARAMS = operator.itemgetter("params")

# A loose gradient this small is copied into one concatenation for the CPU check: copying 16 KB costs less than the
# ~2 us of one more reduction op.
_SMALL = 4096


class Group(NamedTuple):
    """One (device, dtype) group of one step: run views, small and large loose gradients, and how to concatenate
    the small ones (``torch.cat`` when all are 1-D, else a flattening copy)."""

    runs: list[Tensor]
    small: list[Tensor]
    large: list[Tensor]
    concat: Callable[[list[Tensor]], Tensor]


Groups = dict[tuple[torch.device, torch.dtype], Group]


class Grads(NamedTuple):
    """One step's gradients: ``tensors`` (runs and loose ones, for the fused unscale) and the same by group."""

    tensors: list[Tensor]
    groups: Groups


def optimizer_params(optimizer: Optimizer) -> list[Tensor]:
    return list(chain.from_iterable(map(_PARAMS, optimizer.param_groups)))


class GradLayout:
    """The gradients of ``params`` (an optimizer's, in order) sorted into runs and loose ones; see the module doc.

    ``refuse_16_bit``: a float16 / bfloat16 gradient raises (master weights: the optimizer reads FP32 only).
    """

    def __init__(self, params: list[Tensor], refuse_16_bit: bool = False) -> None:
        self.params = params
        grads = list(map(_GRAD, params))
        self.regular = True
        by_group: dict[tuple[torch.device, torch.dtype], list[tuple[int, Tensor]]] = {}
        for i, (p, g) in enumerate(zip(params, grads)):
            if g is None:
                continue
            if refuse_16_bit and g.dtype in HALF_DTYPES:
                raise RuntimeError(
                    f"A {g.dtype} gradient of a parameter of shape {tuple(p.shape)} reached the optimizer; under "
                    "master weights it must not read 16-bit gradients (float16, bfloat16). HINT: call backward "
                    "through Lightning (`self.manual_backward(loss)` in manual optimization), not on a 16-bit copy "
                    "of a parameter made outside the plugin."
                )
            dense = _dense(p, g)
            self.regular = self.regular and dense is g
            if dense.numel():  # an FSDP2 shard can be empty on some ranks (a bias of 1 element over 2 ranks)
                by_group.setdefault((dense.device, dense.dtype), []).append((i, dense))
        self._absent = _picker([i for i, g in enumerate(grads) if g is None])
        tiled_at: list[int] = []
        loose_at: list[int] = []
        self._groups: list[tuple[tuple[torch.device, torch.dtype], list[Tensor], Callable, Callable, Callable]] = []
        built: Groups = {}
        for key, items in by_group.items():
            runs, loose = _runs(items)
            tiled_at += [i for run in runs for i, _ in run]
            loose_at += [i for i, _ in loose]
            small = [(i, g) for i, g in loose if g.numel() <= _SMALL]
            large = [(i, g) for i, g in loose if g.numel() > _SMALL]
            concat = torch.cat if all(g.dim() == 1 for _, g in small) else _flatten_dense_tensors
            views = [run_view([g for _, g in run]) for run in runs]
            self._groups.append((key, views, _picker([i for i, _ in small]), _picker([i for i, _ in large]), concat))
            built[key] = Group(views, [g for _, g in small], [g for _, g in large], concat)
        self._tiled = [grads[i] for i in tiled_at]
        self._pick_tiled = _picker(tiled_at)
        self._pick_loose = _picker(loose_at)
        loose_now = self._pick_loose(grads)
        self._loose_types = (tuple(map(type, loose_now)), tuple(map(_DTYPE, loose_now)))
        self._built: Grads | None = Grads([t for group in built.values() for t in chain(*group[:3])], built)

    def read(self, params: list[Tensor]) -> Grads | None:
        """This step's gradients, or ``None`` when the layout no longer fits them (build a new one)."""
        if self._built is not None:  # the step that built it: irregular layouts hand out their dense forms here
            built, self._built = self._built, None
            return built
        if not self.regular or len(params) != len(self.params) or not all(map(operator.is_, params, self.params)):
            return None
        grads = list(map(_GRAD, params))
        if not all(map(operator.is_, self._pick_tiled(grads), self._tiled)):
            return None
        if not all(map(_IS_NONE, self._absent(grads))):
            return None  # a parameter that had no gradient has one now
        loose = self._pick_loose(grads)
        if any(map(_IS_NONE, loose)) or (tuple(map(type, loose)), tuple(map(_DTYPE, loose))) != self._loose_types:
            return None
        if any(map(_IS_SPARSE, loose)):
            return None
        groups = {key: Group(runs, small(grads), large(grads), cat) for key, runs, small, large, cat in self._groups}
        return Grads([t for group in groups.values() for t in chain(*group[:3])], groups)


def _dense(p: Tensor, g: Tensor) -> Tensor:
    """What the fused passes read of a gradient (``GradScaler``'s rules): a sparse one's coalesced values (a view of
    what the optimizer reads), a sharded one's local shard, a complex one as real pairs; ``g`` itself otherwise."""
    if g.is_sparse:
        if not g.is_coalesced():
            p.grad = g = g.coalesce()
        g = g._values()
    g = local(g)  # FSDP2: unscale and check this rank's shard; the flag is agreed across ranks
    return torch.view_as_real(g) if g.is_complex() else g


def _runs(items: list[tuple[int, Tensor]]) -> tuple[list[list[tuple[int, Tensor]]], list[tuple[int, Tensor]]]:
    """Split (position, gradient) pairs of one device and dtype into runs of two or more that tile one buffer back
    to back, in any parameter order (sorted by storage and offset), and the rest."""
    contiguous = sorted(
        ((g.untyped_storage().data_ptr(), g.storage_offset(), i, g) for i, g in items if g.is_contiguous()),
        key=lambda entry: entry[:3],
    )
    rest = [(i, g) for i, g in items if not g.is_contiguous()]
    runs: list[list[tuple[int, Tensor]]] = []
    end = None
    for ptr, offset, i, g in contiguous:
        if end == (ptr, offset):
            runs[-1].append((i, g))
        else:
            runs.append([(i, g)])
        end = (ptr, offset + g.numel())
    rest += [run[0] for run in runs if len(run) == 1]
    return [run for run in runs if len(run) > 1], sorted(rest, key=lambda entry: entry[0])


def _picker(positions: list[int]) -> Callable[[list], list]:
    """``seq -> [seq[i] for i in positions]`` as one C-level call."""
    if not positions:
        return lambda seq: []
    if len(positions) == 1:
        (only,) = positions
        return lambda seq: [seq[only]]
    get = operator.itemgetter(*positions)
    return lambda seq: list(get(seq))


@without_grad
def non_finite_flag(groups: Groups) -> Tensor:
    """1.0 if any element of the grouped gradients is inf or NaN, else 0.0; read-only, and no host read.

    Per (device, dtype) group a few fused reductions to 0-dim results, then per device one
    ``_amp_foreach_non_finite_check_and_unscale_`` over those results (it rewrites the results, times 1.0, never a
    gradient) raises the flag:

    * off the CPU: ``_foreach_norm(tensors, inf)``, the largest magnitude of each (exact: it cannot overflow), one
      multi-tensor kernel for runs and loose gradients together;
    * on the CPU, where that norm is a per-tensor fallback (4.4 ms for 1.7M FP32 elements on one AVX512 core): a
      ``sum`` of each run and of each large loose gradient (0.07 ms for 1.7M elements, one streaming read), and one
      sum of the small loose ones concatenated (3.5 us for 20 LayerNorm gradients, against 20 us for one
      ``_foreach_norm`` call over them). inf + -inf is NaN and NaN propagates, so a finite sum proves finite
      elements; a finite gradient is flagged only if its FP32 sum passes 3.4e38, which no usable gradient does.
      16-bit groups (no master weights) take a 2-norm in FP32 (``dtype=``) instead: their sum would round to 16
      bits and pass FP16's 65504 where no element does.
    """
    flags: dict[torch.device, Tensor] = {}
    for (device, dtype), (runs, small, large, concat) in groups.items():
        if device.type != "cpu":
            results = list(torch._foreach_norm(runs + small + large, float("inf")))
        elif dtype in HALF_DTYPES:
            results = list(torch._foreach_norm(runs + small + large, 2, dtype=torch.float32))
        else:
            results = [t.sum() for t in chain(runs, large)] + ([concat(small).sum()] if small else [])
        flag = flags.get(device)
        if flag is None:
            flag = flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(results, flag, _one(device))
    if not flags:
        return torch.zeros(())
    first, *others = flags.values()
    if not others:
        return first
    return torch.stack([first, *(f.to(first.device) for f in others)]).amax()


@functools.lru_cache(maxsize=None)
def _one(device: torch.device) -> Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def named_grads(root: nn.Module | None, optimizer: Optimizer | None = None) -> Iterator[tuple[str, Tensor]]:
    """(parameter name under ``root``, the gradient the optimizer reads), for one optimizer's parameters or all."""
    if root is None:
        return
    allowed = None if optimizer is None else {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, p in root.named_parameters():
        if p.grad is not None and (allowed is None or id(p) in allowed):
            yield name, p.grad
