"""Which parameters get an FP32 master and a 16-bit copy (:mod:`.master_weights`), chosen at each build.

=====================================================  ===========================================================
parameter                                              what it gets
=====================================================  ===========================================================
FP32, outside the FP32-kept subtrees                   a 16-bit copy; the Parameter is its master
trainable 16-bit (``model.half()``, a bf16 loader)     upcast to FP32 once (a warning: the bits lost stay lost),
                                                       then as above
frozen 16-bit, or lazy                                 nothing yet: looked at again when unfrozen or materialized
under a kept module (``keep_fp32``), parametrized,     no copy: the module computes from the FP32 Parameter
``nn.Embedding(max_norm=...)`` (renormalises in place)
float64, complex, integer                              nothing: trained as they are, as under Lightning's plugin
=====================================================  ===========================================================
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from lightning_mp.formats import HALF_DTYPES

Owners = list[tuple[nn.Module, list[tuple[str, nn.Parameter, int]]]]


@torch.no_grad()
def choose(roots: list[nn.Module], keep_fp32: Callable[[nn.Module], bool]
           ) -> tuple[list[nn.Parameter], dict[nn.Parameter, int], Owners, tuple[int, torch.dtype] | None]:
    """The converted parameters (each once, tied ones included), their slots, and per module that owns any its
    ``(name, Parameter, slot)`` entries (slot -1: lazy or frozen 16-bit, to be looked at again); and how many trainable
    16-bit parameters were upcast to FP32 here, with their dtype (``None`` if none)."""
    kept: set[nn.Parameter] = set()
    for root in roots:
        for mod in root.modules():
            if keep_fp32(mod) or isinstance(mod, nn.utils.parametrize.ParametrizationList):
                # the whole subtree computes in FP32; parametrizations compute from FP32 originals
                kept.update(mod.parameters())
            elif isinstance(mod, nn.Embedding) and mod.max_norm is not None:
                kept.update(mod.parameters(recurse=False))  # renormalises its weight in place in forward
    params: list[nn.Parameter] = []
    slot: dict[nn.Parameter, int] = {}
    owners: Owners = []
    upcast, upcast_dtype = 0, None
    for root in roots:
        for mod in root.modules():
            own = []
            for name, p in mod._parameters.items():
                # a plain tensor in a Parameter's place: torch.func.functional_call's, for one call
                if not isinstance(p, nn.Parameter) or not (is_lazy(p) or p.is_floating_point()):
                    continue
                if p in kept:
                    if p.dtype in HALF_DTYPES and p.requires_grad and not is_lazy(p):
                        upcast, upcast_dtype = upcast + 1, p.dtype  # trains on FP32 values, no copy
                        p.data = p.data.float()
                    continue
                if is_lazy(p) or (p.dtype in HALF_DTYPES and not p.requires_grad):
                    own.append((name, p, -1))  # re-examined when materialized or unfrozen
                    continue
                if p.dtype in HALF_DTYPES:
                    upcast, upcast_dtype = upcast + 1, p.dtype
                    p.data = p.data.float()
                if p.dtype != torch.float32:
                    continue  # float64: the user's explicit choice, trained as it is
                if p not in slot:
                    slot[p] = len(params)
                    params.append(p)
                own.append((name, p, slot[p]))
            if own:
                owners.append((mod, own))
    return params, slot, owners, ((upcast, upcast_dtype) if upcast else None)


def warn_upcast(count: int, dtype: torch.dtype) -> None:
    warnings.warn(
        f"{count} trainable parameters were already in {dtype} before fit: their FP32 masters start from the "
        "16-bit values, so the bits lost in that cast stay lost. HINT: build or load the model in FP32 and "
        "let MixedPrecisionPlugin make the 16-bit copies (frozen 16-bit parameters stay 16-bit).",
        stacklevel=4,
    )
