"""The overflow flag left on the device: which optimizers skip there, the next step's scale picked there, and the
flag's copy that the host reads one step late.

Deciding skip-or-step on the host makes the host wait for the backward pass before it queues the optimizer step (on
CUDA, the queue drains once per step; Lightning's ``bf16-mixed`` checks nothing and queues ahead). torch's fused
optimizers (``Adam``, ``AdamW``, ``SGD`` and ``Adagrad`` with ``fused=True``) take the flag as a tensor, by torch
``GradScaler``'s protocol (``optimizer.found_inf``), and skip on the device: their kernel returns before it writes a
parameter or a state when the flag is exactly 1.0, and the step counters they advanced are taken back. With them a
clean step reads nothing on the host:

* the flag stays on the device (under DDP the ranks still agree on it: an all-reduce, no read);
* the optimizer skips on the device, bit for bit what a skipped step leaves on the host path (parameters and state
  untouched, the skipped step's gradients in ``.grad`` until the loop's ``zero_grad``);
* the next step's loss scale is picked on the device (``torch.where`` between the two values the host's state machine
  would move to, :meth:`~lightning_mp.numerics.loss_scaler.LossScaler.branches`): the same scale at every step;
* the flag is copied to the host without blocking (pinned memory and an event on CUDA; on the CPU the flag is a host
  tensor already), and the host reads that copy one step late, at the end of the next training step: the skip count,
  the skip's log line, the stop at ``max_consecutive_skips`` or ``min_scale`` come then. The read waits only while the
  device is more than a step behind the host.

An optimizer takes this path once it has stepped on the host path (its first clean step creates its state, so a
skipped first step leaves none, as on the host path: fused SGD would otherwise keep uninitialised momentum). Plain
and ``foreach`` optimizers, lean bf16's bucketed step and a closure re-evaluated inside ``step`` read the flag on the
host before the step: one device->host sync per training step.

When the host reads, with a fused optimizer: before an optimizer's first clean step (a sync); each step's flag from
its copy at the end of the next training step (:meth:`Deferral.settle`); and the flag of the last step when something
asks before that: the plugin's ``loss_scale``, ``skipped_steps``, ``last_step_skipped``, ``last_step_scale``,
``scaler`` and ``describe()``, a checkpoint's state, a monitor at its logging steps, a scheduler held on skipped
steps at its ``step()`` (every step: after the optimizer step is queued). ``step.skipping`` and ``step.unscale_``
read at once (a sync). ``docs/behaviour.md`` has the table and what a skip on the device leaves differently.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mp.numerics.loss_scaler import LossScaler


class Deferral:
    """One step object's flags left on the device: which optimizers may, and the last training step's flag until the
    host reads it (:meth:`settle`)."""

    def __init__(self) -> None:
        self.enabled = True  # off: the host reads every step's flag before the optimizer step
        self.pending: LateFlag | None = None
        self.stepped: weakref.WeakSet = weakref.WeakSet()  # optimizers that stepped on the host path: state exists
        self._scale = DeviceScale()

    def allows(self, optimizer: Optimizer) -> bool:
        return self.enabled and fused_amp_step(optimizer) and optimizer in self.stepped

    def stepped_(self, optimizer: Optimizer) -> None:
        """``optimizer`` stepped on a flag the host read: its state exists, and a fused one may skip on the device."""
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            self.stepped.add(optimizer)

    def defer(self, scaler: LossScaler, flag: Tensor, step: int | None) -> None:
        """The training step that ends left ``flag`` on the device: the next scale is picked there, the flag copied."""
        self._scale.pick_(scaler, flag)
        self.pending = LateFlag(flag, step)

    def settle(self, scaler: LossScaler, on_skip: Callable[[int | None], None] | None, stop: bool = True) -> None:
        """Move ``scaler`` by the pending flag, if any (the deferred read); ``on_skip(step)`` first on a skip.
        ``stop=False``: a ``FloatingPointError`` the scaler raises is dropped (the run it would stop is over)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        found = pending.read()
        if found and on_skip is not None:
            on_skip(pending.step)
        try:
            scaler.update(found, step=pending.step)
        except FloatingPointError:
            if stop:
                raise

    def __getstate__(self) -> dict:  # pickled without what a process cannot send (weak references, events)
        return {"enabled": self.enabled}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
        self.enabled = state["enabled"]


def fused_amp_step(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step()`` takes ``found_inf`` as a tensor: torch's fused optimizers, every group fused."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        group.get("fused") for group in optimizer.param_groups
    )


class DeviceScale:
    """Picks the next step's ``[scale, 1/scale]`` on the device from the flag (a dynamic scale only: others never move).

    The two branches are FP32 roundings of the host's numbers, as ``loss * scale`` and the unscale's ``1/scale`` are on
    the host path; they are sent to the device again only when they change (a growth or a backoff on the host)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._branches: Tensor | None = None

    def pick_(self, scaler: LossScaler, found_inf: Tensor) -> None:
        if not scaler.dynamic:
            return
        clean, overflow = scaler.branches()
        key = (found_inf.device, clean, overflow)
        if key != self._key or self._branches is None:
            values = torch.tensor([[clean, 1.0 / clean], [overflow, 1.0 / overflow]], dtype=torch.float32)
            if found_inf.device.type == "cuda":  # pinned: the copy queues without waiting for the device
                values = values.pin_memory()
            self._branches, self._key = values.to(found_inf.device, non_blocking=True), key
        scaler.device_next = torch.where(found_inf > 0, self._branches[1], self._branches[0])


class LateFlag:
    """A training step's flag on its way to the host, read one step later by :meth:`read`."""

    __slots__ = ("copy", "event", "step")

    def __init__(self, flag: Tensor, step: int | None) -> None:
        self.step = step
        self.event = None
        if flag.device.type == "cuda":
            self.copy = torch.empty((), dtype=flag.dtype, pin_memory=True)
            self.copy.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:  # on the host already (the CPU): the copy is the flag; another device: a blocking copy
            self.copy = flag if flag.device.type == "cpu" else flag.to("cpu")

    def read(self) -> bool:
        """The flag on the host: the deferred read. On CUDA it waits for the copy queued a training step ago, so only
        while the device is more than a step behind the host."""
        if self.event is not None:
            self.event.synchronize()
        return bool(self.copy.item())
