"""The parity guard of lean bf16: FP32 shadows of a sample of parameters, stepped beside the lean ones.

A sample of whole parameters (so per-tensor optimizer math holds) is shadowed in FP32 and stepped by a second
optimizer of the same class and param-group hyperparameters with the same gradients. After each step it reports the
relative drift of the lean values from their shadows and the fraction of updates the lean representation lost
(Collage's "effective descent quality"). Cost per step: one FP32 copy of the sample, its optimizer step, and one host
read. Under FSDP2 the shadows are sharded like their parameters and the four sums behind the two figures are summed
over the ranks, so every rank reports the whole sample's drift.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from lightning_mp.numerics.sharding import DTensor, local


class ParityGuard:
    """:meth:`snapshot` before the lean step, :meth:`measure` after it. ``value(p)`` reads the lean value as FP32
    (:meth:`CompensatedStep.master`, or ``p.detach().float()`` for pure bf16). ``fraction`` of the parameters,
    at least one, chosen by ``seed`` (the same on every rank). The shadow optimizer starts with empty state: build the
    guard before the first step, or expect drift from the state the lean optimizer already had.
    """

    def __init__(self, params: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer,
                 value: Callable[[nn.Parameter], Tensor] = lambda p: p.detach().float(), fraction: float = 0.01,
                 seed: int = 0) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"fraction={fraction!r} is not allowed: use a number in (0, 1].")
        params = list(params)
        k = min(len(params), max(1, math.ceil(fraction * len(params))))
        self.index = sorted(random.Random(seed).sample(range(len(params)), k))
        self.params = [params[i] for i in self.index]
        self._value, self._optimizer = value, optimizer
        self.shadows = {p: value(p).clone() for p in self.params}
        self._groups = [[self.shadows[p] for p in g["params"] if p in self.shadows] for g in optimizer.param_groups]
        self.shadow_optimizer = type(optimizer)([{**self._hyper(g), "params": s}
                                                 for g, s in zip(optimizer.param_groups, self._groups) if s])
        sharded = next((p for p in self.params if isinstance(p, DTensor)), None)
        self._group = sharded.device_mesh.get_group() if sharded is not None else None
        self._before: list[Tensor] = []

    @staticmethod
    def _hyper(group: dict) -> dict:
        return copy.deepcopy({k: v for k, v in group.items() if k != "params"})

    def _flat(self, tensors: Iterable[Tensor]) -> Tensor:
        return torch.cat([local(t).reshape(-1) for t in tensors])  # this rank's shards

    def snapshot(self) -> None:
        self._before = [self._value(p).clone() for p in self.params]

    @torch.no_grad()
    def measure(self) -> tuple[float, float]:
        """Step the shadows with the lean gradients (FP32 upcasts) and the current hyperparameters (a scheduler's
        lr included); return (||lean - shadow|| / ||shadow||, lost updates / shadow updates). Syncs once."""
        if not self._before:
            raise RuntimeError("measure() needs snapshot() before the lean step: it compares with those values.")
        live = iter(g for g, s in zip(self._optimizer.param_groups, self._groups) if s)
        for sg in self.shadow_optimizer.param_groups:
            sg.update(self._hyper(next(live)))
        for p, s in self.shadows.items():
            s.grad = None if p.grad is None else p.grad.float()
        shadows = list(self.shadows.values())
        before = self._flat(shadows)
        self.shadow_optimizer.step()
        shadow, lean = self._flat(shadows), self._flat(self._value(p) for p in self.params)
        moved = shadow != before
        lost = moved & (lean == self._flat(self._before))
        self._before = []
        sums = torch.stack([(lean - shadow).square().sum(), shadow.square().sum(), lost.sum(), moved.sum()])
        if self._group is not None:
            torch.distributed.all_reduce(sums, group=self._group)
        diff2, norm2, n_lost, n_moved = sums.tolist()  # the one host read
        return math.sqrt(diff2) / math.sqrt(norm2) if norm2 else math.nan, n_lost / max(n_moved, 1.0)
