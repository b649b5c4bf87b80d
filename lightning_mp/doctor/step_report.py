"""The end of a located step, :class:`~lightning_mp.doctor.locator.OverflowLocator`'s other half: the losses noted
before their backward, the first non-finite parameter gradient in backward order, and the report that says which came
first. A loss that was already non-finite makes the report a forward one even with the forward checks off: the
backward only carried the inf to the gradients, so the first non-finite gradient is not where it started. Nothing
here runs on a clean step but :meth:`~_StepReport.note_loss`, which keeps a reference and reads nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

from lightning_mp.doctor.finite_checks import _bare, _first_non_finite, _real_dense
from lightning_mp.doctor.order import ModuleOrder
from lightning_mp.doctor.report import OverflowReport, _first_report, _Found, _Record
from lightning_mp.numerics.sharding import local

# Losses kept per step (several backward calls: manual optimization, accumulation); a loop that never calls
# begin_step keeps the first ones only.
_MAX_LOSSES = 64


class _StepReport:
    """:meth:`note_loss`, :meth:`locate_gradients` and :meth:`report` of :class:`OverflowLocator`, on the state its
    hooks keep (set in its ``__init__`` and cleared by its ``begin_step``)."""

    _model: nn.Module
    _order: ModuleOrder
    _names: list[str]
    _types: list[str]
    _records: list[_Record]
    _found: dict[int, _Found]
    _gradient: _Found | None
    _gradient_key: tuple[int, ...]
    _located: bool
    _losses: list[Tensor]
    _outputs_checked: bool
    _removed: bool

    def note_loss(self, loss: Tensor) -> None:
        """Remember this loss (before its backward) for :meth:`report`: a reference, nothing read, so free on a
        clean step. If it was non-finite on a skipped step, the forward went non-finite before the backward began,
        and the report says so instead of naming the first gradient the inf reached."""
        if isinstance(loss, Tensor) and len(self._losses) < _MAX_LOSSES and not self._removed:
            self._losses.append(loss)

    def locate_gradients(self, named_grads: Iterable[tuple[str, Tensor | None]] | None = None) -> OverflowReport | None:
        """Find the first parameter, in backward order, whose gradient holds an inf/NaN; keep it for :meth:`report`.

        ``named_grads``: (name as ``model.named_parameters()`` gives it, gradient) pairs, the FP32 gradients the
        optimizer reads; ``None`` reads the watched parameters' ``.grad``. Several calls in one step (one per
        optimizer) keep the earliest in the backward. Cost, on a skipped step only: one fused norm per (device,
        dtype), one read back (a host sync), and an ``aminmax`` of the tensor it names."""
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
                    candidates.append((self._order.backward_key(name), name, grad))
        candidates.sort(key=lambda c: c[0], reverse=True)  # backward order: the last module to run goes first
        with _bare():
            found = _first_non_finite([grad for _, _, grad in candidates])
        if found is None:
            return None
        key, name, _ = candidates[found[0]]
        index, pname = self._order.where(name)
        module, module_type = self._order.module_name(index, name), self._order.module_type(index, name)
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

        def loss() -> OverflowReport | None:
            value = self._non_finite_loss()
            if value is None:
                return None
            if self._outputs_checked:
                return OverflowReport("forward", None, None, "loss", value)
            found = parameters()
            reached = found.report if found is not None else None
            return OverflowReport("forward", None, None, "loss", value, forward_checked=False, reached=reached)

        return _first_report(
            self._records, self._found, self._names, self._types, parameters, self._order.forward_key, loss
        )

    def _non_finite_loss(self) -> str | None:
        """'inf' / '-inf' / 'nan' if a loss noted in this step held one: one fused norm, one read back (a host
        sync, on a skipped step only)."""
        with _bare():
            losses = [_real_dense(t.detach()) for t in self._losses if t.is_floating_point() or t.is_complex()]
            found = _first_non_finite([t for t in losses if t.numel()])
        return found[1] if found is not None else None
