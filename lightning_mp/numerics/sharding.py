"""FSDP2 (``fully_shard``, Lightning's ``ModelParallelStrategy``): what the plugin does differently there.

Under FSDP2 each rank holds an FP32 shard of every parameter (a ``DTensor``); FSDP all-gathers them into the
compute dtype of its ``MixedPrecisionPolicy`` for the forward and backward, and reduce-scatters the gradients in
``reduce_dtype`` back onto the FP32 shards. The FP32 shards are therefore already the masters: the plugin makes
no 16-bit copies of its own and leaves the casts to FSDP (:func:`fsdp_mp_policy` gives the policy that matches
the plugin's format, with FP32 gradient reduction). What the plugin adds is what FSDP2 has no answer for: loss
scaling for fp16, the non-finite guard (unscale and check on the local shards, the flag agreed across ranks with
MAX, so every rank skips the same steps), the FP32 op policy, the schedule guard and the monitors.

Supported: every trainable floating parameter sharded by ``fully_shard`` on a 1-D mesh (``Shard(0)``).
Tensor-parallel placements and parameters left out of ``fully_shard`` are refused with an error at setup.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

try:  # torch >= 2.5; 2.4 had it under the private path
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover
    from torch.distributed._tensor import DTensor, Shard  # type: ignore[no-redef]


def fsdp_mp_policy(dtype: torch.dtype):
    """``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)`` for ``fully_shard``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def local(t: Tensor) -> Tensor:
    """This rank's shard of a ``DTensor`` (a view: writing it writes the shard); any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def like(p: Tensor, shard: Tensor) -> Tensor:
    """``shard`` as ``p``'s local shard: a DTensor with ``p``'s mesh, placements, shape and strides over the same
    storage (no communication), when ``p`` is a DTensor; ``shard`` itself otherwise."""
    if not isinstance(p, DTensor):
        return shard
    return DTensor.from_local(shard, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def assign(p: nn.Parameter, shard: Tensor) -> None:
    """``p`` (the same object) now holds ``shard``, as its local shard under FSDP2. A DTensor's ``.data`` setter
    changes the wrapper's dtype but not the local tensor it wraps, so a DTensor's contents are swapped with a fresh
    Parameter's (``torch.utils.swap_tensors``, which refuses a Parameter with a pending gradient)."""
    if isinstance(p, DTensor):
        torch.utils.swap_tensors(p, nn.Parameter(like(p, shard), requires_grad=p.requires_grad))
    else:
        p.data = shard


def _fsdp_groups(module: nn.Module) -> list[tuple[str, object]]:
    """(module name, FSDP2 parameter group) for each group under ``module``, checked for the internals used here."""
    from torch.distributed.fsdp import FSDPModule

    lacks = RuntimeError(f"torch {torch.__version__}'s fully_shard lacks the internals master_weights='compensated' "
                         "uses to change the shards' dtype. HINT: master_weights=None under FSDP2.")
    found: dict[int, tuple[str, object]] = {}
    for name, m in module.named_modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            if hasattr(state, "_fsdp_param_groups"):  # torch 2.13: a list (fully_shard of several modules at once)
                groups = state._fsdp_param_groups
            elif hasattr(state, "_fsdp_param_group"):  # torch 2.11: one group or None
                groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
            else:  # finding no group would skip the dtype check and the reload silently
                raise lacks
            for group in groups:
                found.setdefault(id(group), (name or "the root", group))
    for _, group in found.values():
        if not (hasattr(group, "_init_mp_dtypes") and hasattr(group, "mp_policy")
                and all(hasattr(fp, "reset_sharded_param") for fp in group.fsdp_params)):
            raise lacks
    return list(found.values())


def require_gather_dtype(module: nn.Module, dtype: torch.dtype) -> None:
    """Raise unless every ``fully_shard`` group gathers in ``dtype``: FSDP2 makes its gather buffers and unsharded
    parameters once, at the first gather, in that dtype, so shards whose dtype changes later must gather in one
    dtype before and after."""
    for name, group in _fsdp_groups(module):
        if group.mp_policy.param_dtype != dtype:
            raise ValueError(
                f"fully_shard of {name!r} with mp_policy.param_dtype={group.mp_policy.param_dtype!r} is not allowed "
                f"with master_weights='compensated': the shards are {dtype} during the fit and FP32 after it, and "
                f"FSDP2 keeps the buffers of its first gather, so it must gather in {dtype} throughout. HINT: "
                "fully_shard(..., mp_policy=plugin.fsdp_mp_policy()) on every module."
            )


def reload_shards(module: nn.Module) -> None:
    """After sharded Parameters' ``.data`` changed dtype, make ``fully_shard`` re-read them: re-register each local
    shard and re-derive the dtypes it all-gathers and reduces in. FSDP2 does both at its first forward (it allows dtype
    changes until then) and the first in its own ``_apply``; that path swaps tensors and refuses Parameters an
    optimizer already holds, so this calls the two steps directly. They are torch internals, checked here."""
    for _, group in _fsdp_groups(module):
        for fsdp_param in group.fsdp_params:
            fsdp_param.reset_sharded_param()
        group._init_mp_dtypes()


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` sharded this module; raises ``ValueError`` for layouts the plugin cannot handle."""
    sharded, plain = [], []
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            sharded.append((name, p))
        elif p.requires_grad and p.is_floating_point():
            plain.append(name)
    if not sharded:
        return False
    if plain:
        raise ValueError(
            f"{len(plain)} trainable parameters are not sharded by fully_shard ({', '.join(plain[:3])}"
            f"{', ...' if len(plain) > 3 else ''}), beside {len(sharded)} sharded ones. MixedPrecisionPlugin supports "
            "FSDP2 when every trainable parameter is sharded. HINT: call fully_shard(self) on the whole "
            "LightningModule at the end of configure_model, after the per-layer calls."
        )
    for name, p in sharded:
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise ValueError(
                f"parameter {name!r} has placements {tuple(p.placements)!r} on a {p.device_mesh.ndim}-D mesh; "
                "MixedPrecisionPlugin supports FSDP2's Shard(0) on a 1-D data-parallel mesh only (no tensor "
                "parallelism, no HSDP). HINT: use ModelParallelStrategy(tensor_parallel_size=1) and fully_shard "
                "on the 'data_parallel' mesh."
            )
    return True
