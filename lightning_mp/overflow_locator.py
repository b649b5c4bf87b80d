"""Name the module where a step first went non-finite: its forward output, or else a gradient in the backward.

A skipped step says only *that* some gradient held inf/NaN. :class:`OverflowLocator` says *where*: the first module
(in execution order) whose forward output went non-finite, or, when the whole forward was finite, the first module
whose gradient went non-finite in the backward. Without a Trainer::

    locator = OverflowLocator(model)
    for batch in data:
        locator.begin_step()
        loss = model(batch).float().mean()
        (loss * scale).backward()
        if not all(p.grad.isfinite().all() for p in model.parameters()):  # your own skip test
            print(locator.report())  # "forward overflow in `mlp.1` (Scale): output went inf; largest input ..."
    locator.remove()

What is checked
---------------
* forward: every floating tensor a module returns (a tensor, or one level of tuple / list / dict). A tensor already
  checked in this step (a container returning its last child's output) is matched by identity and ``_version``
  and not read again, so each activation is read once.
* backward: the gradient of every parameter, as autograd produces it (a tensor hook, before accumulation). That is
  where FP16 backward overflow starts in practice: a Linear's weight gradient sums over every row of the batch,
  while each activation gradient is one row's share. With ``input_grads=True`` (the locator's default; the plugin
  passes ``False``, ~1.5% of step time saved on the demo GPT) the gradient each module's backward produces for its
  floating inputs is checked too (the pre-hook hands the module a ``view_as`` of each input, no copy, with a hook
  on it), which names parameter-free modules (an activation, an attention core) whose backward overflows; it costs
  one more read of every activation gradient, and modules see a view instead of the tensor their caller passed
  (the same view for the same tensor, so ``query is key`` checks still hold).
* forwards without autograd (validation, ``torch.no_grad``) are not checked.

What it costs, and where it syncs
---------------------------------
On CUDA (and any non-CPU device) each check is one ``aminmax`` (NaN propagates through min and max, so one pass
finds inf, -inf and NaN and gives the largest magnitude), kept on the device as 0-dim tensors: nothing is read back
on a clean step. Only :meth:`report` reads them, in one transfer per device (a host sync): call it when a step was
skipped (the plugin does, after the skip-or-step sync it makes anyway). On the CPU there is nothing to sync, so the
check is a plain ``sum`` (half the work of ``aminmax`` there), read at once; a non-finite sum is confirmed with an
``aminmax`` (an FP16 row sum can overflow where no element does) and the first one found is kept with its input's
magnitude. The hooks run with torch-function and Python dispatch modes off, so neither the FP32 op policy nor GEMM
emulation upcasts or slows them. Module inputs are read from positional arguments only.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.utils._python_dispatch import _disable_current_modes

PHASES = ("forward", "backward")

# A step that never calls begin_step (a forgotten call in a custom loop) must not grow without bound: past this many
# device records the locator stops recording until the next begin_step. A GPT step makes a few hundred.
_MAX_RECORDS = 200_000

# Devices whose checks are read at once (no asynchronous queue, so reading costs no sync). Everything else is
# checked with device-side aminmax and read back only by report(). Tests empty this to run the device path on CPU.
_EAGER_DEVICE_TYPES = frozenset({"cpu"})


@dataclass(frozen=True)
class OverflowReport:
    """Where a step first went non-finite.

    Attributes:
        phase: ``"forward"`` (a module's output) or ``"backward"`` (a gradient its backward produced).
        module: the module's qualified name in the model (``""`` is the model itself).
        module_type: the module's class name.
        tensor: what went non-finite: ``"output"``, ``"input gradient"``, ``"gradient of <parameter>"``, or
            ``"own code"``: a forward overflow in the module's own code between its submodules (the first
            submodule output that went non-finite had a non-finite input, made by this module's ``forward``).
        value: ``"inf"``, ``"-inf"`` or ``"nan"``.
        input_amax: forward overflows: the largest magnitude at the module's floating inputs (finite: the overflow
            happened inside it). ``None`` for backward overflows and for modules without a floating input.
    """

    phase: str
    module: str
    module_type: str
    tensor: str
    value: str
    input_amax: float | None = None

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase={self.phase!r} is not allowed: use one of {PHASES}.")

    @property
    def name(self) -> str:
        """The module's name, ``<model>`` for the model itself."""
        return self.module or "<model>"

    def __str__(self) -> str:
        head = f"{self.phase} overflow in `{self.name}` ({self.module_type})"
        if self.tensor == "own code":
            text = f"{head}: its own forward code, between its submodules, made a {self.value}"
        else:
            text = f"{head}: {self.tensor} went {self.value}"
        if self.input_amax is None:
            return text
        if math.isfinite(self.input_amax):
            return f"{text}; largest input magnitude {self.input_amax:.4g}"
        return f"{text}; its input was already non-finite"


@dataclass(frozen=True)
class _Found:
    seq: int
    report: OverflowReport


class OverflowLocator:
    """Checks each module's outputs and gradients for inf/NaN, cheaply; :meth:`report` names the first.

    Args:
        model: the module tree to watch (every submodule, the model itself included).
        input_grads: also check the gradient each module's backward produces for its inputs (default; see the
            module docstring: one more read of every activation gradient). ``False`` checks parameter gradients
            only: a parameter-free module whose backward overflows is then named by the nearest parameter before
            it.

    Call :meth:`begin_step` at the start of every training step (before the first forward; under gradient
    accumulation, once per optimizer step), :meth:`report` after a step whose gradients were non-finite, and
    :meth:`remove` to take the hooks off.
    """

    def __init__(self, model: nn.Module, input_grads: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model={model!r} is not allowed: pass the torch.nn.Module to watch.")
        if not isinstance(input_grads, bool):
            raise ValueError(f"input_grads={input_grads!r} is not allowed: use True or False.")
        self.input_grads = input_grads
        self._names: list[str] = []
        self._types: list[str] = []
        self._handles: list[Any] = []
        # device checks, read only by report(): (seq, module index, phase index, tensor, [min, max], input stats)
        self._records: list[tuple[int, int, int, str, list[Tensor], list[Tensor] | None]] = []
        self._found: dict[int, _Found] = {}  # phase index -> first CPU culprit (CPU checks are read at once)
        self._calls: list[tuple[int, tuple, list[Tensor] | None]] = []  # in-flight forwards: (index, args, stats)
        self._known: dict[int, tuple[weakref.ref, int, list[Tensor] | None]] = {}  # id -> (ref, _version, stats)
        self._seq = 0
        self._recording = True
        seen_params: set[int] = set()
        for index, (name, module) in enumerate(model.named_modules()):
            self._names.append(name)
            self._types.append(type(module).__name__)
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(index)))
            self._handles.append(module.register_forward_hook(self._post_hook(index), always_call=True))
            for pname, param in module.named_parameters(recurse=False):
                # an uninitialized (lazy) parameter takes no hook; its module's outputs are still checked
                if param.requires_grad and id(param) not in seen_params and not is_lazy(param):
                    seen_params.add(id(param))
                    self._handles.append(param.register_hook(self._grad_hook(index, f"gradient of {pname}")))

    # ------------------------------------------------------------------ API
    def begin_step(self) -> None:
        """Forget the previous step's checks (device tensors only: nothing to sync)."""
        self._records.clear()
        self._found.clear()
        self._calls.clear()
        self._known.clear()
        self._recording = True

    def report(self) -> OverflowReport | None:
        """The first non-finite forward output of this step, else its first non-finite gradient, else ``None``.

        Reads the device checks back in one transfer per device (a host sync): call it when a step was skipped.
        """
        records = self._records
        flat = [t for rec in records for t in rec[4]]
        spans: list[tuple[int, int]] = []
        for rec in records:
            start = len(flat)
            flat.extend(rec[5] or ())
            spans.append((start, len(flat)))
        values = _to_host(flat)
        for phase in (0, 1):
            best = self._found.get(phase)
            offset = 0
            for pos, (seq, module, rec_phase, tensor, stats, inputs) in enumerate(records):
                vals = values[offset : offset + len(stats)]
                offset += len(stats)
                if rec_phase != phase or (best is not None and best.seq < seq):
                    continue
                value = _non_finite(vals)
                if value is None:
                    continue
                amax = _amax(values[spans[pos][0] : spans[pos][1]]) if inputs else None
                report = OverflowReport(PHASES[phase], self._names[module], self._types[module], tensor, value, amax)
                if phase == 0 and amax is not None and not math.isfinite(amax):
                    report = self._own_code_report(pos, value, values, spans) or report
                best = _Found(seq, report)
                break
            if best is not None:
                return best.report
        return None

    def remove(self) -> None:
        """Take every hook off the model; the locator checks nothing afterwards."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.begin_step()

    @property
    def module_names(self) -> list[str]:
        """Qualified names of the watched modules, in ``named_modules()`` order."""
        return list(self._names)

    # ------------------------------------------------------------------ hooks
    def _pre_hook(self, index: int):
        def hook(module: nn.Module, args: tuple) -> tuple | None:
            # inside a torch.compile'd region the hooks step aside (Dynamo would trace the bookkeeping): compiled
            # modules are located by the eager modules around them and by their parameters' gradients
            if not torch.is_grad_enabled() or not self._recording or torch.compiler.is_compiling():
                return None
            with _bare():
                floats = tuple(a for a in args if isinstance(a, Tensor) and a.is_floating_point())
                # device inputs: their numbers now (mostly reused from the module that produced them); CPU inputs
                # are only measured if this module turns out to be the culprit
                stats = [s for a in floats if a.device.type not in _EAGER_DEVICE_TYPES for s in self._device_stats(a)]
                self._calls.append((index, floats, stats))
                if not self.input_grads or not any(a.requires_grad for a in floats):
                    return None
                views: dict[int, Tensor] = {}
                new_args = []
                for a in args:
                    if isinstance(a, Tensor) and a.is_floating_point() and a.requires_grad:
                        if id(a) not in views:
                            # a view of its own, so the hook sees only the gradient this module's backward makes
                            view = views[id(a)] = a.view_as(a)
                            view.register_hook(self._grad_hook(index, "input gradient"))
                            entry = self._known.get(id(a))
                            if entry is not None:
                                self._known[id(view)] = (weakref.ref(view), view._version, entry[2])
                        a = views[id(a)]
                    new_args.append(a)
            return tuple(new_args)

        return hook

    def _post_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if torch.compiler.is_compiling() or not self._calls or self._calls[-1][0] != index:
                return  # no matching pre-hook: grad disabled, not recording, or the forward raised in a child
            _, inputs, input_stats = self._calls.pop()
            with _bare():
                checked = [self._check_output(index, t, inputs, input_stats) for t in _tensors(output)]
            if input_stats and not any(checked) and self._room():
                # nothing new to check, but its inputs' numbers may be needed to tell where an overflow came from
                self._records.append((self._next_seq(), index, 0, "output", [], input_stats))

        return hook

    def _grad_hook(self, index: int, tensor: str):
        def hook(grad: Tensor) -> None:
            if not self._recording or torch.compiler.is_compiling():
                return
            with _bare():
                grad = _real_dense(grad)
                if grad.device.type in _EAGER_DEVICE_TYPES:
                    value = self._found.get(1) is None and _cpu_non_finite(grad)
                    if value:
                        report = OverflowReport("backward", self._names[index], self._types[index], tensor, value)
                        self._found[1] = _Found(self._next_seq(), report)
                elif self._room():
                    self._records.append((self._next_seq(), index, 1, tensor, list(torch.aminmax(grad.detach())), None))

        return hook

    # ------------------------------------------------------------------ checks
    def _check_output(self, index: int, t: Tensor, inputs: tuple, input_stats: list[Tensor] | None) -> bool:
        """Check one output tensor; False when there was nothing to check (not floating, or already checked)."""
        if not t.is_floating_point():
            return False
        entry = self._known.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            return False  # already checked in this step: its first producer is the earlier one
        if t.device.type not in _EAGER_DEVICE_TYPES:
            stats = self._device_stats(t)
            if self._room():
                self._records.append((self._next_seq(), index, 0, "output", stats, input_stats))
            return True
        self._known[id(t)] = (weakref.ref(t), t._version, None)
        if self._found.get(0) is not None:
            return True
        value = _cpu_non_finite(t)
        if not value:
            return True
        amax = max((_host_amax(a) for a in inputs), default=None)
        report = OverflowReport("forward", self._names[index], self._types[index], "output", value, amax)
        if amax is not None and not math.isfinite(amax):
            # no module output before this one was non-finite, yet its input was: the innermost caller whose own
            # input was finite made it in its own forward code (none such: the batch itself was non-finite)
            for caller, caller_inputs, _ in reversed(self._calls):
                caller_amax = max((_host_amax(a) for a in caller_inputs), default=None)
                if caller_amax is None or math.isfinite(caller_amax):
                    report = OverflowReport(
                        "forward", self._names[caller], self._types[caller], "own code", value, caller_amax
                    )
                    break
        self._found[0] = _Found(self._next_seq(), report)
        return True

    def _device_stats(self, t: Tensor) -> list[Tensor]:
        """[min, max] of a device tensor, reusing the numbers of a tensor already reduced in this step."""
        entry = self._known.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version and entry[2] is not None:
            return entry[2]
        stats = list(torch.aminmax(t.detach()))
        self._known[id(t)] = (weakref.ref(t), t._version, stats)
        return stats

    def _own_code_report(self, pos: int, value: str, values: list[float], spans) -> OverflowReport | None:
        """Device path of the 'own code' case: the enclosing module (by name) whose recorded input was finite."""
        names = self._names
        index = self._records[pos][1]
        while names[index]:
            parent = names[index].rpartition(".")[0]
            if parent not in names:
                return None
            index = names.index(parent)
            later = next((p for p in range(pos + 1, len(self._records)) if self._records[p][1:3] == (index, 0)), None)
            if later is None:
                continue  # no record of that call (not run under autograd): look further out
            amax = _amax(values[spans[later][0] : spans[later][1]])
            if amax is None or math.isfinite(amax):
                return OverflowReport("forward", names[index], self._types[index], "own code", value, amax)
        return None

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _room(self) -> bool:
        if len(self._records) >= _MAX_RECORDS:
            self._recording = False  # begin_step is not being called; stop rather than grow
        return self._recording


@contextlib.contextmanager
def _bare() -> Iterator[None]:
    """No torch-function mode (the FP32 policy) and no Python dispatch mode (GEMM emulation) for the checks: they
    would only add a Python call per op, and the FP32 policy would upcast."""
    with torch._C.DisableTorchFunction():
        if torch._C._len_torch_dispatch_stack():
            with _disable_current_modes():
                yield
        else:
            yield


def _tensors(output: Any) -> Iterator[Tensor]:
    """The tensors of a module's output: a tensor, or one level of tuple / list / dict (what modules return)."""
    if isinstance(output, Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        yield from (o for o in output if isinstance(o, Tensor))
    elif isinstance(output, dict):
        yield from (o for o in output.values() if isinstance(o, Tensor))


def _real_dense(t: Tensor) -> Tensor:
    """What to check of a gradient: a sparse one's values, a complex one as real pairs (as GradScaler does)."""
    if t.is_sparse:
        t = t._values()
    return torch.view_as_real(t) if t.is_complex() else t


def _cpu_non_finite(t: Tensor) -> str | None:
    """'nan' / 'inf' / '-inf' if the CPU tensor ``t`` holds one, else None; usually one ``sum`` pass.

    inf and NaN propagate through a sum (inf + -inf is NaN), so a finite sum proves every element finite. The sum
    accumulates in FP32 on the CPU but an FP16 result is rounded to FP16, where a finite tensor's sum can pass
    65504: FP16 is summed along its last dimension first (rows stay small), and any non-finite sum is confirmed
    element by element with ``aminmax`` before it counts.
    """
    t = t.detach()
    if t.numel() == 0:
        return None
    total = t.sum(-1).sum(dtype=torch.float32) if t.dtype == torch.float16 and t.dim() else t.sum()
    if math.isfinite(total.item()):
        return None
    return _non_finite([float(v) for v in torch.aminmax(t)])


def _host_amax(t: Tensor) -> float:
    lo, hi = (float(v) for v in torch.aminmax(t.detach())) if t.numel() else (0.0, 0.0)
    return _amax([lo, hi])


def _to_host(tensors: list[Tensor]) -> list[float]:
    """0-dim tensors as Python floats: one stack and one transfer per device and dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out = [0.0] * len(tensors)
    for idx in groups.values():
        for i, v in zip(idx, torch.stack([tensors[i] for i in idx]).double().cpu().tolist()):
            out[i] = v
    return out


def _amax(values: list[float]) -> float | None:
    """Largest magnitude among mins and maxes (inf when one is NaN), ``None`` for no values."""
    return max((math.inf if math.isnan(v) else abs(v)) for v in values) if values else None


def _non_finite(values: list[float]) -> str | None:
    """'nan', 'inf' or '-inf' if any of these mins/maxes is non-finite (NaN first: it says most), else None."""
    if any(math.isnan(v) for v in values):
        return "nan"
    if any(v == math.inf for v in values):
        return "inf"
    if any(v == -math.inf for v in values):
        return "-inf"
    return None


__all__ = ["OverflowLocator", "OverflowReport"]
