"""FP8 Linears through torchao's float8 training (``precision="fp8"``). Imports no Lightning, and torchao only
when a run asks for FP8."""

from lightning_mp.fp8.linears import Fp8Linears, Fp8Settings
from lightning_mp.fp8.recipes import DEFAULT_FP8_RECIPE, FP8_RECIPES
from lightning_mp.fp8.selection import DEFAULT_FP8_MODULES

__all__ = ["DEFAULT_FP8_MODULES", "DEFAULT_FP8_RECIPE", "FP8_RECIPES", "Fp8Linears", "Fp8Settings"]
