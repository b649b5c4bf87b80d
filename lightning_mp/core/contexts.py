"""What a training forward computes in: autocast to the 16-bit format, the FP32 policy's kernels (or its Python
fallback), and emulated GEMMs where this device's 16-bit GEMMs are slow or missing
(:meth:`lightning_mp.core.MixedPrecisionCore.forward_context`; the backward needs only the emulation's context)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from lightning_mp.formats import Format
from lightning_mp.gemm.emulation import GemmEmulation
from lightning_mp.policy.policy import Fp32Policy


def forward_context(fmt: Format, device_type: str, policy: Fp32Policy, hold: Any,
                    gemm: GemmEmulation) -> contextlib.AbstractContextManager:
    """The forward's context. ``hold``: the policy's kernels when the fit switched them on for its whole length
    (the Trainer's), else ``None`` (Fabric's: each forward registers them for its block)."""
    if not fmt.is_16bit:
        return contextlib.nullcontext()
    # autocast: tensors built in the forward and parameters read outside their module get 16-bit GEMMs too
    autocast = torch.autocast(device_type, dtype=fmt.dtype)
    # kernels on for the whole fit (the Trainer's): another hold per forward would only move a counter per kernel
    ops = policy.fallback_mode() if hold is not None and hold.active else policy.op_context()
    if ops is None and not gemm.emulated:
        return autocast  # the common case (native GEMMs, no torch-function fallback): no ExitStack to run
    stack = contextlib.ExitStack()
    for context in (autocast, ops, gemm.context()):
        if context is not None:
            stack.enter_context(context)
    return stack

