"""Lean bf16: bf16 parameters for good, each with an exact 16-bit remainder and a tie bit, stepped on rebuilt FP32
values.

The split itself (``hi``, the int16 remainder ``lo`` and the tie bit that rebuild the FP32 master bit for bit, why
the forward must read the nearest bf16, why not a bf16 Kahan term) and stochastic rounding are
:mod:`lightning_mp.numerics.split`.

:class:`CompensatedStep` runs a user's optimizer on FP32 values, ``bucket_bytes`` of FP32 at a time: it rebuilds the
bucket's masters into a scratch buffer, upcasts the bf16 gradients beside them, points ``p.data`` and ``p.grad``
there, restricts the param groups to the bucket, calls ``optimizer.step()``, splits the results back into ``p.data``
and the remainders, and restores the bf16 gradients. An FP32 gradient (a bf16 Parameter may hold one: lean.py sums
micro-batches and clips in FP32) is read in place. The Parameter objects stay, so state keyed by them keeps working,
and state made on the first step (``zeros_like(p)``) is FP32. Cost: one extra read and write of each parameter and
gradient per step, about 40 launches per bucket (10 without tie bits), and 8 B of FP32 scratch per bucket element
(more with bf16 state), allocated per step (CUDA's caching allocator hands back the same blocks). On one CPU core
(AVX512, thread time) the split and rebuild take 6.0 and 3.1 ms per 2^20 elements (3.1 and 1.3 without tie bits),
an AdamW step over 4M elements 66 ms (39), and a GPT-2 of 4 x 256 trains 2% slower per step for the tie bits.
``step()`` runs once per bucket: step hooks fire per bucket (torch.optim counts steps per parameter). Checkpoints
must keep ``remainders`` and ``ties`` (in no state_dict); a write to a bf16 parameter elsewhere keeps the old
remainder: master = new value +- half an ulp.

Live bytes per parameter under AdamW (measured in the tests): bf16 parameter 2 + remainder 2 + tie bit 0.125 + bf16
gradient 2 + FP32 state 8 = 14.125 (FP32 masters with 16-bit copies: 4 + 2 + 4 + 8 = 18); with
``optimizer_state_dtype=torch.bfloat16`` 2 + 2 + 0.125 + 2 + 4 = 10.125, the state written back by
:func:`stochastic_round_` (unbiased: small moment updates survive on average). Tested with AdamW, Adam (for-loop and
``foreach=True``) and SGD with momentum 0.9, all ``fused=False``.

Under FSDP2 the parameters are DTensors: the remainders, buckets and scratch cover each rank's local shards, and the
optimizer steps DTensor stand-ins over the scratch, so its state is sharded as FSDP2 shards it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from lightning_mp.numerics.sharding import assign, like, local
from lightning_mp.numerics.split import _BF16, _rebuild_into, _split_consume, rebuild, split, split_, stochastic_round_
from lightning_mp.validation import check_int


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _float_state(state: dict, p: Tensor) -> list[str]:
    """Keys of the per-element floating state of ``p`` (moments, momentum); not step counters."""
    return [k for k, v in state.items() if k != "step" and isinstance(v, Tensor) and v.is_floating_point()
            and v.shape == p.shape]


class CompensatedStep:
    """Own int16 remainders for bf16 Parameters and step an optimizer on their FP32 masters, bucket by bucket.

    Args:
        params: the Parameters (bf16 ones start with a zero remainder; FP32 ones are split once, exactly, into a bf16
            ``.data`` and their remainder).
        bucket_bytes: FP32 bytes rebuilt at a time (a larger parameter makes a bucket of its own).
        optimizer_state_dtype: ``torch.float32``, or ``torch.bfloat16`` to keep per-element floating state in bf16
            between steps (upcast for the step, stochastically rounded back).
        generator: for the stochastic rounding (``None``: the device's default generator).
    """

    def __init__(self, params: Iterable[nn.Parameter], bucket_bytes: int = 32 << 20,
                 optimizer_state_dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None) -> None:
        check_int("bucket_bytes", bucket_bytes, low=4)
        if optimizer_state_dtype not in (torch.float32, _BF16):
            raise ValueError(f"optimizer_state_dtype={optimizer_state_dtype!r} is not allowed: use torch.float32 or "
                             "torch.bfloat16.")
        self.params = list(dict.fromkeys(params))  # a tied Parameter once
        for p in self.params:
            if not isinstance(p, nn.Parameter) or p.dtype not in (_BF16, torch.float32):
                raise ValueError(f"params holds {type(p).__name__} of {getattr(p, 'dtype', None)}, which is not "
                                 "allowed: use bf16 or FP32 nn.Parameters. HINT: keep other parameters out of params; "
                                 "the optimizer steps them as they are.")
        self.state_dtype, self.generator = optimizer_state_dtype, generator
        self.remainders: dict[nn.Parameter, Tensor] = {}
        self.ties: dict[nn.Parameter, Tensor] = {}  # tie bits, packed; each parameter's span starts on a byte
        # (params, their offsets in the span, their span of the remainder buffer, its tie bits)
        self._buckets: list[tuple[list[nn.Parameter], list[int], Tensor, Tensor]] = []
        for device in dict.fromkeys(p.device for p in self.params):
            ps = [p for p in self.params if p.device == device]
            shards = [local(p.detach()) for p in ps]  # FSDP2: this rank's shard
            flat = torch.zeros(sum(_pad8(x.numel()) for x in shards), dtype=torch.int16, device=device)
            ties = torch.zeros(flat.numel() // 8, dtype=torch.uint8, device=device)
            start, end, bucket, offsets = 0, 0, [], []
            for p, x in zip(ps, shards):
                if bucket and (end - start + x.numel()) * 4 > bucket_bytes:
                    self._buckets.append((bucket, offsets, flat[start:end], ties[start // 8:end // 8]))
                    start, bucket, offsets = end, [], []
                self.remainders[p] = flat[end:end + x.numel()].view(x.shape)
                self.ties[p] = ties[end // 8:(end + x.numel() + 7) // 8]
                bucket.append(p)
                offsets.append(end - start)
                end += _pad8(x.numel())
                if p.dtype == torch.float32:  # (a sharded module's FSDP state must re-read it: sharding.reload_shards)
                    hi = torch.empty_like(x, dtype=_BF16)
                    assign(p, split_(x.contiguous(), hi, self.remainders[p], self.ties[p])[0])
            self._buckets.append((bucket, offsets, flat[start:end], ties[start // 8:end // 8]))

    def master(self, p: nn.Parameter) -> Tensor:
        """The FP32 master of ``p`` (a new tensor; sharded as ``p`` is)."""
        return like(p, rebuild(local(p.detach()), self.remainders[p], self.ties[p]))

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, closure: Callable | None = None) -> None:
        """``optimizer.step()`` on FP32 masters and gradients, one bucket at a time; parameters without a gradient are
        skipped as torch.optim skips them. Parameters of ``optimizer`` not owned here are stepped as they are."""
        if closure is not None:
            raise ValueError(f"closure={closure!r} is not allowed: buckets step separately, a closure would re-run "
                             "the forward per bucket. HINT: run the forward and backward first, then call step().")
        groups = [g["params"] for g in optimizer.param_groups]
        members = {p for ps in groups for p in ps}  # another optimizer's parameters are not this step's
        try:
            for bucket, offsets, lo, ties in self._buckets:
                if any(p.grad is not None and p in members for p in bucket):
                    self._step_bucket(optimizer, groups, bucket, offsets, lo, ties, members)
            others = {p for ps in groups for p in ps if p not in self.remainders and p.grad is not None}
            if others:
                for g, ps in zip(optimizer.param_groups, groups):
                    g["params"] = [p for p in ps if p in others]
                optimizer.step()
        finally:
            for g, ps in zip(optimizer.param_groups, groups):
                g["params"] = ps

    def _step_bucket(self, optimizer, groups, bucket: list[nn.Parameter], offsets: list[int], lo: Tensor,
                     ties: Tensor, members: set) -> None:
        n = lo.numel()  # each parameter's span padded to a multiple of 8 elements: its tie bits start on a byte
        his = [local(p.detach()).view(torch.int16) for p in bucket]  # FSDP2: the shards (views: writes land there)
        sizes = [h.numel() for h in his]
        stepped = [i for i, p in enumerate(bucket) if p.grad is not None and p in members]
        # bf16 gradients are upcast beside the values (exact); FP32 ones (summed over micro-batches, or clipped: see
        # lean.py) are read in place, as an optimizer over FP32 masters reads their .grad
        bf16_grads = [i for i in stepped if bucket[i].grad.dtype != torch.float32]
        scratch = torch.empty(n + sum(sizes[i] for i in bf16_grads), dtype=torch.float32, device=lo.device)
        bits = scratch[:n].view(torch.int32)
        values = [scratch[o:o + k].view(h.shape) for o, k, h in zip(offsets, sizes, his)]
        patterns = [bits[o:o + k].view(h.shape) for o, k, h in zip(offsets, sizes, his)]
        grads = {i: local(bucket[i].grad) for i in stepped}
        if bf16_grads:
            spans = scratch[n:].split([sizes[i] for i in bf16_grads])
            views = [v.view(his[i].shape) for v, i in zip(spans, bf16_grads)]
            torch._foreach_copy_(views, [grads[i] for i in bf16_grads])
            grads.update(zip(bf16_grads, views))
        _rebuild_into(bits, patterns, his, lo, ties)
        # FP32 stand-ins over the scratch (no copy) take the bf16 Parameters' place in the groups and their state for
        # the step. The Parameters themselves are never re-pointed: a .data of another dtype would reset their
        # gradient accumulator, and with it the hooks DDP's reducer keeps there. Under FSDP2 they are DTensors over
        # the scratch (no communication), so the optimizer's state is sharded as FSDP2 shards it.
        proxies: dict[nn.Parameter, nn.Parameter] = {}
        for i in stepped:
            p = bucket[i]
            proxy = proxies[p] = nn.Parameter(like(p, values[i]), requires_grad=p.requires_grad)
            proxy.grad = like(p, grads[i])
        state, keys, parts, upcast = optimizer.state, [], [], None
        try:
            for p, proxy in proxies.items():
                if p in state:
                    state[proxy] = state.pop(p)
            for gr, ps in zip(optimizer.param_groups, groups):
                gr["params"] = [proxies[p] for p in ps if p in proxies]
            keys = [(q, k) for q in proxies.values() for k in _float_state(state[q], q)
                    if state[q][k].dtype != torch.float32]
            if keys:  # bf16 state (ours, or cast by load_state_dict): FP32 for the step, in one scratch
                old = [local(state[q][k]) for q, k in keys]
                upcast = torch.empty(sum(t.numel() for t in old), dtype=torch.float32, device=lo.device)
                parts = [v.view(t.shape) for v, t in zip(upcast.split([t.numel() for t in old]), old)]
                torch._foreach_copy_(parts, old)
                for (q, k), v in zip(keys, parts):
                    state[q][k] = like(q, v)
                parts = [state[q][k] for q, k in keys]
            optimizer.step()
        finally:
            for p, proxy in proxies.items():
                if proxy in state:
                    state[p] = state.pop(proxy)
            _split_consume(bits, lo, ties, patterns, his)
        if self.state_dtype != _BF16:
            return
        # the bucket's FP32 state, stochastically rounded into one bf16 buffer (a view per tensor); in the steady
        # state it is the upcast scratch itself, on the first step the optimizer's fresh tensors are gathered
        keys = [(bucket[i], k) for i in stepped for k in _float_state(state[bucket[i]], bucket[i])]
        tensors = [state[p][k] for p, k in keys]
        if tensors:
            same = len(tensors) == len(parts) and all(t is v for t, v in zip(tensors, parts))
            tensors = [local(t) for t in tensors]
            flat = upcast if same else torch.cat([t.reshape(-1) for t in tensors])
            out = stochastic_round_(flat, torch.empty_like(flat, dtype=_BF16), self.generator)
            for (p, k), v, t in zip(keys, out.split([t.numel() for t in tensors]), tensors):
                state[p][k] = like(p, v.view(t.shape))


__all__ = ["CompensatedStep", "rebuild", "split", "split_", "stochastic_round_"]  # the split's, re-exported
