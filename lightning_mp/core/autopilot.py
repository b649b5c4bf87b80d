"""The precision autopilot (``fp32_modules="auto"``): module *instances* that cannot take the 16-bit format move to
FP32 by themselves, decided from measurements of this model rather than from a list of classes.

A module instance moves to FP32 (its whole subtree: every parameter keeps no 16-bit copy, and its forward, children
included, runs with autocast off, as a listed class does) when

* **calibrating** (the first ``calibration_steps`` training steps): its floating output comes within a factor
  :data:`MARGIN` of the format's largest finite value, or goes non-finite, while its floating inputs stay below that
  threshold, and no module inside it produced such an output first (the big values are its own doing: a child that
  made them is the one to blame, and a parent that only passes them on is not);
* **afterwards**: the overflow locator names it as the first module whose forward output went non-finite on finite
  inputs (on a skipped step; the locator arms its forward checks at the first skip, so a forward overflow that
  appears late is named at the second).

A backward overflow is the loss scaler's business and moves nothing. Decisions are taken between steps (the next
forward runs the module in FP32), kept in order in :attr:`Autopilot.decisions`, logged, saved in the plugin's
checkpoint state and re-applied on resume, so a resumed run computes exactly as the one it continues.

**Every rank takes the same decisions** (DDP, FSDP2, one node or many): what a rank measures or locates is a
proposal, and at the end of each calibration step and of each skipped step the ranks agree on them with one
all-reduce (MAX), after which every rank moves the union, at the same step, with the same :class:`Decision`
(:mod:`lightning_mp.core.agreement`: the table reduced, and why a rank must never decide alone).

Cost: while calibrating, one ``amax`` of every floating input and output of every module and one host read each
(about the locator's forward checks: 9-13% of a step on the demo models; on CUDA every read is a device sync).
After calibration the hooks are gone: nothing per step beyond what the locator already costs. Across ranks: one
all-reduce of 24 bytes per module (12 KB for a 500-module model) and its host read at the end of each calibration
step and of each skipped step; none on a clean step after calibration, and none in one process.

bf16 has FP32's exponent range: nothing short of an FP32 overflow reaches its threshold, so in bf16 ``"auto"``
measures during calibration and, in practice, decides nothing. Demoting for *underflow* is not done: a bf16
activation flushes to zero only below 2^-133, where FP32 itself is subnormal, and bf16's real loss, its 8-bit
significand, shows in no range measurement (``docs/policy.md``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_mp.core import agreement
from lightning_mp.core.agreement import Agreed, Proposals
from lightning_mp.doctor.report import OverflowReport
from lightning_mp.formats import Format
from lightning_mp.policy.modules import Fp32Forwards
from lightning_mp.policy.ops import DEFAULT_FP32_MODULES
from lightning_mp.validation import check_int

log = logging.getLogger("lightning_mp.plugin")

AUTO = "auto"

# Calibration's threshold: within a factor 8 (3 binades) of the format's largest finite value (fp16: 8188), so a
# module is moved while its activations still have room to grow, not after they overflowed.
MARGIN = 8.0


@dataclass(frozen=True)
class Decision:
    """One module moved to FP32: its qualified name, the training step, and the evidence."""

    module: str
    step: int | None
    evidence: str

    def __str__(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        return f"`{self.module}` to FP32{at}: {self.evidence}"


class Autopilot:
    """Chooses module instances to run in FP32 for one fit (see the module docstring).

    Args:
        format: the 16-bit compute format (its largest finite value sets the threshold).
        calibration_steps: training steps whose activations are measured (0: only located overflows decide).
        kept: ``kept(module)`` is true for modules already FP32 by class (the policy's ``fp32_modules``).
    """

    def __init__(self, format: Format, calibration_steps: int, kept: Callable[[nn.Module], bool]) -> None:
        check_int("calibration_steps", calibration_steps, 0, why="training steps whose activations are measured")
        self.format = format
        self.calibration_steps = calibration_steps
        self.threshold = format.max / MARGIN
        self.decisions: list[Decision] = []
        self._kept_by_class = kept
        self._kept: dict[int, nn.Module] = {}  # id -> the instances moved so far
        self._proposals = Proposals()  # this rank's, in the step in progress: the ranks agree at end_step
        self._pending: list[tuple[nn.Module, Decision]] = []  # agreed (or restored): applied at the next forward
        self._restored: list[Decision] = []  # from a checkpoint or an earlier fit, applied when attached
        self._root: nn.Module | None = None
        self._modules: list[tuple[str, nn.Module]] = []  # the agreement's rows, in named_modules order
        self._index: dict[str, int] = {}  # name -> row
        self._rows: dict[int, int] = {}  # id(module) -> row
        self._device_type = "cpu"
        self._device = torch.device("cpu")  # the model's: the agreement's all-reduce runs there
        self._steps = 0
        self._frames: list[list[Any]] = []  # calibration: [module, input amax, explained] per forward in flight
        self._calibration: list[Any] = []
        self._fp32_hooks: list[Any] = []

    @property
    def modules(self) -> list[str]:
        """Qualified names of the modules moved to FP32, in the order decided."""
        return [d.module for d in self.decisions]

    def keeps(self, module: nn.Module) -> bool:
        """Whether this instance was moved to FP32 (its parameters keep no 16-bit copy)."""
        return id(module) in self._kept

    # ------------------------------------------------------------------ set-up
    def attach(self, root: nn.Module, device_type: str) -> None:
        """Watch ``root`` (the module the reports name from): calibration hooks, and decisions a checkpoint held."""
        self._root, self._device_type = root, device_type
        self._modules = list(root.named_modules())
        self._index = {name: i for i, (name, _) in enumerate(self._modules)}
        self._rows = {id(m): i for i, (_, m) in enumerate(self._modules)}
        first = next(root.parameters(), None)
        self._device = first.device if first is not None else torch.device("cpu")
        self._resolve_restored()
        if self._steps < self.calibration_steps:
            for module in root.modules():
                self._calibration.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
                self._calibration.append(module.register_forward_hook(self._post, always_call=True))

    def remove(self) -> None:
        """Every hook off; the decisions stay (:meth:`state_dict`), to be applied again by the next attach."""
        self._stop_calibrating()
        for handle in self._fp32_hooks:
            handle.remove()
        self._fp32_hooks.clear()
        # the decisions stay listed, and the next attach (another fit with this plugin) applies them again
        self._restored = self.decisions + [d for _, d in self._pending]
        self._kept, self._pending, self._root = {}, [], None
        self._proposals.clear()  # agreed by no rank: a next fit applies nothing of them

    # ------------------------------------------------------------------ decisions
    def demote(self, report: OverflowReport) -> bool:
        """Propose the module a forward overflow ``report`` names (the ranks agree at :meth:`end_step`, and it runs
        in FP32 from the next forward on); False if it cannot move or already is FP32."""
        if report.phase != "forward" or report.tensor not in agreement.LOCATED_TENSORS:
            return False  # a backward overflow (the loss scaler's business), or a report naming no module
        index = self._index.get(report.module) if report.module is not None else None
        module = self._modules[index][1] if index is not None else None
        if module is None or self.keeps(module) or self._kept_by_class(module):
            return False
        if module is self._root:
            log.warning(f"the model's own forward overflowed {self.format.name}: moving the root to FP32 would turn "
                        "mixed precision off, so it stays. HINT: fix the scale of its values.")
            return False
        return self._proposals.located(index, report)

    def _queue(self, module: nn.Module, decision: Decision) -> bool:
        if self.keeps(module) or self._kept_by_class(module) or any(m is module for m, _ in self._pending):
            return False
        self._pending.append((module, decision))
        return True

    def apply(self) -> bool:
        """Between steps: the queued modules run in FP32 from now on. Returns whether any moved (the caller then
        rebuilds the 16-bit copies, since these parameters keep none from now on)."""
        moved = False
        hooks = Fp32Forwards(self._device_type)
        for module, decision in self._pending:
            if any(self.keeps(m) for m in _ancestors(module, self._root)):
                continue  # an enclosing module went first: this one is FP32 already
            self._kept[id(module)] = module
            self._fp32_hooks.extend(hooks.attach(module))
            moved = True
            if decision not in self.decisions:  # not one an earlier fit of this plugin took already
                self.decisions.append(decision)
                if agreement.rank() == 0:  # agreed: every rank took this decision, one line says it
                    log.warning(f"fp32_modules='auto': {decision}")
        self._pending.clear()
        return moved

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def end_step(self, step: int | None = None, skipped: bool = False) -> None:
        """One training step done (``step``: its number, for located overflows; ``skipped``: whether it was, the
        flag every rank agreed on). Each rank calls it: at the end of a calibration step and of a skipped step the
        ranks agree on what they proposed (one collective, see the module docstring), and the agreed modules move
        at the next forward. Calibration ends after ``calibration_steps`` steps."""
        if self._root is not None and (self._steps < self.calibration_steps or skipped):
            self._agree(step)
        self._steps += 1
        self._frames.clear()
        if self._steps >= self.calibration_steps:
            self._stop_calibrating()

    def _agree(self, step: int | None) -> None:
        names = [name for name, _ in self._modules]
        types = [type(module).__name__ for _, module in self._modules]
        for agreed in self._proposals.agree(names, types, self._device):  # every rank: one collective
            name, module = self._modules[agreed.index]
            self._queue(module, self._decision(name, agreed, step))

    def _decision(self, name: str, agreed: Agreed, step: int | None) -> Decision:
        """The decision the ranks agreed on: the same text on every rank."""
        if agreed.located is not None:
            return Decision(name, step, f"the step overflowed there: {agreed.located}{agreed.where()}")
        out, inputs = agreed.output_amax, agreed.input_amax
        reached = "went non-finite" if not math.isfinite(out) else f"reached {out:.4g}"
        evidence = (f"while calibrating, its output {reached} (threshold {self.format.name} max / {MARGIN:g} = "
                    f"{self.threshold:.4g}) from inputs of at most {inputs:.4g}{agreed.where()}")
        return Decision(name, self._steps, evidence)

    def describe(self) -> str:
        moved = "".join(f"\n  - {d}" for d in self.decisions) or " none so far"
        return f"fp32_modules='auto' (calibrating {self.calibration_steps} steps); moved to FP32:{moved}"

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        # the agreed decisions not applied yet too: a checkpoint written between a step and the next forward has them
        waiting = [d.module for _, d in self._pending] + [d.module for d in self._restored]
        return {"modules": list(dict.fromkeys(self.modules + waiting)), "calibrated_steps": self._steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps = int(state.get("calibrated_steps", self.calibration_steps))
        known = set(self.modules) | {d.module for d in self._restored}
        evidence = "decided by the run this checkpoint comes from"
        self._restored.extend(Decision(n, None, evidence) for n in state.get("modules", []) if n not in known)
        self._resolve_restored()
        if self._steps >= self.calibration_steps:
            self._stop_calibrating()

    def _resolve_restored(self) -> None:
        if self._root is None:
            return
        modules = dict(self._root.named_modules())
        for decision in self._restored:
            if decision.module not in modules:
                raise ValueError(
                    f"The checkpoint's fp32_modules='auto' decisions name the module {decision.module!r}, which this "
                    "model does not have. HINT: resume with the model the checkpoint was written from."
                )
            self._queue(modules[decision.module], decision)
        self._restored = []

    # ------------------------------------------------------------------ calibration hooks
    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return
        self._frames.append([module, _amax(tree_leaves((args, kwargs))), False])

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_compiling() or not self._frames or self._frames[-1][0] is not module:
            return
        _, inputs, explained = self._frames.pop()
        out = _amax(tree_leaves(output))
        if not out < self.threshold:  # NaN included
            for frame in self._frames:
                frame[2] = True  # every enclosing module's big output is explained by this one
            if not explained and inputs < self.threshold and not self.keeps(module):
                self._proposals.measured(self._rows[id(module)], out, inputs)  # the ranks agree at end_step

    def _stop_calibrating(self) -> None:
        for handle in self._calibration:
            handle.remove()
        self._calibration.clear()
        self._frames.clear()


def split_auto(fp32_modules: Any) -> tuple[Any, bool]:
    """``"auto"``: the default classes plus the autopilot; a collection holding ``"auto"``: its classes plus it."""
    if isinstance(fp32_modules, str):
        if fp32_modules != AUTO:
            raise ValueError(
                f"fp32_modules={fp32_modules!r} is not allowed: use 'auto', a tuple of nn.Module classes, or a tuple "
                "of classes with 'auto' in it ('auto' alone starts from DEFAULT_FP32_MODULES)."
            )
        return DEFAULT_FP32_MODULES, True
    if isinstance(fp32_modules, (list, tuple)) and AUTO in fp32_modules:
        return tuple(m for m in fp32_modules if not (isinstance(m, str) and m == AUTO)), True
    return fp32_modules, False


@torch.no_grad()
def _amax(leaves: Iterable[Any]) -> float:
    """The largest magnitude over the floating tensors among ``leaves`` (NaN if any holds one; 0 if none)."""
    amaxes = [t.detach().abs().amax().float() for t in leaves
              if isinstance(t, Tensor) and t.is_floating_point() and t.numel()]
    if not amaxes:
        return 0.0
    return torch.stack([a.to(amaxes[0].device) for a in amaxes]).amax().item()  # one host read per call


def _ancestors(module: nn.Module, root: nn.Module | None) -> list[nn.Module]:
    if root is None:
        return []
    return [m for m in root.modules() if m is not module and any(c is module for c in m.modules())]
