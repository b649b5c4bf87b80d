"""The two collectives mixed precision needs under data parallelism.

* The overflow decision must be the same on every rank, or ranks skip different steps and their weights drift
  apart. DDP's gradient averaging usually spreads an inf to every rank, but not always (a NaN can be produced
  after the all-reduce, locally, and sharded gradients never see the others), so the flag is agreed explicitly:
  an all-reduce with MAX of one float per step, as Megatron, DeepSpeed and torch's ShardedGradScaler do.
* Gradient averaging with master weights: DDP would average each micro-batch's 16-bit gradients (a bf16 sum
  keeps 8 significant bits, and under ``no_sync`` accumulation only the last micro-batch would be averaged once
  its gradient is folded into the FP32 master). Instead DDP's own sync is switched off and the FP32 master
  gradients are averaged once per optimizer step, after all micro-batches, as Megatron reduces its FP32
  ``main_grad``. Cost: one flattened all-reduce of 4 bytes per parameter per step, not overlapped with the
  backward pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agree_on_overflow_(found_inf: Tensor) -> Tensor:
    """All ranks end with the largest flag of any rank (in place); a no-op in a single process."""
    if world_size() > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    return found_inf


@torch.no_grad()
def average_across_ranks_(tensors: list[Tensor]) -> None:
    """Replace each tensor by its mean over ranks, with one flattened all-reduce (SUM then divide: gloo has no AVG)."""
    n = world_size()
    if n == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat.div_(n)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
