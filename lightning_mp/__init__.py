"""Mixed precision training for PyTorch Lightning that you can trust and see.

``Trainer(plugins=[MixedPrecisionPlugin("bf16")], callbacks=[LossScaleMonitor(), GradientRangeMonitor()])``
"""

from lightning_mp.activation_range_monitor import ActivationRangeMonitor
from lightning_mp.formats import PRECISION_ALIASES, Format, resolve_precision
from lightning_mp.fp32_policy import DEFAULT_FP32_MODULES, DEFAULT_FP32_OPS, Fp32Policy
from lightning_mp.grad_norm import grad_norm
from lightning_mp.gradient_range_monitor import GradientRangeMonitor
from lightning_mp.loss_scale_monitor import LossScaleMonitor
from lightning_mp.loss_scaler import LossScaler
from lightning_mp.overflow_locator import OverflowLocator, OverflowReport
from lightning_mp.plugin import MixedPrecisionPlugin
from lightning_mp.step import MixedPrecisionStep

__version__ = "0.1.0"

__all__ = [
    "ActivationRangeMonitor",
    "DEFAULT_FP32_MODULES",
    "DEFAULT_FP32_OPS",
    "Format",
    "Fp32Policy",
    "GradientRangeMonitor",
    "LossScaleMonitor",
    "LossScaler",
    "MixedPrecisionPlugin",
    "MixedPrecisionStep",
    "OverflowLocator",
    "OverflowReport",
    "PRECISION_ALIASES",
    "grad_norm",
    "resolve_precision",
]
