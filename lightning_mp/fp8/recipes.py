"""The FP8 recipes, torchao behind them, and whether this device computes FP8 GEMMs or emulates them.

Every FP8 cast, scale and GEMM is torchao's (``torchao.float8``'s autograd function for a Linear's matmul, the
``Float8LinearConfig`` of each recipe, and for MXFP8 the MX training matmul of ``torchao.prototype``); this module
only chooses which, and says so.

=====================  =====================================================================================
recipe                 what torchao does in each of a Linear's three GEMMs (output, grad_input, grad_weight)
=====================  =====================================================================================
``tensorwise``         one scale per tensor; input and weight in e4m3, the output gradient in e5m2
``rowwise`` (default)  one scale per row, rounded down to a power of two; e4m3 everywhere (torchtitan's)
``rowwise_with_gw_hp`` rowwise for output and grad_input; grad_weight in bf16 (the most accurate of the three)
``mxfp8``              MX: e4m3 in blocks of 32 values that share a power-of-two (e8m0) scale, RCEIL rounding
=====================  =====================================================================================

Real FP8 GEMMs need CUDA capability 8.9 or newer (Ada, Hopper: ``torch._scaled_mm``); MXFP8's need 10.0
(Blackwell). Everywhere else the recipe is emulated: torchao's ``emulate=True`` (``KernelPreference.EMULATED`` for
MX) rounds the operands to FP8 with the same scales and multiplies the FP8 values in an FP32 GEMM, so the numerics
are the recipe's and the speed is an FP32 GEMM's plus the casts.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_mp.gemm.support import cpu_capability

FP8_RECIPES: dict[str, str] = {
    "tensorwise": "one scale per tensor (e4m3 input and weight, e5m2 gradients)",
    "rowwise": "one power-of-two scale per row, e4m3 everywhere (torchtitan's default)",
    "rowwise_with_gw_hp": "rowwise, with the weight gradient's GEMM in bf16",
    "mxfp8": "e4m3 in blocks of 32 sharing an e8m0 scale",
}
DEFAULT_FP8_RECIPE = "rowwise"
#: the operands' dimensions of a GEMM torchao computes in FP8 must be multiples of this (torch._scaled_mm's rule;
#: MX scales blocks of 32 values)
DIM_MULTIPLE = {"mxfp8": 32}
_CAPABILITY = {"mxfp8": (10, 0)}  # the rest: (8, 9)
TORCHAO_REQUIREMENT = "torchao>=0.17,<0.19"  # setup.cfg's `fp8` extra: keep the two equal
_INSTALL = "pip install 'lightning_mp[fp8]'"

Matmul = Callable[[Tensor, Tensor], Tensor]  # (input [..., in], weight [out, in]) -> output [..., out]


def check_fp8_recipe(recipe: object) -> str:
    if not isinstance(recipe, str) or recipe not in FP8_RECIPES:
        allowed = ", ".join(repr(r) for r in FP8_RECIPES)
        raise ValueError(f"fp8_recipe={recipe!r} is not allowed: use one of {allowed}.")
    return recipe


def import_torchao(recipe: str) -> None:
    """Import what ``recipe`` needs of torchao now, at the plugin's construction, or say what to install."""
    quiet = logging.getLogger("torchao")
    level = quiet.level
    # torchao logs a warning per CUDA extension it cannot load (on a CPU build: each of them); its FP8 training
    # needs none of them (the GEMMs are torch._scaled_mm, or emulated)
    quiet.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "precision='fp8' computes Linear GEMMs through torchao's float8 training, and torchao is not "
            f"installed ({err}). HINT: {_INSTALL} (installs {TORCHAO_REQUIREMENT})."
        ) from err
    finally:
        quiet.setLevel(level)
    if recipe == "mxfp8":
        _mx_imports()


def fp8_gemms_native(device_type: str, recipe: str) -> tuple[bool, str]:
    """Whether ``device_type`` computes this recipe's FP8 GEMMs in hardware, and the reason in words."""
    need = _CAPABILITY.get(recipe, (8, 9))
    if device_type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        name = f"{torch.cuda.get_device_name()} (capability {capability[0]}.{capability[1]})"
        if capability >= need:
            return True, f"{name} has FP8 GEMMs"
        return False, f"{name} has no {recipe} FP8 GEMMs (they need capability {need[0]}.{need[1]})"
    if device_type == "cpu":
        return False, f"this CPU ({cpu_capability()}) has no FP8 GEMMs in torch"
    return False, f"{device_type!r} devices have no FP8 GEMMs in torch"


def fp8_matmul(recipe: str, emulate: bool) -> Matmul:
    """torchao's differentiable FP8 matmul for ``recipe``: it casts the high-precision operands (and in the
    backward the output gradient) to FP8 with dynamic scales and runs the three GEMMs."""
    if recipe == "mxfp8":
        return _mx_matmul(emulate)
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    # what Float8Linear builds for its three GEMMs: (emulate, fast accumulation, FP8 output: no, pad inner dim)
    mm_config = LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, config.pad_inner_dim) for g in gemms))
    # partials of module-level functions, not closures: the plugin keeps them and pickles (torch.save(trainer))
    return functools.partial(_float8_matmul, matmul_with_hp_or_float8_args, mm_config, config)


def _float8_matmul(function: Any, mm_config: Any, config: Any, x: Tensor, weight: Tensor) -> Tensor:
    return function.apply(x, weight.t(), mm_config, config)


def _mx_imports() -> tuple:
    try:
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    except ImportError as err:  # a prototype: its module paths move between torchao releases (0.17 has none here)
        import torchao

        raise ImportError(
            f"fp8_recipe='mxfp8' needs torchao's MX training where torchao 0.18 has it; torchao "
            f"{torchao.__version__} has not ({err}). HINT: pip install 'torchao==0.18.*', or another fp8_recipe."
        ) from err
    return _to_mxfp8_then_scaled_mm, ScaleCalculationMode, KernelPreference


def _mx_matmul(emulate: bool) -> Matmul:
    _to_mxfp8_then_scaled_mm, ScaleCalculationMode, KernelPreference = _mx_imports()
    preference = KernelPreference.EMULATED if emulate else KernelPreference.AUTO
    return functools.partial(_mx_mm, _to_mxfp8_then_scaled_mm, preference, ScaleCalculationMode.RCEIL)


def _mx_mm(mm: Callable, preference: Any, rounding: Any, x: Tensor, weight: Tensor) -> Tensor:
    rows = x.numel() // x.shape[-1]
    if rows % 32:  # the weight gradient's GEMM scales blocks of 32 rows (tokens)
        raise ValueError(
            f"fp8_recipe='mxfp8' needs the rows of every FP8 Linear's input (batch x sequence) to be a multiple "
            f"of 32; this one has {rows} (input shape {tuple(x.shape)}). HINT: a batch size or sequence length "
            "that makes it one, or fp8_recipe='rowwise'."
        )
    return mm(x, weight, preference, rounding)
