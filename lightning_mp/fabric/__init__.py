"""The same mixed precision for Lightning Fabric loops.

``Fabric(plugins=[MixedPrecisionPlugin("bf16")])``, then ``PrecisionMonitor(fabric)`` for the ``precision/...``
TensorBoard tags; :func:`load` is ``fabric.load`` that also restores the plugin from a sharded checkpoint. See
:mod:`lightning_mp.fabric.plugin` for where each piece runs in a Fabric loop.
"""

from lightning_mp.fabric.checkpoints import load
from lightning_mp.fabric.fp8_monitor import Fp8StatisticsMonitor
from lightning_mp.fabric.monitor import PrecisionMonitor
from lightning_mp.fabric.plugin import MixedPrecisionPlugin

__all__ = ["Fp8StatisticsMonitor", "MixedPrecisionPlugin", "PrecisionMonitor", "load"]
