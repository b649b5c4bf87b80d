"""The module paths of 0.1.0 (``lightning_mp.plugin``, ``lightning_mp.fp32_policy``...), importable for one more
release, with a ``DeprecationWarning`` that names the new path (CHANGELOG: Deprecated)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "loss_scaler": "numerics.loss_scaler", "master_weights": "numerics.master_weights", "step": "numerics.step",
    "distributed": "numerics.distributed", "sharding": "numerics.sharding",
    "scheduler_guard": "numerics.scheduler_guard",
    "checkpoint_compat": "numerics.checkpoint_compat",
    "fp32_policy": "policy.policy", "fp32_mode": "policy.mode", "fp32_modules": "policy.modules",
    "fp32_ops": "policy.ops", "op_names": "policy.names", "fp32_describe": "policy.describe",
    "gemm_emulation": "gemm.emulation", "gemm_support": "gemm.support",
    "overflow_locator": "doctor.locator", "overflow_report": "doctor.report", "finite_checks": "doctor.finite_checks",
    "activation_ranges": "doctor.activation_ranges", "ranges_plot": "doctor.ranges_plot",
    "log2_histogram": "doctor.log2_histogram",
    "loss_scale_monitor": "monitors.loss_scale", "gradient_range_monitor": "monitors.gradient_range",
    "activation_range_monitor": "monitors.activation_range", "monitor_base": "monitors.base",
    "plugin": "lightning.plugin",
}  # fmt: skip


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Consulted only when no file answers a name (it sits last on ``sys.meta_path``)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package == "lightning_mp" and name in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        new = f"lightning_mp.{MOVED[module.__name__.partition('.')[2]]}"
        warnings.warn(
            f"{module.__name__} is deprecated: import from {new} (or from lightning_mp); the old path goes in the "
            "next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        sys.modules[module.__name__] = importlib.import_module(new)  # the import statement returns this one


def install() -> None:
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())
