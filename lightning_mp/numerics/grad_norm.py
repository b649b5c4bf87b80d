"""Gradient norms of the FP32 gradients the optimizer reads, with the keys of Lightning's ``grad_norm``.

Under :class:`lightning_mp.MixedPrecisionPlugin` the 16-bit gradients exist only during the backward pass: they
are folded into FP32 ``.grad`` tensors on the module's own parameters right after it. From
``on_before_optimizer_step`` on those are the true (unscaled) values, so Lightning's own
``lightning.pytorch.utilities.grad_norm`` reads them too; this function computes the same keys with one fused
norm kernel and in FP32 whatever the gradients' dtype (a 16-bit gradient from a run without the plugin is upcast,
not normed in 16 bits).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


@torch.no_grad()
def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Tensor]:
    """Each parameter's gradient norm and the total norm, keyed ``grad_{p}_norm{sep}{name}`` and
    ``grad_{p}_norm_total`` (``p`` printed as a float, e.g. ``grad_2.0_norm_total``), as Lightning's ``grad_norm``.

    Args:
        module: the module whose parameters' gradients are measured (a LightningModule in a hook).
        norm_type: a positive number, or ``"inf"`` for the largest magnitude.
        group_separator: what joins the key's prefix and the parameter name (loggers group on it).
    """
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        p = math.nan
    if not p > 0:
        raise ValueError(f"norm_type={norm_type!r} is not allowed: use a positive number or 'inf'.")
    named = [(name, param.grad) for name, param in module.named_parameters() if param.grad is not None]
    if not named:
        return {}
    grads = [g.float() if g.dtype != torch.float32 else g for _, g in named]
    grads = [g.coalesce()._values() if g.is_sparse else g for g in grads]
    norms = torch._foreach_norm(grads, p)
    out = {f"grad_{p}_norm{group_separator}{name}": n for (name, _), n in zip(named, norms)}
    out[f"grad_{p}_norm_total"] = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), p)
    return out
