"""A training progress bar that counts a ``max_steps`` run to its end.

A Trainer given ``max_steps`` and no ``max_epochs`` runs with ``max_epochs=-1`` (no epoch limit). Lightning's
default bar where ``rich`` is installed, ``RichProgressBar``, titles its training bar ``Epoch {epoch}/{max_epochs - 1}``:
"Epoch 0/-2"; and both of Lightning's bars count to the end of the epoch, which such a run may stop long before (the
main job: 800 steps of a 1,844-batch epoch, a bar left at 800/1844). :class:`StepProgressBar` is Lightning's
``TQDMProgressBar`` with the epoch's total cut to the batches the run will take in it.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from typing_extensions import override


def batches_this_epoch(trainer: L.Trainer, epoch_batches: float) -> float:
    """The training batches the run will take in the epoch starting now: the epoch's own (``inf`` for an iterable
    without a length), cut to what ``max_steps`` leaves (``accumulate_grad_batches`` batches per optimizer step)."""
    if trainer.max_steps is None or trainer.max_steps < 0:
        return epoch_batches
    left = max(trainer.max_steps - trainer.global_step, 0) * trainer.accumulate_grad_batches
    return min(epoch_batches, left)


def epoch_title(trainer: L.Trainer) -> str:
    """``Epoch 3/9`` when ``max_epochs`` bounds the run, ``Epoch 3`` when it does not (``None`` or ``-1``)."""
    title = f"Epoch {trainer.current_epoch}"
    if trainer.max_epochs is not None and trainer.max_epochs > 0:
        title += f"/{trainer.max_epochs - 1}"
    return title


class StepProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar; its training total is :func:`batches_this_epoch` and its title :func:`epoch_title`."""

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        total = batches_this_epoch(trainer, self.total_train_batches)
        self.train_progress_bar.total = None if math.isinf(total) else int(total)  # tqdm: None = no total
        self.train_progress_bar.set_description(epoch_title(trainer))


def progress_bar_callbacks(callbacks: list[Any], enable_progress_bar: Any) -> list[Any]:
    """``callbacks`` plus a :class:`StepProgressBar`, unless the bar is off or the list already has a bar (either
    would make Lightning raise at ``Trainer(...)``)."""
    if enable_progress_bar is False or any(isinstance(c, ProgressBar) for c in callbacks):
        return list(callbacks)
    return [*callbacks, StepProgressBar()]
