"""Mixed precision training for PyTorch Lightning that you can trust and see.

``Trainer(plugins=[MixedPrecisionPlugin("bf16")], callbacks=[LossScaleMonitor(), GradientRangeMonitor()])``

Packages: ``numerics`` (Trainer-free numerics), ``policy`` (the FP32 policy), ``gemm`` (emulated 16-bit GEMMs),
``doctor`` (measuring what 16 bits do), ``core`` (one run's numerics), the front ends ``lightning`` (Trainer) and
``fabric``, and ``monitors`` (TensorBoard callbacks).
"""

from lightning_mp import _compat, _logging
from lightning_mp.doctor.locator import OverflowLocator
from lightning_mp.doctor.report import OverflowReport
from lightning_mp.formats import PRECISION_ALIASES, Format, resolve_precision
from lightning_mp.lightning.plugin import MixedPrecisionPlugin
from lightning_mp.monitors.activation_range import ActivationRangeMonitor
from lightning_mp.monitors.fp8_statistics import Fp8StatisticsMonitor
from lightning_mp.monitors.gradient_range import GradientRangeMonitor
from lightning_mp.monitors.loss_scale import LossScaleMonitor
from lightning_mp.numerics.grad_norm import grad_norm
from lightning_mp.numerics.loss_scaler import LossScaler, ScalerSettings
from lightning_mp.numerics.step import MixedPrecisionStep
from lightning_mp.policy.ops import (
    BF16_FP32_OPS,
    DEFAULT_FP32_MODULES,
    DEFAULT_FP32_OPS,
    EMBEDDING_MODULES,
    FP16_RANGE_OPS,
    NORM_MODULES,
    RECURRENT_MODULES,
)
from lightning_mp.policy.policy import Fp32Policy

__version__ = "0.2.0.dev0"

_compat.install()
_logging.install()

__all__ = [
    "ActivationRangeMonitor",
    "BF16_FP32_OPS",
    "DEFAULT_FP32_MODULES",
    "DEFAULT_FP32_OPS",
    "EMBEDDING_MODULES",
    "FP16_RANGE_OPS",
    "Format",
    "Fp32Policy",
    "Fp8StatisticsMonitor",
    "GradientRangeMonitor",
    "LossScaleMonitor",
    "LossScaler",
    "MixedPrecisionPlugin",
    "MixedPrecisionStep",
    "NORM_MODULES",
    "OverflowLocator",
    "OverflowReport",
    "PRECISION_ALIASES",
    "RECURRENT_MODULES",
    "ScalerSettings",
    "grad_norm",
    "resolve_precision",
]
