"""One run's numerics (:class:`MixedPrecisionCore`), which both front ends hold, and the read-only views they show
(:class:`CoreViews`). Imports no Lightning."""

from lightning_mp.core.run import MixedPrecisionCore
from lightning_mp.core.views import CoreViews

__all__ = ["CoreViews", "MixedPrecisionCore"]
