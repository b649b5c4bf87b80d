"""The collectives mixed precision needs under data parallelism.

* The overflow decision must be the same on every rank, or ranks skip different steps and their weights drift
  apart. DDP's gradient averaging usually spreads an inf to every rank, but not always (a NaN can be produced
  after the all-reduce, locally, and sharded gradients never see the others), so the flag is agreed explicitly:
  an all-reduce with MAX of one float per step, as Megatron, DeepSpeed and torch's ShardedGradScaler do. Where the
  step checks the FP32 gradients right after averaging them itself (below), every rank checks the same values and
  finds the same flag: no collective of its own there (:mod:`lightning_mp.numerics.step`).
* Gradient averaging with master weights: DDP would average each micro-batch's 16-bit gradients (a bf16 sum
  keeps 8 significant bits, and under ``no_sync`` accumulation only the last micro-batch would be averaged once
  its gradient is folded into the FP32 master). Instead DDP's own sync is switched off and the FP32 master
  gradients are averaged once per optimizer step, after all micro-batches, as Megatron reduces its FP32
  ``main_grad``. Cost: an all-reduce of 4 bytes per parameter per step, in place on the flat FP32 gradient
  buffer, not overlapped with the backward pass.
* The autopilots' decisions (``fp32_modules="auto"``, ``fp8_modules="auto"``): a module one rank moves to FP32, or
  keeps out of FP8, must do so on every rank, or the ranks' gradient buffers stop matching (DDP: the next all-reduce
  aborts or hangs) or compute in different precisions (FSDP2). Both agree through :func:`agree_on_decisions`, the
  same MAX all-reduce as the overflow flag on a table of what each rank measured (what each table holds and its cost:
  :mod:`lightning_mp.core.agreement`, :mod:`lightning_mp.fp8.autopilot`).
"""

from __future__ import annotations

import math
from operator import attrgetter
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agree_on_max_(values: Tensor) -> Tensor:
    """All ranks end with each element's largest value over the ranks (in place); a no-op in a single process."""
    if world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def agree_on_overflow_(found_inf: Tensor) -> Tensor:
    """All ranks end with the largest flag of any rank (in place); a no-op in a single process."""
    return agree_on_max_(found_inf)


def rank() -> int:
    """This process's rank (0 in one process)."""
    return dist.get_rank() if world_size() > 1 else 0


@torch.no_grad()
def agree_on_decisions(table: Tensor, device: torch.device) -> Tensor:
    """The autopilots' one collective: ``table`` (what this rank measured, a row per module in an order every rank
    shares, larger meaning worse) comes back on the host holding each element's largest value over the ranks, so
    every rank takes the same decisions at the same step. ``device``: the model's (NCCL reduces device tensors only;
    on CUDA the read back is a host sync). In one process: ``table`` itself, no collective and no copy.

    A NaN goes in as +inf: MAX compares it false against any number, so a backend would keep or drop a rank's NaN
    depending on the order it combines the ranks in, and every rank must see the worst."""
    if world_size() == 1:
        return table
    table = table.masked_fill(table.isnan(), math.inf).to(device)
    return agree_on_max_(table).cpu()


@torch.no_grad()
def average_across_ranks_(tensors: list[Tensor]) -> None:
    """Replace each tensor by its mean over ranks (SUM then divide: gloo has no AVG). Every rank ends with the same
    values (an all-reduce hands every rank the same result: DDP's replicas rely on it too), so a check of them gives
    the same inf/NaN flag on every rank (``same_on_every_rank``: the step skips the flag's own agreement).

    Few elements in all (at most :data:`CONCAT_BELOW`, one dtype and device): one concatenated all-reduce, however
    many tensors; a collective costs the training thread 15-75 us of CPU time (gloo), the copies next to nothing.
    Otherwise, tensors that tile one buffer back to back (the FP32 gradients
    :class:`lightning_mp.numerics.master_weights.MasterWeights` folds into one flat buffer per step) are all-reduced
    in place, as one run per buffer: no concatenated copy (+4 B per parameter at the peak) and no copy back. What is
    left (gradients autograd allocated for FP32 parameters, zeros for missing ones) goes through one concatenated
    all-reduce.
    """
    n = world_size()
    if n == 1 or not tensors:
        return
    if len(tensors) > 1 and sum(map(Tensor.numel, tensors)) <= CONCAT_BELOW and _one_kind(tensors):
        flat = _flatten_dense_tensors(tensors)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(n)
        torch._foreach_copy_(tensors, _unflatten_dense_tensors(flat, tensors))
        return
    rest = []
    for run in contiguous_runs(tensors):
        if len(run) == 1:
            rest.append(run[0])
            continue
        flat = run_view(run)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(n)
    if not rest:
        return
    flat = torch.cat([t.reshape(-1) for t in rest])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat.div_(n)
    offset = 0
    for t in rest:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


average_across_ranks_.same_on_every_rank = True  # type: ignore[attr-defined]
_DTYPE, _DEVICE = attrgetter("dtype"), attrgetter("device")
CONCAT_BELOW = 1 << 16  # elements: below, one concatenated all-reduce (its copies a few microseconds)


def _one_kind(tensors: list[Tensor]) -> bool:
    return len(set(map(_DTYPE, tensors))) == 1 and len(set(map(_DEVICE, tensors))) == 1


def average_fp32_grads_per_step(model: Any, step: Any) -> list[Any]:
    """Under DDP with master weights: autograd differentiates the 16-bit copies, not DDP's Parameters, so DDP's
    reducer must never wait for them; ``step`` averages the FP32 gradients once per step instead. Lightning turns the
    flag back on after every manual-optimization ``training_step``, so it goes off before every DDP forward (and so
    before Lightning's ``prepare_for_backward`` in ``manual_backward``). Returns the hook handles."""
    if not hasattr(model, "require_backward_grad_sync") or world_size() <= 1:
        return []
    model.require_backward_grad_sync = False
    step.reduce_ = average_across_ranks_
    return [model.register_forward_pre_hook(_no_ddp_grad_sync)]


def _no_ddp_grad_sync(ddp: Any, args: Any) -> None:
    ddp.require_backward_grad_sync = False


def contiguous_runs(tensors: list[Tensor]) -> list[list[Tensor]]:
    """Split ``tensors`` (in order) into runs of contiguous tensors that follow each other in one storage."""
    runs: list[list[Tensor]] = []
    end = None  # (storage pointer, dtype, device, offset where the current run ends)
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.dtype, t.device) if t.is_contiguous() else None
        if key is not None and end is not None and end == (*key, t.storage_offset()):
            runs[-1].append(t)
        else:
            runs.append([t])
        end = (*key, t.storage_offset() + t.numel()) if key is not None else None
    return runs


def run_view(run: list[Tensor]) -> Tensor:
    """A 1-D view covering a run from :func:`contiguous_runs` (writing it writes the tensors)."""
    first = run[0]
    if len(run) == 1:
        return first.reshape(-1)
    return first.as_strided((sum(t.numel() for t in run),), (1,), first.storage_offset())
