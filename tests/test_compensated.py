"""Lean bf16 numerics without a Trainer: the exact bf16 + int16 split (ties to even, with tie bits), stochastic
rounding, optimizers stepped bucket by bucket on rebuilt FP32 masters, the live bytes per parameter, and the parity
guard."""

import copy
import math

import pytest
import torch
from torch import nn

from lightning_mp.numerics.compensated import CompensatedStep, rebuild, split, split_, stochastic_round_
from lightning_mp.numerics.parity import ParityGuard

BF16 = torch.bfloat16
BF16_EPS = 2.0**-8  # the format's relative spacing: ulp(x) = 2^(floor(log2 |x|) - 7)
I32 = torch.int32


def from_bits(patterns):
    """FP32 tensor with the given unsigned 32-bit patterns."""
    b = torch.as_tensor(patterns, dtype=torch.int64)
    return torch.where(b >= 2**31, b - 2**32, b).to(I32).view(torch.float32)


def bits(x):
    return x.view(I32)


def u8(n):
    return torch.zeros(n, dtype=torch.uint8)


def tie_bits(ties, n):
    """The packed tie bits as one bool per element."""
    return ((ties[:, None].to(I32) >> torch.arange(8)) & 1).reshape(-1)[:n].bool()


def check_split(x):
    """Split, then: rebuild is x bit for bit (NaN: NaN), hi is torch's cast (round to nearest, ties to even) and the
    tie bit is set exactly where a tie went down to an even upper half (a NaN's is free); returns hi's patterns."""
    hi, lo, ties = split(x)
    back = rebuild(hi, lo, ties)
    nan = x.isnan()
    assert torch.equal(bits(back)[~nan], bits(x)[~nan])
    assert back[nan].isnan().all() and hi[nan].isnan().all()
    got = hi.view(torch.int16)
    assert torch.equal(got[~nan], x.to(BF16).view(torch.int16)[~nan])
    upper, lower = (bits(x) >> 16) & 0xFFFF, bits(x) & 0xFFFF
    even_tie = (lower == 0x8000) & (upper % 2 == 0) & ~nan
    assert torch.equal(tie_bits(ties, x.numel())[~nan.reshape(-1)], even_tie.reshape(-1)[~nan.reshape(-1)])
    return got


def test_split_is_exact_for_every_upper_half_with_a_spread_of_lower_halves():
    g = torch.Generator().manual_seed(0)
    lowers = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF] + torch.randint(0, 1 << 16, (2,), generator=g).tolist())
    uppers = torch.arange(1 << 16)
    x = from_bits((uppers[:, None] << 16 | lowers[None, :]).reshape(-1))
    assert x.numel() == 8 * 2**16
    check_split(x)


def test_named_rows_keep_signs_subnormals_the_top_of_the_range_inf_and_nan():
    rows = {
        "+0": 0x00000000, "-0": 0x80000000, "smallest subnormal": 0x00000001, "largest subnormal": 0x007FFFFF,
        "smallest normal": 0x00800000, "largest finite": 0x7F7FFFFF, "-largest finite": 0xFF7FFFFF,
        "tie below bf16 max": 0x7F7F8000, "carry into 1.0": 0x3F7FFFFF, "-carry into -1.0": 0xBF7FFFFF,
        "tie, even upper": 0x3F808000, "tie, odd upper": 0x3F818000, "-tie, even upper": 0xBF808000,
        "tie, even upper below max": 0x7F7E8000, "tie into 1.0": 0x3F7F8000, "tie below 1.0": 0x3F7E8000,
        "tie to +0": 0x00008000, "tie to -0": 0x80008000, "inf": 0x7F800000, "-inf": 0xFF800000,
        "nan": 0x7FC00000, "nan, low payload": 0x7F800001, "-nan, top pattern": 0xFFFFFFFF,
    }
    x = from_bits(list(rows.values()))
    got = dict(zip(rows, (check_split(x).to(I32) & 0xFFFF).tolist()))
    assert got["+0"] == 0x0000 and got["-0"] == 0x8000  # the sign of zero survives
    assert got["smallest subnormal"] == 0x0000 and got["largest subnormal"] == 0x0080  # rounds up to the normal
    assert got["largest finite"] == 0x7F80 and got["-largest finite"] == 0xFF80  # inf, as torch's cast
    assert got["tie below bf16 max"] == 0x7F80 and got["tie, even upper below max"] == 0x7F7E  # odd 0x7F7F is max
    assert got["carry into 1.0"] == 0x3F80 and got["-carry into -1.0"] == 0xBF80  # into the next binade
    assert got["tie, even upper"] == 0x3F80 and got["tie, odd upper"] == 0x3F82  # ties to even
    assert got["-tie, even upper"] == 0xBF80  # to even on the magnitude: the sign does not matter
    assert got["tie into 1.0"] == 0x3F80 and got["tie below 1.0"] == 0x3F7E  # across the binade edge and below it
    assert got["tie to +0"] == 0x0000 and got["tie to -0"] == 0x8000  # a subnormal tie goes to a signed zero
    assert got["inf"] == 0x7F80 and got["-inf"] == 0xFF80


def test_split_into_preallocated_tensors_and_rebuild_into_out():
    x = torch.randn(3, 5) * 1e3
    x.view(I32)[0, :3] = (x.view(I32)[0, :3] & ~0x1FFFF) | 0x8000  # ties to an even upper half: tie bits 0 to 2
    hi, lo, ties = torch.empty(3, 5, dtype=BF16), torch.empty(3, 5, dtype=torch.int16), u8(2)
    out = torch.empty(3, 5)
    assert split_(x, hi, lo, ties)[0] is hi and rebuild(hi, lo, ties, out=out) is out
    assert torch.equal(bits(out), bits(x)) and torch.equal(hi, x.to(BF16)) and ties.tolist() == [0b111, 0]
    transposed = torch.empty(5, 3).t()  # a strided out is written in place
    assert torch.equal(bits(rebuild(hi, lo, ties, out=transposed)), bits(x))
    assert torch.equal(bits(rebuild(*split(x.t()))), bits(x.t()))  # a strided x: the tie bits follow its elements
    scalar = torch.tensor(0.1)
    assert torch.equal(bits(rebuild(*split(scalar))), bits(scalar))


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: split(torch.zeros(2, dtype=torch.float16)), "x"),
        (lambda: rebuild(torch.zeros(2, dtype=BF16), torch.zeros(2, dtype=torch.int32), u8(1)), "lo"),
        (lambda: rebuild(torch.zeros(9, dtype=BF16), torch.zeros(9, dtype=torch.int16), u8(1)), "ties"),  # 2 bytes
        (lambda: split_(torch.zeros(2), torch.zeros(3, dtype=BF16), torch.zeros(2, dtype=torch.int16), u8(1)),
         "shapes"),
        (lambda: stochastic_round_(torch.zeros(2), torch.zeros(2)), "out"),
        (lambda: stochastic_round_(torch.zeros(2), torch.zeros(1, 2, dtype=BF16)), "shapes"),
    ],
)
def test_wrong_dtypes_and_shapes_are_refused_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_50_sgd_steps_of_1e_4_are_kept_by_the_remainder_and_lost_by_bf16_and_by_a_bf16_kahan_term():
    hi, lo, ties = split(torch.ones(1))
    fp32, pure = torch.ones(1), torch.ones(1, dtype=BF16)
    w, c = torch.ones(1, dtype=BF16), torch.zeros(1, dtype=BF16)  # classic Kahan, compensation kept in bf16
    kahan_err = {}
    for n in range(1, 5001):
        if n <= 50:
            master = rebuild(hi, lo, ties) - 1e-4
            split_(master, hi, lo, ties)
            fp32 -= 1e-4
            pure -= 1e-4
        y = (torch.tensor(-1e-4) - c.float()).to(BF16)
        t = (w.float() + y.float()).to(BF16)
        c = ((t.float() - w.float()).to(BF16).float() - y.float()).to(BF16)
        w = t
        if n in (50, 5000):
            kahan_err[n] = abs((w.float() - c.float()).item() - (1 - n * 1e-4))
    assert torch.equal(bits(rebuild(hi, lo, ties)), bits(fp32))
    assert abs(rebuild(hi, lo, ties).item() - 0.995) < 2e-6
    assert pure.item() == 1.0
    assert kahan_err[50] == pytest.approx(1.8e-5, rel=0.05) and kahan_err[5000] == pytest.approx(2.8e-3, rel=0.05)


def test_30_adam_steps_through_split_and_rebuild_equal_plain_fp32_bitwise():
    torch.manual_seed(0)
    ref = nn.Linear(16, 8)
    lean = copy.deepcopy(ref)
    grads = [[torch.randn_like(p) for p in ref.parameters()] for _ in range(30)]
    opt_ref, opt_lean = torch.optim.Adam(ref.parameters(), lr=1e-3), torch.optim.Adam(lean.parameters(), lr=1e-3)
    triples = [split(p.detach()) for p in lean.parameters()]
    for gs in grads:
        for p, q, g, (hi, lo, ties) in zip(ref.parameters(), lean.parameters(), gs, triples):
            p.grad, q.grad = g, g.clone()
            rebuild(hi, lo, ties, out=q.data)
        opt_ref.step()
        opt_lean.step()
        for q, (hi, lo, ties) in zip(lean.parameters(), triples):
            split_(q.data, hi, lo, ties)
            q.data.fill_(float("nan"))  # only the triple carries the value between steps
    for p, (hi, lo, ties) in zip(ref.parameters(), triples):
        assert torch.equal(bits(rebuild(hi, lo, ties)), bits(p.detach()))


def test_stochastic_rounding_is_unbiased_and_keeps_representable_and_special_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, generator=g) * torch.logspace(-30, 30, 64)
    draws = 4096
    out = stochastic_round_(x.repeat(draws, 1), torch.empty(draws, 64, dtype=BF16), generator=g)
    down = from_bits((bits(x).to(torch.int64) & ~0xFFFF) & 0xFFFFFFFF)  # truncation toward zero
    ulp = torch.ldexp(torch.ones(64), torch.frexp(x)[1] - 8)
    assert ((out.float() - down).abs() <= ulp).all()  # only the two neighbours
    # one draw errs by at most an ulp (std <= ulp / 2): the mean of N is within 5 sigma = 5 ulp / (2 sqrt(N))
    err = (out.double().mean(0) - x.double()).abs()
    assert (err <= 5 * ulp.double() / (2 * math.sqrt(draws))).all()
    exact = torch.tensor([1.0, -0.0, 3.0, -2.0**-130, 1.5 * 2**100, float("inf"), -float("inf")])
    got = stochastic_round_(exact.repeat(256, 1), torch.empty(256, 7, dtype=BF16), generator=g)
    assert torch.equal(bits(got.float()), bits(exact.repeat(256, 1)))
    top = stochastic_round_(from_bits([0x7F7FFFFF, 0xFF7FFFFF] * 256), torch.empty(512, dtype=BF16), generator=g)
    assert top.isfinite().all() and (top.float().abs() == torch.finfo(BF16).max).all()
    assert stochastic_round_(torch.full((256,), float("nan")), torch.empty(256, dtype=BF16)).isnan().all()


def model_and_grads(steps, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 24), nn.Tanh(), nn.Linear(24, 8), nn.LayerNorm(8))
    grads = [[torch.randn_like(p).to(BF16) for p in model.parameters()] for _ in range(steps)]
    return model, grads


OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "Adam foreach": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_bucketed_steps_on_rebuilt_masters_equal_plain_fp32_bitwise(name):
    ref, grads = model_and_grads(20)
    lean = copy.deepcopy(ref)
    params = list(lean.parameters())
    opt_ref, opt = OPTIMIZERS[name](ref.parameters()), OPTIMIZERS[name](params)
    groups = [g["params"] for g in opt.param_groups]
    lean_step = CompensatedStep(params, bucket_bytes=4 * 200)  # [w1 (over the limit, alone)], [b1], [w2 b2], [ln]
    seen = []  # FP32 elements visible to each optimizer.step()
    opt.register_step_pre_hook(lambda o, a, k: seen.append(sum(p.numel() for g in o.param_groups for p in g["params"])))
    ptrs = [p.data_ptr() for p in params]
    for gs in grads:
        for p, q, g in zip(ref.parameters(), params, gs):
            p.grad, q.grad = g.float(), g
        opt_ref.step()
        lean_step.step(opt)
    assert all(p.dtype == BF16 and p.grad.dtype == BF16 for p in params)
    assert [p.data_ptr() for p in params] == ptrs and [g["params"] for g in opt.param_groups] == groups
    assert seen[:4] == [768, 24, 200, 16] and len(seen) == 20 * 4  # a bucket at a time, never the whole model
    for p, q in zip(ref.parameters(), params):
        assert torch.equal(bits(lean_step.master(q)), bits(p.detach()))
        assert torch.equal(q.detach(), lean_step.master(q).to(BF16))  # the model reads torch's cast of the master
        assert all(v.dtype == torch.float32 for k, v in opt.state[q].items() if k != "step")


def test_masters_landing_on_ties_read_as_torch_rounds_them_and_rebuild_exactly_in_padded_buckets():
    # sizes that are no multiple of 8 (each parameter's span is padded to whole tie-bit bytes), over three buckets; an
    # SGD step of lr 1 with the FP32 gradient m - t (exact: m and t lie in [1, 2)) lands every master m on its target
    # t, a tie, to an even upper half at even positions and to an odd one at odd positions
    g = torch.Generator().manual_seed(0)
    masters = [1 + torch.rand(shape, generator=g) for shape in [(5,), (3, 7), (8,), (2, 2)]]
    params = [nn.Parameter(m.clone()) for m in masters]
    lean = CompensatedStep(params, bucket_bytes=4 * 16)  # [5 (+3)], [21 (+3)], [8, 4 (+4)]
    for p, m in zip(params, masters):
        assert torch.equal(bits(lean.master(p)), bits(m)) and torch.equal(p.detach(), m.to(BF16))
    targets = []
    for m in masters:
        odd = (torch.arange(m.numel()).view(m.shape) % 2).to(I32) << 16
        targets.append(((bits(m) & ~0x1FFFF) | 0x8000 | odd).view(torch.float32))
    opt = torch.optim.SGD(params, lr=1.0)
    for p, m, t in zip(params, masters, targets):
        p.grad_dtype = None  # an FP32 gradient on a bf16 Parameter, as lean bf16 makes them to accumulate and clip
        p.grad = m - t
    lean.step(opt)
    for p, t in zip(params, targets):
        assert torch.equal(bits(lean.master(p)), bits(t))
        assert torch.equal(p.detach(), t.to(BF16))  # ties to even, where rounding half away would go up half the time
        assert torch.equal(tie_bits(lean.ties[p], t.numel()), (bits(t) >> 16 & 1 == 0).reshape(-1))
        assert p.grad.dtype == torch.float32 and p.dtype == BF16


def test_parameters_without_grad_stay_and_unowned_parameters_are_still_stepped():
    a, b = nn.Parameter(torch.ones(4, dtype=BF16)), nn.Parameter(torch.ones(4, dtype=BF16))
    kept = nn.Parameter(torch.ones(4))  # FP32, not owned by CompensatedStep
    opt = torch.optim.SGD([a, b, kept], lr=1e-4)
    lean = CompensatedStep([a, b])
    a.grad, kept.grad = torch.ones(4, dtype=BF16), torch.ones(4)
    for _ in range(3):
        lean.step(opt)
    assert torch.equal(lean.master(a), torch.full((4,), 1.0) - 1e-4 - 1e-4 - 1e-4)
    assert torch.equal(lean.master(b), torch.ones(4)) and not opt.state.get(b)
    assert torch.equal(kept.detach(), torch.full((4,), 1.0) - 1e-4 - 1e-4 - 1e-4)
    with pytest.raises(ValueError, match="closure"):
        lean.step(opt, closure=lambda: 0.0)
    for kwargs, name in [({"bucket_bytes": 0}, "bucket_bytes"), ({"optimizer_state_dtype": torch.float16}, "state")]:
        with pytest.raises(ValueError, match=name):
            CompensatedStep([a], **kwargs)
    with pytest.raises(ValueError, match="params"):
        CompensatedStep([nn.Parameter(torch.ones(2, dtype=torch.float16))])


def live_bytes_per_param(params, lean, opt):
    """Storage bytes of distinct storages of parameters, remainders, gradients and per-element optimizer state, per
    parameter; and the step counters' bytes separately (a few bytes per tensor, not per element)."""
    storages, counters = {}, 0
    tensors = [p.data for p in params] + list(lean.remainders.values()) + list(lean.ties.values())
    tensors += [p.grad for p in params]
    for p in params:
        for k, v in opt.state[p].items():
            if k == "step":
                counters += v.untyped_storage().nbytes()
            else:
                tensors.append(v)
    for t in tensors:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    n = sum(p.numel() for p in params)
    return sum(storages.values()) / n, counters


@pytest.mark.parametrize("state_dtype, budget", [(torch.float32, 14.125), (BF16, 10.125)])  # + 1 tie bit
def test_live_bytes_per_parameter_with_adamw(state_dtype, budget):
    model, grads = model_and_grads(3)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    lean = CompensatedStep(params, bucket_bytes=4 * 1000, optimizer_state_dtype=state_dtype)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g
        lean.step(opt)
    per_param, counters = live_bytes_per_param(params, lean, opt)
    assert per_param <= budget
    assert counters == 4 * len(params)  # Adam's FP32 step counters, one scalar per tensor
    assert {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"} == {state_dtype}


def test_bf16_optimizer_state_tracks_fp32_state_training():
    ref, grads = model_and_grads(200, seed=1)
    lean_model = copy.deepcopy(ref)
    params = list(lean_model.parameters())
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-3), torch.optim.AdamW(params, lr=1e-3)
    lean = CompensatedStep(params, optimizer_state_dtype=BF16, generator=torch.Generator().manual_seed(0))
    start = [p.detach().clone() for p in ref.parameters()]
    for gs in grads:
        for p, q, g in zip(ref.parameters(), params, gs):
            p.grad, q.grad = g.float(), g
        opt_ref.step()
        lean.step(opt)
    moved = torch.cat([(p.detach() - s).reshape(-1) for p, s in zip(ref.parameters(), start)])
    diff = torch.cat([(lean.master(q) - p.detach()).reshape(-1) for p, q in zip(ref.parameters(), params)])
    # state rounding errs by ~eps/2 per step, unbiased: the trajectories differ by a small part of the distance moved
    assert diff.norm() <= 4 * BF16_EPS * moved.norm()


def test_parity_guard_sees_no_drift_with_remainders_and_lost_updates_with_pure_bf16():
    model, grads = model_and_grads(5)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    lean = CompensatedStep(params)
    guard = ParityGuard(params, opt, value=lean.master, fraction=0.5, seed=3)
    assert guard.index == ParityGuard(params, opt, fraction=0.5, seed=3).index and len(guard.index) == 3
    pure = [nn.Parameter(torch.ones(64, 64, dtype=BF16))]
    pure_opt = torch.optim.SGD(pure, lr=1e-5)
    pure_guard = ParityGuard(pure, pure_opt, fraction=1.0)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g
        guard.snapshot()
        lean.step(opt)
        assert guard.measure() == (0.0, 0.0)
        pure[0].grad = torch.rand(64, 64).to(BF16) + 0.5
        pure_guard.snapshot()
        pure_opt.step()
        drift, lost = pure_guard.measure()
    assert lost == 1.0 and drift > 0
    assert torch.equal(pure[0].detach(), torch.ones(64, 64, dtype=BF16))
    with pytest.raises(ValueError, match="fraction"):
        ParityGuard(params, opt, fraction=0)


def test_optimizer_state_loaded_onto_bf16_parameters_is_stepped_in_fp32_again():
    model_a, grads = model_and_grads(3)
    pa = list(model_a.parameters())
    opt_a, lean_a = torch.optim.AdamW(pa, lr=1e-3), CompensatedStep(pa)
    for p, g in zip(pa, grads[0]):
        p.grad = g
    lean_a.step(opt_a)
    model_b = copy.deepcopy(model_a)
    pb = list(model_b.parameters())
    opt_b, lean_b = torch.optim.AdamW(pb, lr=1e-3), CompensatedStep(pb)
    for p, q in zip(pa, pb):
        lean_b.remainders[q].copy_(lean_a.remainders[p])
        lean_b.ties[q].copy_(lean_a.ties[p])
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as from a file; torch casts the moments to bf16
    assert opt_b.state[pb[0]]["exp_avg"].dtype == BF16
    for gs in grads[1:]:
        for p, q, g in zip(pa, pb, gs):
            p.grad, q.grad = g, g.clone()
        lean_a.step(opt_a)
        lean_b.step(opt_b)
    assert {v.dtype for s in opt_b.state.values() for k, v in s.items() if k != "step"} == {torch.float32}
    for p, q in zip(pa, pb):  # only the one rounding of the loaded moments: far below an Adam step of lr
        assert (lean_b.master(q) - lean_a.master(p)).abs().max() <= 2 * BF16_EPS * 1e-3


def test_bf16_second_moment_keeps_growing_with_stochastic_rounding_where_nearest_rounding_stalls():
    # exp_avg_sq += 0.001 * (g^2 - v): once that step is below half a bf16 ulp of v (v > ~0.34 at g = 1), a nearest
    # rounded bf16 v stops; FP32 reaches 1 - 0.999^n
    n = 1000
    p = nn.Parameter(torch.zeros(1024, dtype=BF16))
    opt = torch.optim.Adam([p], lr=1e-6)
    lean = CompensatedStep([p], optimizer_state_dtype=BF16, generator=torch.Generator().manual_seed(0))
    nearest = torch.zeros((), dtype=BF16)
    for _ in range(n):
        p.grad = torch.ones(1024, dtype=BF16)
        lean.step(opt)
        nearest = (0.999 * nearest.float() + 0.001).to(BF16)
    fp32 = 1 - 0.999**n
    assert nearest.item() < 0.4 < fp32
    assert opt.state[p]["exp_avg_sq"].dtype == BF16
    assert opt.state[p]["exp_avg_sq"].float().mean().item() == pytest.approx(fp32, rel=BF16_EPS)


def test_a_parameter_of_another_optimizer_is_neither_stepped_nor_given_state():
    # two optimizers over one model (a GAN): a step of one leaves the other's parameters, gradients and state alone
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt_a, opt_b = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in model)
    lean = CompensatedStep(list(model.parameters()))
    model(torch.randn(2, 4).to(BF16)).float().sum().backward()
    before = [lean.master(p) for p in model[1].parameters()]
    lean.step(opt_a)
    assert len(opt_a.state) == 2 and not opt_b.state and len(opt_a.state_dict()["state"]) == 2
    assert all(torch.equal(lean.master(p), b) for p, b in zip(model[1].parameters(), before))
    assert all(p.grad is not None and p.grad.dtype == BF16 for p in model.parameters())
