"""The exact bf16 + int16 split of FP32 values, its tie bits, the rebuild, and stochastic rounding into bf16.

The split works on the int32 patterns: ``hi`` is ``x.to(torch.bfloat16)`` (round to nearest, ties to even) and
``lo = bits(x) - bits(hi) * 2^16`` the signed remainder, so ``bits(hi) * 2^16 + lo`` is ``x`` bit for bit. ``lo``
lies in [-2^15, 2^15], and int16 holds all of it but +2^15: an even ``hi`` owns 2^16 + 1 FP32 patterns (both ties),
one more than any 16-bit remainder can name. So each element also has a tie bit, set where a tie went down to the
even neighbour: its remainder is stored as -2^15 from the odd pattern above, and the rebuild is
``(bits(hi) + tie) * 2^16 + lo``. That costs 1 bit per element (0.125 B, padded to whole bytes per parameter) and
makes ``hi`` torch's cast on every pattern, so the forward reads what FP32 masters' 16-bit copies hold. Rounding half
away from zero instead (no tie bit) differed there: about 1 element in 2^17 per step, enough to change a stock
GPT-2's first or second loss. On patterns the rule holds across binades (the mantissa's carry steps the exponent),
for subnormals and both zeros, and at the top: values past the largest bf16 round to inf as torch's cast does, and
their ``lo`` in [-2^15, 0] still rebuilds the finite value. inf rebuilds inf; NaN rebuilds NaN (``hi`` is the
canonical NaN: sign and payload are not kept).

The trap (Apex hit it): keeping the truncated upper half as the model's value biases every weight by up to an ulp
towards zero. The forward must read the nearest bf16 of the master.

Why not a bf16 Kahan term: it keeps only ~16 significant bits of what was lost, so errors still accumulate.
Simulated, 50 SGD steps of 1e-4 on 1.0 end 1.8e-5 off and 5000 steps 2.8e-3 off; the remainder is exact in the same
2 bytes, and the rebuilt masters follow an FP32 run bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

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


def _check_ties(name: str, ties: Tensor, numel: int) -> None:
    if not isinstance(ties, Tensor) or ties.dtype != torch.uint8 or ties.shape != ((numel + 7) // 8,):
        got = f"dtype={ties.dtype}, shape={tuple(ties.shape)}" if isinstance(ties, Tensor) else type(ties).__name__
        raise ValueError(f"{name} with {got} is not allowed: use a 1-D torch.uint8 tensor of {(numel + 7) // 8} "
                         f"bytes (one bit per element, {numel} elements).")


# The passes below keep both operands of each elementwise op in one dtype (a mixed-dtype op takes TensorIterator's
# casting loop on a CPU, several times slower than the vectorized one), and pack and unpack the tie bits with shifts on
# int64 words, eight elements' bytes to a word, instead of broadcasting over the eight bits (4x slower on a CPU). The
# byte order of a word is little-endian, as on every device torch runs on.

def _pack_into(tie: Tensor, out: Tensor) -> None:
    """The 0/1 int32 ``tie`` (1-D) packed 8 to a byte into ``out``: element 8j + k is bit k of byte j."""
    t = tie.to(torch.uint8)
    if t.numel() % 8:
        t = torch.nn.functional.pad(t, (0, -t.numel() % 8))
    w = t.view(torch.int64)  # byte k of word j: element 8j + k, 0 or 1
    w = w.bitwise_or(w.bitwise_right_shift(7)).bitwise_and_(0x0003000300030003)
    w = w.bitwise_or_(w.bitwise_right_shift(14)).bitwise_and_(0x0000000F0000000F)
    out.copy_(w.bitwise_or_(w.bitwise_right_shift(28)).bitwise_and_(0xFF))


def _unpack(ties: Tensor) -> Tensor:
    """The tie bits as int32 0/1, one per element (8 per byte of ``ties``, padding included)."""
    w = ties.to(torch.int64)  # the inverse of _pack_into's gathering: bit k of the byte to byte k of the word
    w = w.bitwise_or(w.bitwise_left_shift(28)).bitwise_and_(0x0000000F0000000F)
    w = w.bitwise_or_(w.bitwise_left_shift(14)).bitwise_and_(0x0003000300030003)
    w = w.bitwise_or_(w.bitwise_left_shift(7)).bitwise_and_(0x0101010101010101)
    return w.view(torch.uint8).to(torch.int32)


def _split_consume(bits: Tensor, lo: Tensor, ties: Tensor, parts: list[Tensor], his: list[Tensor]) -> None:
    """Split the 1-D int32 patterns ``bits`` (overwritten) into the remainders ``lo`` (same shape), the tie bits
    ``ties`` (packed) and the int16 patterns ``his``, which ``parts`` (views of ``bits``) cover."""
    # a tie (low half 0x8000) above an even upper half (bit 16 clear) rounds half up to the odd pattern; torch's cast
    # keeps the even one below it, and the tie bit says that the remainder counts from the odd one
    tie = bits.bitwise_and(0x1FFFF).eq_(0x8000)
    lo.copy_(bits)  # the low 16 bits read as signed: bits - hi * 2^16 for the hi rounded half up
    nan = bits.view(torch.float32).isnan()
    # (bits + 2^15) >> 16 rounds the magnitude half away from zero; a NaN's carry may wrap, so those are replaced
    bits.add_(0x8000).bitwise_right_shift_(16).sub_(tie).masked_fill_(nan, _CANONICAL_NAN)
    _pack_into(tie, ties)  # (a NaN's tie bit is harmless: hi + 1 is NaN too)
    torch._foreach_copy_(his, parts)  # int32 -> int16 keeps the low 16 bits


def _rebuild_into(bits: Tensor, parts: list[Tensor], his: list[Tensor], lo: Tensor, ties: Tensor) -> None:
    """``bits`` (1-D int32, covered by ``parts`` where ``his`` go) = (hi + tie) * 2^16 + lo."""
    torch._foreach_copy_(parts, his)  # int16 -> int32 sign-extends
    bits.add_(_unpack(ties)[: bits.numel()]).bitwise_left_shift_(16).add_(lo.to(torch.int32))


def split_(x: Tensor, hi_out: Tensor, lo_out: Tensor, ties_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Write the bf16 nearest (ties to even, as ``x.to(torch.bfloat16)``) of the FP32 ``x`` into ``hi_out``, its int16
    remainder into ``lo_out`` and its tie bits (``ceil(numel / 8)`` bytes) into ``ties_out``. Allocates an int32 copy
    of ``x`` and a few temporaries of its size (the bucket path works in its scratch)."""
    _check(("x", x, torch.float32), ("hi_out", hi_out, _BF16), ("lo_out", lo_out, torch.int16))
    _check_ties("ties_out", ties_out, x.numel())
    bits = x.view(torch.int32).reshape(-1).clone()
    lo = torch.empty_like(bits, dtype=torch.int16)
    _split_consume(bits, lo, ties_out, [bits.view(x.shape)], [hi_out.view(torch.int16)])
    lo_out.copy_(lo.view(x.shape))
    return hi_out, lo_out, ties_out


def split(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(hi, lo, ties)``: bf16 nearest of the FP32 ``x``, the int16 remainder and the tie bits;
    ``rebuild(hi, lo, ties)`` is ``x``."""
    _check(("x", x, torch.float32))
    ties = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8, device=x.device)
    return split_(x, torch.empty_like(x, dtype=_BF16), torch.empty_like(x, dtype=torch.int16), ties)


def rebuild(hi: Tensor, lo: Tensor, ties: Tensor, out: Tensor | None = None) -> Tensor:
    """The FP32 value ``hi + remainder``: exact for triples made by :func:`split`; any NaN ``hi`` gives NaN."""
    _check(("hi", hi, _BF16), ("lo", lo, torch.int16))
    _check_ties("ties", ties, hi.numel())
    out = torch.empty_like(hi, dtype=torch.float32) if out is None else out
    _check(("hi", hi, _BF16), ("lo", lo, torch.int16), ("out", out, torch.float32))
    bits = out.view(torch.int32)
    bits.copy_(hi.view(torch.int16))  # sign-extends
    bits.add_(_unpack(ties)[: hi.numel()].view(hi.shape)).bitwise_left_shift_(16).add_(lo.to(torch.int32))
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


__all__ = ["rebuild", "split", "split_", "stochastic_round_"]
