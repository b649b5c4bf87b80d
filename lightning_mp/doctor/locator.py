"""Name the module where a step first went non-finite: its forward output, or else a gradient in the backward.

A skipped step says only *that* some gradient held inf/NaN; :class:`OverflowLocator` says *where*. A clean step
costs nothing while the forward checks are off (no hook, no read). On a skipped step the gradients the optimizer
reads are checked in one fused norm per (device, dtype), in backward order, and the first non-finite one is named;
with :attr:`~OverflowLocator.check_forward` on, every module's floating output is checked too and the first
non-finite forward output wins. A loss passed to :meth:`~OverflowLocator.note_loss` (kept by reference, read on a
skipped step only) that was already non-finite makes the report a forward one even with the forward checks off:
the backward only carried the inf to the gradients, so the first non-finite gradient is not where it started.
What is checked, the backward order, and what each check costs and where it syncs:
``docs/doctor.md``. Without a Trainer::

    locator = OverflowLocator(model)
    for batch in data:
        optimizer.zero_grad()
        locator.begin_step()
        loss = model(batch).float().mean()
        locator.note_loss(loss)  # optional: a non-finite loss is reported as a forward overflow
        (loss * scale).backward()
        if not all(p.grad.isfinite().all() for p in model.parameters()):  # your own skip test
            print(locator.report())  # "forward overflow in `mlp.1` (Scale): output went inf; largest input ..."
        else:
            optimizer.step()
    locator.remove()

The hooks and their bookkeeping; the end of a step (noted losses, located gradients, the report) is
:mod:`~lightning_mp.doctor.step_report`, the report itself :mod:`~lightning_mp.doctor.report`, the checks
:mod:`~lightning_mp.doctor.finite_checks`, the order :mod:`~lightning_mp.doctor.order`.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mp.doctor.finite_checks import _bare, _cpu_non_finite, _host_amax, _real_dense, _tensors
from lightning_mp.doctor.report import PHASES, OverflowReport, _Found, _Record
from lightning_mp.doctor.order import ModuleOrder
from lightning_mp.doctor.step_report import _StepReport
from lightning_mp.validation import check_bool

# Past this many device records (a loop that never calls begin_step; a GPT step makes a few hundred) recording stops.
_MAX_RECORDS = 200_000

# Devices whose checks are read at once (no asynchronous queue, so reading costs no sync). Everything else is
# checked with device-side aminmax and read back only by report(). Tests empty this to run the device path on CPU.
_EAGER_DEVICE_TYPES = frozenset({"cpu"})

_ORDER_VIEWS = ("_names", "_types", "_modules", "_rank")  # the locator's names for its ModuleOrder's lists


class OverflowLocator(_StepReport):
    """Names where a step went non-finite: forward outputs while :attr:`check_forward` is on, and, on a skipped
    step only, the gradients; :meth:`report` says which came first.

    Args:
        model: the module tree to watch (every submodule, the model itself included).
        input_grads: while the forward checks are on, also check the gradient each module's backward produces for
            its inputs (default; one more read of every activation gradient, names parameter-free modules).
        forward: check forward outputs from the start (default). ``False`` installs no hook until
            :attr:`check_forward` is set (the plugin sets it on the first skipped step).

    Per step: :meth:`begin_step` before the first forward; :meth:`note_loss` with each loss before its backward
    (optional); on a skipped step :meth:`locate_gradients` with the gradients the optimizer read (before they are
    dropped), then :meth:`report`. :meth:`remove` takes the hooks off.
    """

    def __init__(self, model: nn.Module, input_grads: bool = True, forward: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model={model!r} is not allowed: pass the torch.nn.Module to watch.")
        check_bool("input_grads", input_grads)
        check_bool("forward", forward)
        self.input_grads = input_grads
        self._model = model
        self._order = order = ModuleOrder(model)
        self._names, self._types, self._modules, self._rank = order.names, order.types, order.modules, order.rank
        self._handles: list[Any] = []
        # device checks, read only by report(): (seq, module index, phase index, tensor, [min, max], input stats)
        self._records: list[_Record] = []
        self._found: dict[int, _Found] = {}  # phase index -> first CPU culprit (CPU checks are read at once)
        self._calls: list[tuple[int, tuple, list[Tensor] | None]] = []  # in-flight forwards: (index, args, stats)
        self._known: dict[int, tuple[weakref.ref, int, list[Tensor] | None]] = {}  # id -> (ref, _version, stats)
        self._gradient: _Found | None = None  # the first non-finite parameter gradient of this step, if located
        self._gradient_key: tuple[int, ...] = ()  # its place in backward order (larger: earlier)
        self._located = False
        self._losses: list[Tensor] = []  # this step's losses, by reference: read by report() only
        self._outputs_checked = False  # whether a forward hook checked a module output in this step
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
        check_bool("check_forward", value)
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
        self._losses.clear()
        self._outputs_checked = False
        self._recording = True


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

    def __getstate__(self) -> dict[str, Any]:
        # the order's lists are shared, pickled once with it; the tensors seen in this step (weak references) are not
        return {k: v for k, v in self.__dict__.items() if k not in _ORDER_VIEWS} | {"_known": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        order = self._order
        self._names, self._types, self._modules, self._rank = order.names, order.types, order.modules, order.rank

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ hooks
    # the hooks are partials of methods, not closures: a model pickled with them on (torch.save, ddp_spawn) pickles
    def _pre_hook(self, index: int) -> Any:
        return functools.partial(self._forward_pre, index)

    def _post_hook(self, index: int) -> Any:
        return functools.partial(self._forward_post, index)

    def _forward_pre(self, index: int, module: nn.Module, args: tuple) -> tuple | None:
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

    def _forward_post(self, index: int, module: nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_compiling() or not self._calls or self._calls[-1][0] != index:
            return  # no matching pre-hook: grad disabled, not recording, or the forward raised in a child
        _, inputs, input_stats = self._calls.pop()
        self._outputs_checked = True
        with _bare():
            checked = [self._check_output(index, t, inputs, input_stats) for t in _tensors(output)]
        if input_stats and not any(checked) and self._room():
            # nothing new to check, but its inputs' numbers may be needed to tell where an overflow came from
            self._records.append((self._next_seq(), index, 0, "output", [], input_stats))

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
                    name, kind = self._names[caller], self._types[caller]
                    report = OverflowReport("forward", name, kind, "own code", value, caller_amax)
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

