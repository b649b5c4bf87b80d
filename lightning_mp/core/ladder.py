"""The precision ladder over a run: ``MixedPrecisionPlugin("fp8", schedule={0.9: "bf16"})``.

Why a plugin argument, not a callback: the format of each step is a property of the precision, as the format of
the run is; one argument goes where the plugin goes (code, ``--trainer.plugins`` on the command line, a config
file), works the same under the Trainer and Fabric (which has no callbacks), and is checked when the plugin is made,
not at step 90 000.

``schedule`` maps *when* to *what*:

* when: an ``int`` optimizer step (the first step computed in the new setting; Lightning's ``global_step``, or the
  Fabric plugin's count of ``optimizer.step()`` calls, skipped steps included), or a ``float`` in (0, 1), a
  fraction of the Trainer's ``max_steps`` (``estimated_stepping_batches`` when it has none), rounded to a step.
* what: a precision (``"bf16"``), or a dict of the plugin's arguments that change from then on
  (``{"master_weights": True}``, ``{"precision": "bf16", "loss_scale": "dynamic"}``). Each rung is the plugin's
  arguments with its entry applied; arguments the new precision cannot take and the entry does not name fall back
  to their defaults (FP8's knobs outside ``"fp8"``, ``master_weights="compensated"`` and its two knobs outside bf16).
  ``loss_scale="auto"`` is resolved per rung: the scale retires at fp16 -> bf16 and is born (at ``init_scale``) at
  bf16 -> fp16.

A switch runs between two optimizer steps (:func:`switch`): the old rung's fit state comes off the model, which
is then the plain FP32 model it always is between steps (the Parameters hold the FP32 masters: lean bf16's are
rebuilt bit for bit, FP8's forwards go, the 16-bit copies are freed) and the new rung's goes on, replaying the
calls the front end made (``convert``, ``connect``, ``data_parallel``, ``guard_schedulers``). The optimizers,
their state (bf16 moments of lean bf16 become FP32, exactly) and the schedulers are the user's and stay. The
step counters carry over; the scale carries over only from a dynamic scaler to a dynamic one.

Every rank switches at the same step: the step counts are the same on every rank (a skip is agreed), so the
schedule needs no collective. Cost: a switch costs what the set-up of a fit costs (a few ms, plus a recompile of a
compiled model); a step without a switch, one comparison.
"""

from __future__ import annotations

import bisect
import functools
import logging
import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_mp.core.wiring import recorded_optimizers
from lightning_mp.formats import resolve_precision
from lightning_mp.numerics.distributed import rank

log = logging.getLogger("lightning_mp.schedule")  # infos printed (lightning_mp._logging), on rank 0

# the arguments a precision cannot take unless the entry names them, and their defaults
_FP8_ONLY = ("fp8_recipe", "fp8_modules")
_LEAN_ONLY = ("optimizer_state_dtype", "parity_guard")


class Ladder:
    """The rungs of a ``schedule`` (rung 0: the plugin's own arguments) and the step each one begins at.

    ``make_core(arguments)`` builds a core (the front end's constructor); every rung is built once here, so a bad
    entry fails when the plugin is made."""

    def __init__(self, schedule: Mapping[Any, Any] | None, arguments: dict[str, Any], defaults: dict[str, Any],
                 make_core: Callable[[dict[str, Any]], Any]) -> None:
        if schedule is None:
            schedule = {}
        if not isinstance(schedule, Mapping):
            raise ValueError(f"schedule={schedule!r} is not allowed: use a dict {{step or fraction: precision or "
                             "dict of arguments}, e.g. {0.9: 'bf16'}, or None.")
        self.whens = [_check_when(when) for when in schedule]
        if len({type(when) for when in self.whens}) > 1:
            # each entry applies to the rung before it, so the rungs need their order now, and a fraction's place
            # among the steps is known only from the run's length (at the fit's first step)
            raise ValueError(f"schedule={dict(schedule)!r} mixes optimizer steps (int) and fractions of the run "
                             "(float): their order is known only from the run's length. HINT: write every key as a "
                             "step, or every key as a fraction.")
        order = sorted(range(len(self.whens)), key=lambda i: self.whens[i])
        self.whens = [self.whens[i] for i in order]
        entries = [list(schedule.values())[i] for i in order]
        self.rungs = [arguments]
        for when, entry in zip(self.whens, entries):
            entry = _entry(when, entry, defaults)
            try:  # every argument checked now, by the constructor a switch calls
                rung = _apply(self.rungs[-1], entry, defaults)
                make_core(rung)
            except ValueError as error:  # the argument's own message, and the entry that set it
                raise ValueError(f"schedule[{when!r}]={entry!r}: {error}") from None
            self.rungs.append(rung)
        self.starts: list[int] | None = None  # resolved: the step each rung >= 1 begins at
        self.current = 0

    @property
    def scheduled(self) -> bool:
        return len(self.rungs) > 1

    def resolve(self, total_steps: int | None) -> None:
        """Fractions become steps (``total_steps``: the run's optimizer steps; ``None``: not known, refused)."""
        starts = []
        for when in self.whens:
            if isinstance(when, float):
                if total_steps is None or total_steps <= 0 or not math.isfinite(total_steps):
                    raise ValueError(
                        f"schedule={{{when!r}: ...}}: a fraction of the run needs its length, and this run has none "
                        f"(total steps {total_steps!r}). HINT: give the step as an int, or set the Trainer's "
                        "max_steps (Fabric has no length: write steps).")
                when = round(when * total_steps)
            starts.append(when)
        if any(b <= a for a, b in zip(starts, starts[1:])) or (starts and starts[0] < 1):
            shown = ", ".join(f"{w!r} -> step {s}" for w, s in zip(self.whens, starts))
            raise ValueError(f"the schedule's rungs begin at {shown}: each must begin at step >= 1 and after the one "
                             f"before it (total steps {total_steps}). HINT: spread the entries out.")
        self.starts = starts

    def due(self, step: int, length: Callable[[], int | None], core: Any) -> int | None:
        """The rung for optimizer step ``step`` where it is not the current one, else ``None``. At the first call
        (the fit runs, ``core`` is set up) fractions are resolved, ``length()`` giving the run's steps, and a
        schedule FSDP2 cannot follow is refused."""
        if self.starts is None:
            self.resolve(length())
            if core.sharded:
                self.refuse_gather_changes(core)
        rung = self.rung_at(step)
        return rung if rung != self.current else None

    def rung_at(self, step: int) -> int:
        """The rung that computes optimizer step ``step`` (0-based)."""
        return bisect.bisect_right(self.starts or [], step)

    def refuse_gather_changes(self, core: Any) -> None:
        """FSDP2 makes its gather buffers once, in ``mp_policy.param_dtype``: every rung must compute in that dtype."""
        for rung, arguments in enumerate(self.rungs):
            fmt = resolve_precision(arguments["precision"])
            if fmt.dtype != core.format.dtype:
                raise ValueError(
                    f"schedule: rung {rung} computes in {fmt.name!r} ({fmt.dtype}) and the model is sharded by "
                    f"fully_shard, which all-gathers in the dtype of its first gather, {core.format.dtype}, for the "
                    "whole fit. HINT: under FSDP2 schedule changes that keep the compute dtype: 'fp8' <-> 'bf16', "
                    "master_weights='compensated' <-> True.")

    def state_dict(self) -> dict[str, Any]:
        return {"schedule_rung": self.current} if self.scheduled else {}

    def saved_rung(self, state: dict[str, Any]) -> int:
        """The rung a checkpoint was written in (0 without a schedule); one this schedule lacks is refused. A plugin
        without a schedule computes in its own precision whatever rung wrote the checkpoint, as it resumes any
        other precision's checkpoint (fine-tuning in bf16 from an fp8 -> bf16 run, say)."""
        if not self.scheduled:
            return 0
        rung = state.get("schedule_rung", 0)
        if isinstance(rung, bool) or not isinstance(rung, int) or not 0 <= rung < len(self.rungs):
            raise ValueError(
                f"the checkpoint was written in rung {rung!r} of a precision schedule, and this plugin's schedule has "
                f"{len(self.rungs)} rung(s) (0 is the plugin's own arguments). HINT: resume with the schedule the "
                "run was started with.")
        return rung

    def describe(self, rung: int) -> str:
        changed = {k: v for k, v in self.rungs[rung].items() if self.rungs[rung - 1].get(k) != v} if rung else {}
        return ", ".join(f"{k}={v!r}" for k, v in changed.items()) or f"precision={self.rungs[rung]['precision']!r}"


def run_length(trainer: Any) -> int | None:
    """A Trainer's optimizer steps: ``max_steps``, else its estimate from the epochs (``None`` where unbounded)."""
    total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
    return int(total) if math.isfinite(total) else None


def switch(old: Any, new: Any, step: int | None, rung: str) -> None:
    """Move a run from core ``old`` to core ``new`` between two optimizer steps (the module docstring says what
    moves and what stays)."""
    old.step.settle(stop=False)  # the last step's flag read: counted in the state that carries over
    state, calls = old.state_dict(), list(old.calls)
    optimizers = recorded_optimizers(calls)
    held = old.masters.held_copies() if old.masters is not None else []
    averaged = old.step.reduce_ is not None  # DDP with master weights: its own sync off, the step averaged
    old.teardown()
    _fold_on_backward(held)
    _fp32_state(optimizers)
    for name, args in calls:  # the front end's calls, in their order, on the new core
        getattr(new, name)(*args)
    if averaged and new.step.reduce_ is None:
        _keep_averaging(new, [args[0] for name, args in calls if name in ("connect", "data_parallel")])
    new.step.load_state_dict(state)  # counters; the scale only from dynamic to dynamic (LossScaler.load_state_dict)
    if new.autopilot is not None and "auto_fp32_modules" in state:
        new.autopilot.load_state_dict(state["auto_fp32_modules"])  # modules moved to FP32 stay there
    new.last_overflow = old.last_overflow
    retired = " The loss scale retires (1.0 from now on)." if old.scaler.enabled and not new.scaler.enabled else ""
    if rank() == 0:
        log.info("precision schedule: from step %s on, %s (was %s): %s.%s", step, label(new), label(old), rung, retired)


def label(core: Any) -> str:
    """How a rung computes, in a few words: ``"lean bf16"``, ``"fp16, loss scale dynamic"``."""
    name = f"lean {core.format.name}" if core.lean is not None else core.format.name
    if core.format.is_16bit and not core.master_weights and core.lean is None:
        name += " (autocast, no master weights)"
    return name + (f", loss scale {core.scaler.mode!r}" if core.scaler.enabled else "")


def _fold_on_backward(held: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    """A graph built in the old rung and back-propagated in the new one (Fabric counts each ``optimizer.step()``, so
    a switch can fall between a GAN's discriminator step and its generator step, across ``fake = G(z)``) writes its
    gradients into the old rung's 16-bit copies, which no core folds any more: each one's gradient goes into its
    Parameter's FP32 ``.grad`` as it lands (scaled, if at all, by the new rung's scale: the backward's), and the
    step that follows unscales, checks and applies it with the rest. Without this the generator's update at the
    switch was lost, with no word."""
    for param, copy in held:
        copy.register_post_accumulate_grad_hook(functools.partial(_fold_into, weakref.ref(param)))


@torch.no_grad()
def _fold_into(param: weakref.ref, copy: torch.Tensor) -> None:
    p, g16 = param(), copy.grad
    copy.grad = None
    if p is None or g16 is None:
        return
    if p.grad is None:
        p.grad = g16.to(p.dtype)
    else:
        p.grad.add_(g16)  # FP32 sum


def _keep_averaging(new: Any, models: list[Any]) -> None:
    """A rung without master weights (fp32, lean bf16) after one with them under DDP: the old rung turned DDP's own
    gradient sync off (``require_backward_grad_sync``) and averaged in the step. Turning DDP's flag back on here
    would not hold: a switch can come inside a ``no_sync`` block (the Trainer's gradient accumulation), which puts
    the flag back as it found it, off. So the step goes on averaging the gradients, once per step, as it did (one
    all-reduce per run of contiguous gradients: DDP's cost). Before, nothing averaged them and the ranks drifted
    apart from the switch on."""
    for model in models:
        new.average_per_step(model)


def _fp32_state(optimizers: list[Any]) -> None:
    """Optimizer state lean bf16 kept in bf16 (``optimizer_state_dtype``) beside FP32 Parameters: FP32 again (exact),
    as any optimizer keeps it for FP32 Parameters."""
    for optimizer in optimizers:
        for p, state in optimizer.state.items():
            if isinstance(p, torch.Tensor) and p.dtype == torch.float32:
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 and value.shape == p.shape:
                        state[key] = value.float()


def _check_when(when: Any) -> int | float:
    if isinstance(when, bool) or not isinstance(when, (int, float)):
        raise ValueError(f"schedule key {when!r} is not allowed: use an int optimizer step >= 1, or a float in "
                         "(0, 1), a fraction of the run.")
    if isinstance(when, float) and not 0 < when < 1:
        raise ValueError(f"schedule key {when!r} is not allowed: a fraction of the run is in (0, 1); a step is an "
                         "int.")
    if isinstance(when, int) and when < 1:
        raise ValueError(f"schedule key {when!r} is not allowed: step 0 computes in the plugin's own precision; "
                         "use a step >= 1.")
    return when


def _entry(when: Any, entry: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    if isinstance(entry, str):
        entry = {"precision": entry}
    if not isinstance(entry, Mapping) or not entry:
        raise ValueError(f"schedule[{when!r}]={entry!r} is not allowed: use a precision ('bf16') or a dict of the "
                         "plugin's arguments ({'master_weights': True}).")
    unknown = sorted(set(entry) - set(defaults) - {"precision"})
    if unknown or "schedule" in entry:
        raise ValueError(f"schedule[{when!r}] names {unknown or ['schedule']}, which the plugin does not take there. "
                         f"Allowed: {', '.join(repr(k) for k in defaults if k != 'schedule')}.")
    return dict(entry)


def _apply(previous: dict[str, Any], entry: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    rung = {**previous, **entry}
    fmt = resolve_precision(rung["precision"])
    if fmt.name != "fp8":
        rung.update({k: defaults[k] for k in _FP8_ONLY if k not in entry})
    if fmt.dtype != torch.bfloat16 and rung.get("master_weights") == "compensated" and "master_weights" not in entry:
        rung["master_weights"] = defaults["master_weights"]
    if rung.get("master_weights") != "compensated":
        rung.update({k: defaults[k] for k in _LEAN_ONLY if k not in entry})
    return rung
