"""Lean bf16: bf16 parameters for good, each with an exact 16-bit remainder, stepped on rebuilt FP32 values.

The split works on the int32 patterns: ``hi`` is the bf16 nearest of ``x`` and ``lo = bits(x) - bits(hi)`` the
signed remainder, so ``bits(hi) * 2^16 + lo`` is ``x`` bit for bit. Rounding to nearest keeps ``lo`` in [-2^15, 2^15],
which fits int16 except at exact ties; ties therefore round away from zero, the one case where ``hi`` differs from
``x.to(torch.bfloat16)`` (ties to even; both are half an ulp away). No 16-bit remainder can serve ties to even: an
even ``hi`` owns 2^16 + 1 FP32 patterns and int16 has 2^16 values. On patterns the rule holds across binades (the
mantissa's carry steps the exponent), for subnormals and both zeros, and at the top: values past the largest bf16
round to inf as torch's cast does, and their ``lo`` in [-2^15, 0] still rebuilds the finite value. inf rebuilds
inf; NaN rebuilds NaN (``hi`` is the canonical NaN: sign and payload are not kept).

The trap (Apex hit it): keeping the truncated upper half as the model's value biases every weight by up to an ulp
towards zero. The forward must read the nearest bf16 of the master.

Why not a bf16 Kahan term: it keeps only ~16 significant bits of what was lost, so errors still accumulate.
Simulated, 50 SGD steps of 1e-4 on 1.0 end 1.8e-5 off and 5000 steps 2.8e-3 off; the remainder is exact in the same
2 bytes, and the rebuilt masters follow an FP32 run bit for bit.

:class:`CompensatedStep` runs a user's optimizer on FP32 values, ``bucket_bytes`` of FP32 at a time: it rebuilds the
bucket's masters into a scratch buffer, upcasts the bf16 gradients beside them, points ``p.data`` and ``p.grad``
there, restricts the param groups to the bucket, calls ``optimizer.step()``, splits the results back into ``p.data``
and the remainders, and restores the bf16 gradients. The Parameter objects stay, so state keyed by them keeps
working, and state made on the first step (``zeros_like(p)``) is FP32. Cost: one extra read and write of each
parameter and gradient per step, about 10 launches per bucket, and 8 B of FP32 scratch per bucket element (more with
bf16 state), allocated per step (CUDA's caching allocator hands back the same blocks). ``step()`` runs once per
bucket: step hooks fire per bucket (torch.optim counts steps per parameter). Checkpoints must keep ``remainders``
(in no state_dict); a write to a bf16 parameter elsewhere keeps the old remainder: master = new value +- half an ulp.

Live bytes per parameter under AdamW (measured in the tests): bf16 parameter 2 + remainder 2 + bf16 gradient 2 +
FP32 state 8 = 14 (FP32 masters with 16-bit copies: 4 + 2 + 4 + 8 = 18); with ``optimizer_state_dtype=torch.bfloat16``
2 + 2 + 2 + 4 = 10, the state written back by :func:`stochastic_round_` (unbiased: small moment updates survive on
average). Tested with AdamW, Adam (for-loop and ``foreach=True``) and SGD with momentum 0.9, all ``fused=False``.

Under FSDP2 the parameters are DTensors: the remainders, buckets and scratch cover each rank's local shards, and the
optimizer steps DTensor stand-ins over the scratch, so its state is sharded as FSDP2 shards it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from lightning_mp.numerics.sharding import assign, like, local
from lightning_mp.validation import check_int

_BF16 = torch.bfloat16
_BF16_MAX = torch.finfo(_BF16).max
_CANONICAL_NAN = 0x7FC0  # the bf16 quiet NaN, as an int16 pattern


def _check(*args: tuple[str, object, torch.dtype]) -> None:
    """Each ``(name, tensor, dtype)`` a tensor of its dtype, all of one shape."""
    for name, t, dtype in args:
        if not isinstance(t, Tensor) or t.dtype != dtype:
            got = f"dtype={t.dtype}" if isinstance(t, Tensor) else f"type {type(t).__name__}"
            raise ValueError(f"{name} with {got} is not allowed: use a {dtype} tensor.")
    if len({t.shape for _, t, _ in args}) > 1:
        shapes = ", ".join(f"{name}={tuple(t.shape)}" for name, t, _ in args)
        raise ValueError(f"shapes {shapes} are not allowed: use one shape for all.")


def _split_consume(bits: Tensor, lo: Tensor, his: list[Tensor]) -> None:
    """Split the int32 patterns ``bits`` (overwritten) into the remainders ``lo`` (same shape) and the int16
    patterns ``his``, which cover ``bits`` in order."""
    lo.copy_(bits)  # the low 16 bits read as signed: bits - hi * 2^16 for the hi below
    nan = bits.view(torch.float32).isnan()
    # (bits + 2^15) >> 16 rounds the magnitude half away from zero; a NaN's carry may wrap, so those are replaced
    bits.add_(0x8000).bitwise_right_shift_(16).masked_fill_(nan, _CANONICAL_NAN)
    torch._foreach_copy_(his, [v.view(h.shape) for v, h in zip(bits.reshape(-1).split([h.numel() for h in his]), his)])


def _rebuild_into(bits: Tensor, his: list[Tensor], lo: Tensor) -> None:
    """``bits`` (int32, covering ``his`` in order) = hi * 2^16 + lo."""
    parts = [bits] if len(his) == 1 else bits.split([h.numel() for h in his])  # one: any strides; several: flat
    torch._foreach_copy_([v.view(h.shape) for v, h in zip(parts, his)], his)  # int16 -> int32 sign-extends
    bits.bitwise_left_shift_(16).add_(lo)


def split_(x: Tensor, hi_out: Tensor, lo_out: Tensor) -> tuple[Tensor, Tensor]:
    """Write the bf16 nearest (ties away from zero) of the FP32 ``x`` into ``hi_out`` and its exact int16 remainder
    into ``lo_out``. Allocates one int32 copy of ``x`` and a bool NaN mask (the bucket path works in its scratch)."""
    _check(("x", x, torch.float32), ("hi_out", hi_out, _BF16), ("lo_out", lo_out, torch.int16))
    _split_consume(x.view(torch.int32).clone(), lo_out, [hi_out.view(torch.int16)])
    return hi_out, lo_out


def split(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(hi, lo)``: bf16 nearest of the FP32 ``x`` and the int16 remainder; ``rebuild(hi, lo)`` is ``x``."""
    _check(("x", x, torch.float32))
    return split_(x, torch.empty_like(x, dtype=_BF16), torch.empty_like(x, dtype=torch.int16))


def rebuild(hi: Tensor, lo: Tensor, out: Tensor | None = None) -> Tensor:
    """The FP32 value ``hi + remainder``: exact for pairs made by :func:`split`; any NaN ``hi`` gives NaN."""
    _check(("hi", hi, _BF16), ("lo", lo, torch.int16))
    out = torch.empty_like(hi, dtype=torch.float32) if out is None else out
    _check(("hi", hi, _BF16), ("lo", lo, torch.int16), ("out", out, torch.float32))
    _rebuild_into(out.view(torch.int32), [hi.view(torch.int16)], lo)
    return out


def stochastic_round_(x: Tensor, out: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Round FP32 ``x`` into bf16 ``out``, up with probability (low 16 bits) / 2^16. Adding a uniform integer in
    [0, 2^16) to the pattern and truncating carries into the upper half with exactly that probability, and between
    two neighbouring bf16 values (across a binade boundary too) the value is linear in the pattern, so the mean is
    ``x``: unbiased. bf16 values come back unchanged. Finite stays finite (a carry past the largest bf16 is clamped,
    the only bias); inf and NaN stay. Allocates an int32 draw, a mask and an FP32 temporary the size of ``x``."""
    _check(("x", x, torch.float32), ("out", out, _BF16))
    r = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    r.add_(x.view(torch.int32)).bitwise_right_shift_(16)  # a NaN may wrap: replaced below
    out.view(torch.int16).copy_(r)
    out.clamp_(-_BF16_MAX, _BF16_MAX)
    out.copy_(torch.where(x.isfinite(), out, x))
    return out


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
        self._buckets: list[tuple[list[nn.Parameter], Tensor]] = []  # (params, their span of the remainder buffer)
        for device in dict.fromkeys(p.device for p in self.params):
            ps = [p for p in self.params if p.device == device]
            shards = [local(p.detach()) for p in ps]  # FSDP2: this rank's shard
            flat = torch.zeros(sum(x.numel() for x in shards), dtype=torch.int16, device=device)
            start, end, bucket = 0, 0, []
            for p, x in zip(ps, shards):
                if bucket and (end - start + x.numel()) * 4 > bucket_bytes:
                    self._buckets.append((bucket, flat[start:end]))
                    start, bucket = end, []
                self.remainders[p] = flat[end:end + x.numel()].view(x.shape)
                end += x.numel()
                bucket.append(p)
                if p.dtype == torch.float32:  # (a sharded module's FSDP state must re-read it: sharding.reload_shards)
                    assign(p, split_(x.contiguous(), torch.empty_like(x, dtype=_BF16), self.remainders[p])[0])
            self._buckets.append((bucket, flat[start:end]))

    def master(self, p: nn.Parameter) -> Tensor:
        """The FP32 master of ``p`` (a new tensor; sharded as ``p`` is)."""
        return like(p, rebuild(local(p.detach()), self.remainders[p]))

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
            for bucket, lo in self._buckets:
                if any(p.grad is not None and p in members for p in bucket):
                    self._step_bucket(optimizer, groups, bucket, lo, members)
            others = {p for ps in groups for p in ps if p not in self.remainders and p.grad is not None}
            if others:
                for g, ps in zip(optimizer.param_groups, groups):
                    g["params"] = [p for p in ps if p in others]
                optimizer.step()
        finally:
            for g, ps in zip(optimizer.param_groups, groups):
                g["params"] = ps

    def _step_bucket(self, optimizer, groups, bucket: list[nn.Parameter], lo: Tensor, members: set) -> None:
        n = lo.numel()
        scratch = torch.empty(2 * n, dtype=torch.float32, device=lo.device)
        bits = scratch[:n].view(torch.int32)
        his = [local(p.detach()).view(torch.int16) for p in bucket]  # FSDP2: the shards (views: writes land there)
        sizes = [h.numel() for h in his]
        values = [v.view(h.shape) for v, h in zip(scratch[:n].split(sizes), his)]
        grads = [v.view(h.shape) for v, h in zip(scratch[n:].split(sizes), his)]
        _rebuild_into(bits, his, lo)
        stepped = [i for i, p in enumerate(bucket) if p.grad is not None and p in members]
        torch._foreach_copy_([grads[i] for i in stepped], [local(bucket[i].grad) for i in stepped])  # exact upcast
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
            _split_consume(bits, lo, his)
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

