"""The Trainer front end: ``Trainer(plugins=[MixedPrecisionPlugin("bf16")])``."""

from lightning_mp.lightning.plugin import MixedPrecisionPlugin

__all__ = ["MixedPrecisionPlugin"]
