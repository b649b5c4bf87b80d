"""``precision="fp8"``: bf16 mixed precision whose chosen Linears multiply in FP8 through torchao.

No module is swapped. torchao's ``convert_to_float8_training`` replaces each ``nn.Linear`` by a ``Float8Linear``,
so the model, its ``repr`` and any checkpoint code that looks at classes would no longer be the user's. Here each
chosen Linear keeps its class and its Parameters; for the fit its instance gets a ``forward`` of its own
(:class:`Fp8Forward`, an instance attribute, as Fabric's and accelerate's redirections are) that calls torchao's
FP8 matmul on the weight the module reads in its forward: the bf16 copy of the FP32 master
(:mod:`lightning_mp.numerics.master_weights`). torchao casts that copy to FP8 with a fresh scale at each call; the
master, the optimizer and every checkpoint stay FP32. ``teardown`` takes the attribute out again.

Outside the run's autocast (a forward of the user's own between steps, Fabric code outside the model's forward
context) the Linear computes as it always does, on its FP32 Parameters: FP8 is a property of the run's steps.
Evaluation steps (Lightning's validate, test and predict, under ``torch.inference_mode`` or ``no_grad``; Fabric
forwards under either) compute the training step's FP8 forward, bit for bit: a validation loss is the loss of the
model as it trains.
Inside it, torchao's function runs with autocast off: its emulated GEMM is an FP32 ``torch.mm`` on FP8 values,
which autocast would otherwise round to bf16, and the FP32 policy's kernels have nothing to do there. Activation
memory is a bf16 Linear's: torchao saves the bf16 input and weight for the backward.

Pickled or deep-copied during the fit (``torch.save(model)``, an EMA copy), a chosen Linear comes back with its
class's plain ``forward``: the copy computes on its own Parameters.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_mp.fp8.autopilot import Fp8Autopilot
from lightning_mp.fp8.recipes import DEFAULT_FP8_RECIPE, DIM_MULTIPLE, FP8_RECIPES, Matmul, check_fp8_recipe
from lightning_mp.fp8.recipes import fp8_gemms_native, fp8_matmul, import_torchao
from lightning_mp.fp8.selection import DEFAULT_FP8_MODULES, check_fp8_modules, choose, split_auto

log = logging.getLogger("lightning_mp.fp8")


@dataclass(frozen=True)
class Fp8Settings:
    """The plugin's ``fp8_recipe`` and ``fp8_modules``, checked (whatever the precision: a typo is found early)."""

    recipe: str = DEFAULT_FP8_RECIPE
    modules: Any = DEFAULT_FP8_MODULES

    def __post_init__(self) -> None:
        check_fp8_recipe(self.recipe)
        object.__setattr__(self, "modules", check_fp8_modules(self.modules))


def _refuse_without_fp8(precision: str, settings: Fp8Settings) -> None:
    """An FP8 knob other than its default under a precision that computes no Linear in FP8 would run plain
    ``precision`` with no word: refused, as ``optimizer_state_dtype`` is without ``master_weights='compensated'``."""
    default = Fp8Settings()
    for name, value, wanted in (("fp8_recipe", settings.recipe, default.recipe),
                                ("fp8_modules", settings.modules, default.modules)):
        if value != wanted:
            shown = _shown(value)
            raise ValueError(
                f"{name}={shown} is not allowed with precision={precision!r}: it chooses how Linears compute in FP8, "
                f"and only precision='fp8' (bf16 whose chosen Linears multiply in FP8) computes any. HINT: "
                f"MixedPrecisionPlugin('fp8', {name}={shown}), or leave {name} out for {precision!r}."
            )


def _shown(value: Any) -> str:
    """``value`` as the user wrote it: a list's classes by their names (``[Linear, 'mlp']``), the rest by repr."""
    if isinstance(value, tuple):
        return "[" + ", ".join(v.__name__ if isinstance(v, type) else repr(v) for v in value) + "]"
    return repr(value)


class Fp8Forward:
    """A chosen Linear's ``forward`` for the fit: torchao's FP8 matmul under the run's autocast, the Linear's own
    computation outside it."""

    __slots__ = ("module", "matmul", "device_type", "dtype")

    def __init__(self, module: nn.Linear, matmul: Matmul, device_type: str, dtype: torch.dtype) -> None:
        self.module, self.matmul, self.device_type, self.dtype = module, matmul, device_type, dtype

    def __call__(self, input: Tensor) -> Tensor:  # noqa: A002 (nn.Linear's name)
        m = self.module
        weight, bias = m.weight, m.bias  # inside the module's call: the bf16 copies
        if not torch.is_autocast_enabled(self.device_type):
            return F.linear(input, weight, bias)
        # Evaluation computes the training step's FP8 forward, whatever turned gradients off: under
        # torch.inference_mode (Lightning's default for validate, test and predict) torchao's row-scaled FP8 tensors
        # meet `aten.reshape` undecomposed, which they do not implement (outside inference mode it reaches them as
        # the `view` they do), so the FP8 forward runs with inference mode off and gradients off: no_grad's
        # computation, bit for bit. The cost is the version counters of a few intermediate tensors.
        # (torch.compile: Dynamo cannot trace the mode's query, a graph break per Linear; a compiled graph meets the
        # FP8 tensors' ops decomposed, so it needs no way out of the mode)
        leaving = not torch.compiler.is_compiling() and torch.is_inference_mode_enabled()
        leave = _no_inference_mode if leaving else contextlib.nullcontext
        with leave(), torch.autocast(self.device_type, enabled=False):
            out = self.matmul(input.to(self.dtype), weight.to(self.dtype))
            return out if bias is None else out + bias.to(self.dtype)

    def __reduce__(self) -> tuple:
        return (_plain_forward, (self.module,))


@contextlib.contextmanager
def _no_inference_mode() -> Iterator[None]:
    with torch.inference_mode(False), torch.no_grad():  # inference_mode(False) alone turns gradients back on
        yield


def _plain_forward(module: nn.Module) -> Callable:
    return types.MethodType(type(module).forward, module)


class Fp8Linears:
    """The chosen Linears of one run: attached at the run's set-up on its device, detached at teardown. Where the
    precision is not ``"fp8"`` it does nothing (``attach`` returns ``""``). With ``fp8_modules="auto"`` its
    :attr:`autopilot` calibrates the chosen Linears in bf16 for ``calibration_steps`` training steps
    (:meth:`end_step`), then keeps in bf16 those FP8 hurts (:mod:`lightning_mp.fp8.autopilot`)."""

    KEPT_BY_AUTOPILOT = "measured, FP8 hurts it (fp8_modules='auto')"

    def __init__(self, precision: str, settings: Fp8Settings, calibration_steps: int = 10) -> None:
        self.enabled = precision == "fp8"
        if not self.enabled:
            _refuse_without_fp8(precision, settings)
        self.settings = settings
        base, auto = split_auto(settings.modules)
        self._base = base
        self.autopilot = Fp8Autopilot(settings.recipe, calibration_steps) if auto and self.enabled else None
        self.chosen: list[tuple[str, nn.Linear]] = []  # (qualified name, module), what computes in FP8
        self._candidates: list[tuple[str, nn.Linear]] = []  # chosen before the autopilot's measurements
        self._forward: tuple = ()  # (matmul, device type, dtype) of the FP8 forwards
        self.kept: dict[str, list[str]] = {}  # reason -> names of Linears kept in bf16
        self.emulated: bool | None = None  # decided at attach
        self.why = ""
        if self.enabled:
            import_torchao(settings.recipe)

    def attach(self, root: nn.Module, device_type: str, dtype: torch.dtype,
               keeps_fp32: Callable[[nn.Module], bool]) -> str:
        """Choose the Linears, give each its FP8 forward; the log line that says what runs where (``""`` off)."""
        if not self.enabled:
            return ""
        self.remove()
        recipe = self.settings.recipe
        multiple = DIM_MULTIPLE.get(recipe, 16)
        self._candidates, self.kept = choose(root, recipe, self._base, keeps_fp32, multiple)
        native, why = fp8_gemms_native(device_type, recipe)
        self.emulated, self.why = not native, why
        self._forward = (fp8_matmul(recipe, emulate=not native), device_type, dtype)
        if self.autopilot is not None:
            self.autopilot.attach(self._candidates, dtype)
        self._install()
        return self.describe()

    def _install(self) -> None:
        """An FP8 forward on each candidate the autopilot does not hold in bf16; none on the others."""
        held = self.autopilot.holds if self.autopilot is not None else (lambda name: False)
        self.chosen = [(n, m) for n, m in self._candidates if not held(n)]
        if self.autopilot is not None and not self.autopilot.calibrating:
            self.kept.pop(self.KEPT_BY_AUTOPILOT, None)
            if self.autopilot.kept:
                self.kept[self.KEPT_BY_AUTOPILOT] = self.autopilot.kept
        for name, module in self._candidates:
            has = isinstance(module.__dict__.get("forward"), Fp8Forward)
            if held(name) and has:
                del module.__dict__["forward"]
            elif not held(name) and not has:
                module.__dict__["forward"] = Fp8Forward(module, *self._forward)

    def end_step(self, stepped: bool = True) -> None:
        """A training step ended (every rank, the same steps; ``stepped``: an optimizer stepped in it). At the end
        of the autopilot's calibration the Linears it does not keep in bf16 compute in FP8 from the next forward."""
        if self.autopilot is not None and stepped and self.autopilot.end_step() and self._forward:
            self._install()

    def state_dict(self) -> dict[str, Any]:
        """The autopilot's decisions, for the plugin's checkpoint state (``{}`` without it)."""
        return {"auto_fp8_modules": self.autopilot.state_dict()} if self.autopilot is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.autopilot is not None and "auto_fp8_modules" in state:
            self.autopilot.load_state_dict(state["auto_fp8_modules"])
            if self._forward:
                self._install()
        elif state.get("auto_fp8_modules", {}).get("kept"):
            log.warning("The checkpoint holds fp8_modules='auto' decisions (kept in bf16: "
                        f"{state['auto_fp8_modules']['kept']}), and this run does not use 'auto': they are not applied.")

    def remove(self) -> None:
        """Every chosen Linear's own ``forward`` again (idempotent)."""
        if self.autopilot is not None:
            self.autopilot.remove()
        for _, module in self._candidates:
            if isinstance(module.__dict__.get("forward"), Fp8Forward):
                del module.__dict__["forward"]

    def describe(self) -> str:
        """What computes in FP8 and how, what stays in bf16 and why (before set-up: the settings)."""
        recipe = self.settings.recipe
        if self.emulated is None:
            return f"fp8: recipe {recipe!r} ({FP8_RECIPES[recipe]}), fp8_modules={self.settings.modules!r}, set up " \
                   "on the model's device"
        total = len(self._candidates) + sum(len(v) for k, v in self.kept.items() if k != self.KEPT_BY_AUTOPILOT)
        how = "emulated (torchao's emulate: FP8 operands, FP32 GEMMs)" if self.emulated else "in FP8 GEMMs"
        line = (f"fp8: {len(self.chosen)} of {total} Linears compute through torchao's {recipe!r} recipe "
                f"({FP8_RECIPES[recipe]}), {how}: {self.why}.")
        for reason, names in self.kept.items():
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            line += f" In bf16, {reason}: {shown}."
        if self.autopilot is not None:
            line += " " + self.autopilot.describe()
        if not self._candidates:
            line += " HINT: fp8_modules=[nn.Linear] or a list of names puts Linears in FP8 (docs/fp8.md)."
        return line
