"""Name the module where a step first went non-finite: its forward output, or else a gradient in the backward.

A skipped step says only *that* some gradient held inf/NaN. :class:`OverflowLocator` says *where*: the first module
(in execution order) whose forward output went non-finite, or, when the whole forward was finite, the first
parameter in backward order whose gradient did. Without a Trainer::

    locator = OverflowLocator(model)
    for batch in data:
        optimizer.zero_grad()
        locator.begin_step()
        loss = model(batch).float().mean()
        (loss * scale).backward()
        if not all(p.grad.isfinite().all() for p in model.parameters()):  # your own skip test
            print(locator.report())  # "forward overflow in `mlp.1` (Scale): output went inf; largest input ..."
        else:
            optimizer.step()
    locator.remove()

What is checked, and when
-------------------------
* forward, while :attr:`~OverflowLocator.check_forward` is on: every floating tensor a module returns (a tensor, or
  one level of tuple / list / dict). A tensor already checked in this step (a container returning its last child's
  output) is matched by identity and ``_version`` and not read again, so each activation is read once. With
  ``forward=False`` no hook is installed until ``check_forward`` is set (the plugin sets it on the first skipped
  step: bf16 and fp32 steps rarely go non-finite, and one that did usually does again).
* gradients, on a skipped step only (:meth:`~OverflowLocator.locate_gradients`, or :meth:`~OverflowLocator.report`
  reading ``.grad``): the gradients the optimizer reads, after the backward, in one fused norm per (device, dtype).
  That is where FP16 backward overflow starts in practice: a Linear's weight gradient sums over every row of the
  batch, while each activation gradient is one row's share. The first non-finite one in backward order is named:
  the reverse of the modules' forward execution order, which the forward hooks record for free while they are on,
  else the reverse of registration order (``named_modules()``), which is the execution order of ``nn.Sequential``,
  ``ModuleList`` stacks and transformer blocks; a model that registers out of order is misordered only until the
  forward hooks have seen one forward. Within a module, parameters in reverse registration order.
* input gradients, with ``input_grads=True`` (the locator's default; the plugin passes ``False``, ~1.5% of step time
  saved on the demo GPT) while the forward checks are on: the gradient each module's backward produces for its
  floating inputs (the pre-hook hands the module a ``view_as`` of each input, no copy, with a hook on it), which
  names parameter-free modules (an activation, an attention core) whose backward overflows; it costs one more read
  of every activation gradient, and modules see a view instead of the tensor their caller passed (the same view
  for the same tensor, so ``query is key`` checks still hold). The module that ran later in the forward wins
  between an input gradient and a parameter gradient.
* forwards without autograd (validation, ``torch.no_grad``) are not checked.

What it costs, and where it syncs
---------------------------------
A clean step with the forward checks off costs nothing: no hook, no read (the per-parameter gradient hooks this
replaced cost 6-9% of a step of a 2x64 demo GPT on one AVX512 core; the forward checks, once armed, cost 9-13%
there). The gradients are read only on a skipped step (one transfer back, a host sync, after the skip-or-step
sync). Forward checks on CUDA (and any non-CPU
device) are one ``aminmax`` per output (NaN propagates through min and max, so one pass finds inf, -inf and NaN and
gives the largest magnitude), kept on the device as 0-dim tensors: nothing is read back on a clean step. Only
:meth:`~OverflowLocator.report` reads them, in one transfer per device. On the CPU there is nothing to sync, so the
check is a plain ``sum`` (half the work of ``aminmax`` there), read at once; a non-finite sum is confirmed with an
``aminmax`` (an FP16 row sum can overflow where no element does) and the first one found is kept with its input's
magnitude. The checks run with autocast, torch-function and Python dispatch modes off, so neither autocast, the FP32
op policy nor GEMM emulation upcasts or slows them. Module inputs are read from positional arguments only.

This module is the hooks and their bookkeeping; :mod:`lightning_mp.overflow_report` is the report and how the
device checks are read back, :mod:`lightning_mp.finite_checks` the checks themselves.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mp.finite_checks import _bare, _cpu_non_finite, _first_non_finite, _host_amax, _real_dense, _tensors
from lightning_mp.overflow_report import PHASES, OverflowReport, _first_report, _Found, _Record
from lightning_mp.sharding import local

# A step that never calls begin_step (a forgotten call in a custom loop) must not grow without bound: past this many
# device records the locator stops recording until the next begin_step. A GPT step makes a few hundred.
_MAX_RECORDS = 200_000

# Devices whose checks are read at once (no asynchronous queue, so reading costs no sync). Everything else is
# checked with device-side aminmax and read back only by report(). Tests empty this to run the device path on CPU.
_EAGER_DEVICE_TYPES = frozenset({"cpu"})


class OverflowLocator:
    """Names where a step went non-finite: forward outputs while :attr:`check_forward` is on, and, on a skipped
    step only, the gradients; :meth:`report` says which came first.

    Args:
        model: the module tree to watch (every submodule, the model itself included).
        input_grads: while the forward checks are on, also check the gradient each module's backward produces for
            its inputs (default; see the module docstring: one more read of every activation gradient). ``False``
            checks parameter gradients only: a parameter-free module whose backward overflows is then named by the
            nearest parameter before it.
        forward: check forward outputs from the start (default). ``False`` installs no hook at all: a clean step
            costs nothing; set :attr:`check_forward` (the plugin does, on the first skipped step) to turn them on.

    Call :meth:`begin_step` at the start of every training step (before the first forward; under gradient
    accumulation, once per optimizer step). On a step whose gradients were non-finite, call
    :meth:`locate_gradients` with the gradients the optimizer read, before they are dropped, then :meth:`report`;
    a standalone loop whose ``.grad`` is still there can call :meth:`report` alone. :meth:`remove` takes the hooks
    off.
    """

    def __init__(self, model: nn.Module, input_grads: bool = True, forward: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model={model!r} is not allowed: pass the torch.nn.Module to watch.")
        for name, value in (("input_grads", input_grads), ("forward", forward)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is not allowed: use True or False.")
        self.input_grads = input_grads
        self._model = model
        self._names: list[str] = []
        self._types: list[str] = []
        self._modules: list[weakref.ref] = []
        self._handles: list[Any] = []
        # qualified parameter name -> (module index, parameter name, position in registration order)
        self._params: dict[str, tuple[int, str, int]] = {}
        for index, (name, module) in enumerate(model.named_modules()):
            self._names.append(name)
            self._types.append(type(module).__name__)
            self._modules.append(weakref.ref(module))
            for pname, _ in module.named_parameters(recurse=False):
                self._params.setdefault(f"{name}.{pname}" if name else pname, (index, pname, len(self._params)))
        self._rank: dict[int, int] = {}  # module index -> position in forward execution order (while hooked)
        # device checks, read only by report(): (seq, module index, phase index, tensor, [min, max], input stats)
        self._records: list[_Record] = []
        self._found: dict[int, _Found] = {}  # phase index -> first CPU culprit (CPU checks are read at once)
        self._calls: list[tuple[int, tuple, list[Tensor] | None]] = []  # in-flight forwards: (index, args, stats)
        self._known: dict[int, tuple[weakref.ref, int, list[Tensor] | None]] = {}  # id -> (ref, _version, stats)
        self._gradient: _Found | None = None  # the first non-finite parameter gradient of this step, if located
        self._gradient_key: tuple[int, ...] = ()  # its place in backward order (larger: earlier)
        self._located = False
        self._seq = 0
        self._recording = True
        self._removed = False
        self._forward = False
        self.check_forward = forward

    # ------------------------------------------------------------------ API
    @property
    def check_forward(self) -> bool:
        """Whether forward outputs are checked. Setting it installs or removes the forward hooks (between steps; a
        removed locator installs nothing)."""
        return self._forward

    @check_forward.setter
    def check_forward(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"check_forward={value!r} is not allowed: use True or False.")
        if value and not self._forward and not self._removed:
            for index, ref in enumerate(self._modules):
                module = ref()
                if module is not None:
                    self._handles.append(module.register_forward_pre_hook(self._pre_hook(index)))
                    self._handles.append(module.register_forward_hook(self._post_hook(index), always_call=True))
        elif not value:
            self._remove_hooks()
        self._forward = value

    def begin_step(self) -> None:
        """Forget the previous step's checks (device tensors only: nothing to sync)."""
        self._records.clear()
        self._found.clear()
        self._calls.clear()
        self._known.clear()
        self._gradient = None
        self._gradient_key: tuple[int, ...] = ()
        self._located = False
        self._recording = True

    def locate_gradients(self, named_grads: Iterable[tuple[str, Tensor | None]] | None = None) -> OverflowReport | None:
        """Find the first parameter, in backward order, whose gradient holds an inf/NaN, and keep it for
        :meth:`report`; return it.

        ``named_grads``: (qualified parameter name as ``model.named_parameters()`` gives it, gradient) pairs, the
        FP32 gradients the optimizer reads (the plugin's ``named_grads(optimizer)``); ``None`` reads the watched
        parameters' ``.grad``. Called once per optimizer on a skipped step, it keeps the earliest in the backward
        of all calls since :meth:`begin_step`. Cost, on that step only: one fused norm per (device, dtype) over the
        gradients and one read back (a host sync), and an ``aminmax`` of the tensor it names.
        """
        if self._removed:
            return None
        self._located = True
        if named_grads is None:
            named_grads = ((n, p.grad) for n, p in self._model.named_parameters())
        candidates = []
        for name, grad in named_grads:
            if grad is not None:
                grad = _real_dense(local(grad))
                if grad.numel():
                    candidates.append((self._backward_key(name), name, grad))
        candidates.sort(key=lambda c: c[0], reverse=True)  # backward order: the last module to run goes first
        with _bare():
            found = _first_non_finite([grad for _, _, grad in candidates])
        if found is None:
            return None
        key, name, _ = candidates[found[0]]
        index, pname = self._where(name)
        module, module_type = self._module_name(index, name), self._module_type(index, name)
        report = OverflowReport("backward", module, module_type, f"gradient of {pname}", found[1])
        if self._gradient is None or key > self._gradient_key:
            self._gradient, self._gradient_key = _Found(0, report, index), key
        return self._gradient.report

    def report(self) -> OverflowReport | None:
        """The first non-finite forward output of this step, else its first non-finite gradient, else ``None``.

        Reads the device checks back in one transfer per device (a host sync): call it when a step was skipped.
        Without a :meth:`locate_gradients` call in this step, it reads the watched parameters' ``.grad`` itself
        when no forward output was non-finite.
        """
        if self._removed:
            return None

        def parameters() -> _Found | None:
            if not self._located:
                self.locate_gradients()
            return self._gradient

        return _first_report(self._records, self._found, self._names, self._types, parameters, self._forward_key)

    def remove(self) -> None:
        """Take every hook off the model; the locator checks and reports nothing afterwards (:attr:`check_forward`
        keeps its value: whether the checks had been armed)."""
        self._remove_hooks()
        self._removed = True
        self.begin_step()

    @property
    def module_names(self) -> list[str]:
        """Qualified names of the watched modules, in ``named_modules()`` order."""
        return list(self._names)

    # ------------------------------------------------------------------ backward order
    def _forward_key(self, index: int) -> tuple[int, int]:
        """Where module ``index`` ran in the forward: its execution position once the forward hooks have seen a
        forward (modules they never saw first), else its registration position (see the module docstring)."""
        if index < 0:
            return (-2, index)
        return (self._rank.get(index, -1), index) if self._rank else (index, index)

    def _backward_key(self, name: str) -> tuple[int, int, int]:
        index, _, position = self._params.get(name, (-1, name, -1))
        return (*self._forward_key(index), position)

    def _where(self, name: str) -> tuple[int, str]:
        index, pname, _ = self._params.get(name, (-1, name.rpartition(".")[2], -1))
        return index, pname

    def _module_name(self, index: int, name: str) -> str:
        return self._names[index] if index >= 0 else name.rpartition(".")[0]

    def _module_type(self, index: int, name: str) -> str:
        if index >= 0:
            return self._types[index]
        try:  # a parameter registered after the locator was made
            return type(self._model.get_submodule(name.rpartition(".")[0])).__name__
        except AttributeError:
            return "?"

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ hooks
    def _pre_hook(self, index: int):
        def hook(module: nn.Module, args: tuple) -> tuple | None:
            # inside a torch.compile'd region the hooks step aside (Dynamo would trace the bookkeeping): compiled
            # modules are located by the eager modules around them and by their parameters' gradients
            if torch.compiler.is_compiling():
                return None
            if index not in self._rank:
                self._rank[index] = len(self._rank)  # forward execution order, for the backward order of gradients
            if not (torch.is_grad_enabled() and self._recording):
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
                        self._found[1] = _Found(self._next_seq(), report, index)
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
        self._found[0] = _Found(self._next_seq(), report, index)
        return True

    def _device_stats(self, t: Tensor) -> list[Tensor]:
        """[min, max] of a device tensor, reusing the numbers of a tensor already reduced in this step."""
        entry = self._known.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version and entry[2] is not None:
            return entry[2]
        stats = list(torch.aminmax(t.detach()))
        self._known[id(t)] = (weakref.ref(t), t._version, stats)
        return stats

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _room(self) -> bool:
        if len(self._records) >= _MAX_RECORDS:
            self._recording = False  # begin_step is not being called; stop rather than grow
        return self._recording


__all__ = ["OverflowLocator", "OverflowReport", "PHASES"]  # the last two live in overflow_report
