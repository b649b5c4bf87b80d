"""Hooks that measure, for a set of Linears, what a recipe's FP8 casts do to each one's input, weight and output
gradient (:mod:`lightning_mp.fp8.statistics`), in a run that computes them in FP8 or not (a what-if).

Armed for one training step at a time: a forward pre-hook measures the input and the weight the first time each
Linear runs (before the forward, where FSDP2's weight is the all-gathered one, not this rank's shard), a forward
hook hangs a hook on its output that measures the output gradient when the backward reaches it (a tensor hook:
no ``BackwardHook`` wrapping, so in-place ops after the Linear stay allowed). Everything is queued on the device;
:meth:`Fp8Probe.collect` reads it back in one transfer (one host sync per measured step). Unarmed, there are no
hooks and no cost.

The tensors measured are those torchao casts: the input and the weight in the dtype the FP8 matmul receives them
(``dtype``: bf16 in an fp8 or bf16 run, the weight being the bf16 copy of its master), and the output gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_mp.fp8.statistics import RECIPE_SCALING, STATS, TENSORS, Stats, measure


class Fp8Probe:
    """Measures ``linears`` ((name, module) pairs) under ``recipe``'s scaling, one armed step at a time."""

    def __init__(self, linears: list[tuple[str, nn.Module]], recipe: str, dtype: torch.dtype | None = None) -> None:
        self.linears = list(linears)
        self.recipe = recipe
        self.scaling = RECIPE_SCALING[recipe]
        self.dtype = dtype  # None: the tensors as they come (an fp32 run's what-if)
        self._handles: list[Any] = []
        self._measured: dict[tuple[str, str], Tensor] = {}  # (module, tensor) -> packed Stats on the device
        self._pending: set[str] = set()  # Linears measured before their forward whose output gradient is to come

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        """Measure the next forward and backward of each Linear (its first, under gradient accumulation)."""
        if self.armed:
            return
        self._measured.clear()
        self._pending.clear()
        for name, module in self.linears:
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    remove = disarm  # a handle of the run's (removed at teardown)

    def collect(self) -> dict[str, dict[str, Stats]]:
        """module -> tensor -> :class:`Stats` measured since :meth:`arm` (one host read for all); disarms."""
        self.disarm()
        measured, self._measured = self._measured, {}
        if not measured:
            return {}
        device = next(iter(measured.values())).device
        values = torch.stack([v.to(device) for v in measured.values()]).tolist()  # the one host sync
        out: dict[str, dict[str, Stats]] = {}
        for (name, tensor), row in zip(measured, values):
            out.setdefault(name, {})[tensor] = Stats(*row)
        return {name: dict(sorted(d.items(), key=lambda kv: TENSORS.index(kv[0]))) for name, d in out.items()}

    def _pre_hook(self, name: str) -> Any:
        # before the forward: under FSDP2 the weight is the all-gathered one here (FSDP2's pre-forward hook runs
        # first); after it, FSDP2's post-forward hook has resharded it to this rank's DTensor shard
        def hook(module: nn.Module, args: tuple) -> None:
            if (name, "input") in self._measured or not args or not isinstance(args[0], Tensor):
                return
            if torch.compiler.is_compiling() or not args[0].is_floating_point():
                return
            x, w = args[0].detach(), module.weight.detach()
            if self.dtype is not None:
                x, w = x.to(self.dtype), w.to(self.dtype)
            self._measured[(name, "input")] = measure(x, self.scaling["input"])
            self._measured[(name, "weight")] = measure(w, self.scaling["weight"])
            self._pending.add(name)

        return hook

    def _forward_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if name in self._pending:
                self._pending.discard(name)
                if isinstance(output, Tensor) and output.requires_grad:
                    output.register_hook(self._grad_hook(name))

        return hook

    def _grad_hook(self, name: str) -> Any:
        def hook(grad: Tensor) -> None:
            if (name, "grad_output") not in self._measured:
                g = grad.detach() if self.dtype is None else grad.detach().to(self.dtype)
                self._measured[(name, "grad_output")] = measure(g, self.scaling["grad_output"])

        return hook


def tag(module: str, tensor: str, stat: str) -> str:
    """The TensorBoard tag of one statistic: ``fp8/<module>/<tensor>/<stat>``."""
    return f"fp8/{module or '<model>'}/{tensor}/{stat}"


def flat(stats: dict[str, dict[str, Stats]]) -> dict[str, float]:
    """Every statistic under its tag."""
    return {tag(m, t, s): float(v) for m, d in stats.items() for t, st in d.items() for s, v in zip(STATS, st)}
