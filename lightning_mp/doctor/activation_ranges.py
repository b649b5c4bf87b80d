"""Measure the module outputs of one training forward, and find from them where an FP16 overflow starts.

:class:`ActivationRecorder` hooks every module of a model and counts each floating output of a forward under
autograd into a :class:`Sample`: log2|x| per octave (the exact ``frexp`` buckets of
:mod:`lightning_mp.doctor.log2_histogram`), the fraction FP16 could not hold, and each module's largest output and input
magnitude. All of it stays queued on the device until :meth:`Sample.read` (one transfer).
:func:`overflow_starts` then names the modules whose output left FP16's range while their inputs were in it.
:class:`lightning_mp.ActivationRangeMonitor` is the Lightning callback around these.

Cost: a few elementwise passes over each distinct output tensor (a container that returns its last child's tensor
is counted once, and a tensor's largest magnitude, once reduced, is reused as the next module's input).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mp.doctor.finite_checks import _tensors
from lightning_mp.doctor.log2_histogram import NUM_BUCKETS, REFERENCE_FORMAT, GradientRange, measure_on_device, unpack


@dataclass
class Sample:
    """One sampled step's measurements, still on the device."""

    step: int
    packed: Tensor | None = None  # [zeros, underflow, not_overflow, NUM_BUCKETS counts] over distinct outputs
    numel: int = 0
    modules: dict[str, int] = field(default_factory=dict)  # name -> position in `amax` (first-call order)
    amax: list[Tensor] = field(default_factory=list)  # per module: largest |output| (0-dim, on the device)
    input_amax: list[Tensor | None] = field(default_factory=list)  # per module: largest |input| (None: no input)
    grads: Tensor | None = None  # gradient counts at scale 1, for the picture
    grad_numel: int = 0

    def add_grads(self, grads: list[Tensor]) -> None:
        """Count the step's (unscaled) gradients at scale 1, for the picture; queued, no sync."""
        packed = measure_on_device(grads, 1.0, per_tensor=False)
        self.grads = packed if self.grads is None else self.grads + packed.to(self.grads.device)
        self.grad_numel += sum(g.numel() for g in grads)

    def read(self) -> _SampleValues:
        """Everything as host numbers, in one transfer (the one host sync of a sampled step); needs an output."""
        device = self.packed.device
        n = len(self.amax)
        parts = [
            self.packed.to(device),
            torch.stack([a.to(device) for a in self.amax]).double(),
            torch.stack([(a if a is not None else torch.zeros(())).to(device) for a in self.input_amax]).double(),
        ]
        if self.grads is not None:
            parts.append(self.grads.to(device))
        values = torch.cat(parts).tolist()
        size = 3 + NUM_BUCKETS
        return _SampleValues(
            acts=unpack(values[:size], self.numel, 1),
            names=list(self.modules),
            amax=values[size : size + n],
            input_amax=values[size + n : size + 2 * n],
            has_input=[a is not None for a in self.input_amax],
            grads=unpack(values[size + 2 * n :], self.grad_numel, 1) if self.grads is not None else None,
        )


@dataclass(frozen=True)
class _SampleValues:
    """A :class:`Sample` read back: the activations' counts, and per module (first-call order, the model itself
    as ``<model>``) its largest |output| and |input| (``has_input``: whether it had a floating input)."""

    acts: GradientRange
    names: list[str]
    amax: list[float]
    input_amax: list[float]
    has_input: list[bool]
    grads: GradientRange | None


def overflow_starts(values: _SampleValues) -> list[str]:
    """The modules whose output went above FP16's largest value while their inputs were within its range: where an
    overflow starts, not every module downstream that inherits it, first-called first."""
    limit = REFERENCE_FORMAT.max
    starts = [
        name
        for name, out, inp, has in zip(values.names, values.amax, values.input_amax, values.has_input)
        if out > limit and (not has or inp <= limit)
    ]
    # a container around an offender is not one itself: the submodule says where, more precisely
    return [n for n in starts if not any(_encloses(n, d) for d in starts)]


def _encloses(outer: str, inner: str) -> bool:
    return outer != inner and (outer == "<model>" or inner.startswith(outer + "."))


class ActivationRecorder:
    """Hooks on every module of ``model`` that measure the floating outputs of its forwards under autograd into
    ``sample`` (each distinct tensor once), until :meth:`remove`."""

    def __init__(self, model: nn.Module, sample: Sample) -> None:
        self.sample = sample
        self._known: dict[int, tuple[weakref.ref, int, Tensor]] = {}
        self._pending_inputs: list[Tensor | None] = []  # largest |input| of the forwards in flight (modules nest)
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre_hook))
            self._handles.append(module.register_forward_hook(self._post_hook(name or "<model>")))

    def remove(self) -> None:
        """Take every hook off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending_inputs.clear()
        self._known.clear()

    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        # inside a torch.compile'd region the hooks step aside, as the locator's do: Dynamo would trace the
        # bookkeeping (fullgraph=True refused it: "Could not guard on data-dependent expression"); compiled modules
        # are not measured
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        with torch.no_grad(), torch._C.DisableTorchFunction():
            amaxes = [self._amax_of(a) for a in args if isinstance(a, Tensor) and a.is_floating_point()]
        self._pending_inputs.append(torch.stack(amaxes).amax() if amaxes else None)
        return None

    def _post_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            sample = self.sample
            if not torch.is_grad_enabled() or not self._pending_inputs or torch.compiler.is_compiling():
                return
            input_amax = self._pending_inputs.pop()
            with torch.no_grad(), torch._C.DisableTorchFunction():
                new, amaxes = [], []
                for t in _tensors(output):
                    if not t.is_floating_point():
                        continue
                    seen = self._known.get(id(t))
                    if seen is not None and seen[0]() is t and seen[1] == t._version:
                        amaxes.append(seen[2])
                        continue
                    amaxes.append(self._amax_of(t))
                    new.append(t)
                if not amaxes:
                    return
                for t in new:
                    packed = measure_on_device([t], 1.0, per_tensor=False)
                    sample.packed = packed if sample.packed is None else sample.packed + packed.to(sample.packed.device)
                    sample.numel += t.numel()
                amax = torch.stack(amaxes).amax()
            if name in sample.modules:  # called again (a shared module): keep the largest
                i = sample.modules[name]
                sample.amax[i] = torch.maximum(sample.amax[i], amax.to(sample.amax[i].device))
                if sample.input_amax[i] is not None and input_amax is not None:
                    sample.input_amax[i] = torch.maximum(sample.input_amax[i], input_amax.to(sample.amax[i].device))
                return
            sample.modules[name] = len(sample.amax)
            sample.amax.append(amax)
            sample.input_amax.append(input_amax)

        return hook

    def _amax_of(self, t: Tensor) -> Tensor:
        """Largest |t| as a 0-dim FP32 tensor (inf for inf or NaN), reused for a tensor already reduced this step."""
        seen = self._known.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return seen[2]
        if t.numel() == 0:
            amax = torch.zeros((), device=t.device)
        else:
            lo, hi = torch.aminmax(t.detach())
            amax = torch.maximum(-lo.float(), hi.float()).nan_to_num(nan=float("inf"))
        self._known[id(t)] = (weakref.ref(t), t._version, amax)
        return amax
