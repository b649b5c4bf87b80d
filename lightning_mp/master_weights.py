"""FP32 master weights: the model's own parameters are the FP32 masters; forward and backward run on 16-bit copies.

Why masters: an update smaller than half a 16-bit ulp of the weight rounds away. At a weight of 1.0 that is
anything below 2^-8 in bf16 or 2^-11 in fp16, so ``lr * grad`` of 1e-4 never moves a bf16 weight. The optimizer
must update FP32 values, and gradients of several micro-batches must be summed in FP32.

The shape chosen here: between steps every parameter *is* its FP32 master (``p.data`` is FP32), so everything
Lightning and user code do outside the forward/backward sees and changes the exact values: the optimizer and its
state (created from FP32 parameters, whatever the optimizer does in its constructor), ``state_dict`` and
checkpoints, ``toggle_optimizer``, ``BaseFinetuning`` and ``add_param_group``, parameters unfrozen mid-fit, weight
averaging (EMA, SWA), pruning, ``load_state_dict`` mid-fit, clipping, ``grad_norm``. Only for the forward and
backward of a step does :meth:`swap_in` give each parameter a 16-bit copy (rounded to nearest from its current
FP32 value); :meth:`swap_out` gives the FP32 value back and folds the 16-bit gradient into the FP32 ``.grad``.

Memory per converted parameter at rest: 4 B (FP32 parameter) + 4 B (FP32 gradient) + optimizer state, as in FP32
training. During forward and backward: +2 B for the 16-bit copy (one flat buffer, freed at swap-out) and the
16-bit gradients autograd produces until they are folded: the same transient that autocast's weight cache and
its gradients cost Lightning's ``*-mixed`` plugins. Cost per swap-in: one fused cast-copy of the converted
parameters (as autocast casts every weight once per forward), plus a host-side loop that sets ``.data``.

Writes are never lost: :meth:`swap_in` reads each parameter's *current* ``.data`` (so a ``p.data = ...``
reassignment, as ``torch.nn.utils.prune.remove`` does, is taken as the new master), and a write to a
parameter during the 16-bit period (its version counter moved, or its ``.data`` was replaced) is taken into the
master at swap-out instead of being discarded.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from lightning_mp.formats import HALF_DTYPES


class MasterWeights:
    """Swaps 16-bit working copies in and out of a module's parameters.

    Args:
        dtype: the 16-bit compute format of the working copies.
        keep_fp32: ``keep_fp32(module)`` is true for modules whose own parameters stay FP32 (norm layers...).
    """

    def __init__(self, dtype: torch.dtype, keep_fp32=lambda module: False) -> None:
        self.dtype = dtype
        self._keep_fp32 = keep_fp32
        self.params: list[nn.Parameter] = []  # converted parameters: FP32 at rest, 16-bit while swapped in
        self._pending_lazy: list[nn.Parameter] = []  # uninitialized parameters, adopted once materialized
        self._known: set[nn.Parameter] = set()
        # while swapped in: per converted param, its FP32 value, its FP32 gradient (or None), and the identity and
        # version of its 16-bit copy (to notice writes during the forward/backward)
        self._fp32: list[Tensor] | None = None
        self._fp32_index: dict[int, Tensor] | None = None
        self._fp32_grads: list[Tensor | None] = []
        self._marks: list[tuple[int, int]] = []
        # parameters whose FP32 gradients an optimizer step has consumed (applied or skipped): dropped at the next
        # swap-in, since the zero_grad that follows (Lightning's, after the forward; the user's, anywhere in
        # training_step) finds only the 16-bit gradient slot while the copies are swapped in
        self._consumed: set[nn.Parameter] = set()

    @property
    def swapped_in(self) -> bool:
        return self._fp32 is not None

    # ------------------------------------------------------------------ set-up
    @torch.no_grad()
    def convert(self, module: nn.Module) -> nn.Module:
        """Choose the parameters that compute in 16 bits; a parameter already in 16 bits gets an FP32 master
        from its value (the bits already lost stay lost), with one warning."""
        # a parameter shared with a kept module (a tied embedding and output head) stays FP32 everywhere;
        # parametrized parameters (spectral_norm...) stay FP32 too: the parametrization computes with FP32
        # buffers, and autocast rounds its result where a matmul uses it
        kept = {p for mod in module.modules() if self._keep_fp32(mod) for p in mod.parameters(recurse=False)}
        kept |= {
            p
            for mod in module.modules()
            if isinstance(mod, nn.utils.parametrize.ParametrizationList)
            for p in mod.parameters(recurse=False)
        }
        pre_cast = []
        for p in module.parameters():
            if p in self._known or p in kept:
                continue
            if is_lazy(p):
                self._pending_lazy.append(p)
                continue
            if not p.is_floating_point():
                continue
            if p.dtype in HALF_DTYPES:
                pre_cast.append(p.dtype)
                p.data = p.data.float()
            elif p.dtype != torch.float32:
                continue  # float64 parameters are the user's explicit choice
            self.params.append(p)
            self._known.add(p)
        if pre_cast:
            warnings.warn(
                f"{len(pre_cast)} parameters were already in {pre_cast[0]} before fit: their FP32 masters "
                "start from the 16-bit values, so the bits lost in that cast stay lost. HINT: build or load the "
                "model in FP32 and let MixedPrecisionPlugin make the 16-bit copies; the model is FP32 after fit.",
                stacklevel=2,
            )
        return module

    def _adopt_materialized(self) -> None:
        ready = [p for p in self._pending_lazy if not is_lazy(p)]
        if ready:
            self._pending_lazy = [p for p in self._pending_lazy if is_lazy(p)]
            for p in ready:
                if p.is_floating_point() and p.dtype == torch.float32 and p not in self._known:
                    self.params.append(p)
                    self._known.add(p)

    # ------------------------------------------------------------------ per step
    @torch.no_grad()
    def swap_in(self) -> None:
        """Give every converted parameter a 16-bit copy of its current FP32 value (idempotent)."""
        if self._fp32 is not None:
            return
        if self._pending_lazy:
            self._adopt_materialized()
        params = self.params
        if not params:
            return
        fp32 = [p.data for p in params]
        consumed, self._consumed = self._consumed, set()
        self._fp32_grads = [None if p in consumed else p.grad for p in params]
        copies = _flat_copies(fp32, self.dtype)
        torch._foreach_copy_(copies, fp32)  # round to nearest, one fused pass
        marks = []
        for p, c in zip(params, copies):
            p.grad = None
            p.data = c
            marks.append((c.data_ptr(), p._version))
        self._marks = marks
        self._fp32 = fp32

    @torch.no_grad()
    def swap_out(self) -> None:
        """Give the FP32 values back and fold 16-bit gradients into the FP32 ``.grad`` (idempotent).

        A parameter without an FP32 gradient gets one from one flat FP32 buffer filled by a fused cast-copy; one
        with an FP32 gradient from an earlier micro-batch of the window takes a fused mixed-dtype add, so
        accumulation sums in FP32 (bf16 keeps only 8 significant bits).
        """
        fp32 = self._fp32
        if fp32 is None:
            return
        fresh_p, fresh_g, acc, acc_g = [], [], [], []
        written = []
        for p, master, grad, (ptr, version) in zip(self.params, fp32, self._fp32_grads, self._marks):
            g16 = p.grad
            if p.data_ptr() != ptr or p._version != version:
                written.append((master, p.data))  # written during the forward/backward: keep that write
            p.data = master
            if g16 is None:
                p.grad = grad
            elif grad is None:
                fresh_p.append(p)
                fresh_g.append(g16)
            else:
                acc.append(grad)
                acc_g.append(g16)
                p.grad = grad
        self._fp32, self._fp32_grads, self._marks, self._fp32_index = None, [], [], None
        for master, value in written:
            if master.data_ptr() != value.data_ptr():
                master.copy_(value)
        if acc:
            torch._foreach_add_(acc, acc_g)
        if fresh_g:
            buffers = _flat_copies(fresh_g, torch.float32)
            torch._foreach_copy_(buffers, fresh_g)
            for p, b in zip(fresh_p, buffers):
                p.grad = b

    def mark_consumed(self, params: Iterable[nn.Parameter]) -> None:
        """An optimizer step read these parameters' gradients: the next swap-in starts a new window for them."""
        self._consumed.update(params)

    # ------------------------------------------------------------------ access and teardown
    def fp32_value(self, param: nn.Parameter) -> Tensor:
        """The FP32 value of a parameter, also while the 16-bit copies are swapped in."""
        if self._fp32 is None:
            return param.detach()
        if self._fp32_index is None:  # built on first use per swap-in, so a walk over all parameters stays O(n)
            self._fp32_index = {id(p): master for p, master in zip(self.params, self._fp32)}
        return self._fp32_index.get(id(param), param.detach())

    def release(self) -> None:
        """Teardown: the model is already FP32 between steps; a run that stopped mid-step gets its values back."""
        self.swap_out()
        self.params, self._pending_lazy = [], []
        self._known.clear()
        self._consumed.clear()


def _flat_copies(tensors: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """Uninitialized tensors shaped like ``tensors`` in ``dtype``, views of one buffer per device (one allocation)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for device, idx in by_device.items():
        sizes = [tensors[i].numel() for i in idx]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        for i, view in zip(idx, flat.split(sizes)):
            out[i] = view.view(tensors[i].shape)
    return out
