"""The collectives' pure parts, and the autopilots' agreement against a stand-in all-reduce; the collectives
themselves run in tests/test_ddp.py, tests/test_autopilot_distributed.py and tests/test_fp8_distributed.py (gloo
processes)."""

import math

import pytest
import torch

from lightning_mp.core import agreement
from lightning_mp.fp8 import autopilot as fp8_autopilot
from lightning_mp.numerics import distributed
from lightning_mp.numerics.distributed import agree_on_decisions
from lightning_mp.numerics.distributed import contiguous_runs as _runs


def test_gradients_that_tile_one_buffer_form_one_in_place_run():
    flat = torch.zeros(10)
    a, b, c = flat[:3], flat[3:7].view(2, 2), flat[7:]
    other = torch.zeros(2)
    assert [len(r) for r in _runs([a, b, c])] == [3]  # one all-reduce on the buffer itself
    assert [len(r) for r in _runs([a, b, other, c])] == [2, 1, 1]  # an FP32 parameter's own gradient breaks it
    assert [len(r) for r in _runs([b, a])] == [1, 1]  # out of order: not one region
    assert [len(r) for r in _runs([flat[::2], flat[1::2]])] == [1, 1]  # strided views never run together


@pytest.fixture
def other_rank(monkeypatch):
    """A second rank whose table is ``other["table"]``: every all-reduce made is recorded, and MAX-reduces the
    tensor it gets with the other rank's as a backend that compares might (``a if a >= b else b``: every comparison
    with a NaN is false, so this rank's NaN is replaced by the other rank's number)."""
    other = {"table": None, "calls": []}

    def all_reduce(tensor, op):
        other["calls"].append((op, tensor.device, tensor.clone()))
        theirs = other["table"].to(tensor.device)
        tensor.copy_(torch.where(tensor >= theirs, tensor, theirs))

    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    return other


def test_both_autopilots_agree_through_the_one_shared_collective():
    # fp32_modules='auto' (core) and fp8_modules='auto' (fp8) call the same function: one all-reduce for decisions
    assert agreement.agree_on_decisions is agree_on_decisions is fp8_autopilot.agree_on_decisions
    assert not hasattr(fp8_autopilot, "dist")  # no collective of its own


def test_decisions_in_one_process_are_the_table_itself_with_no_collective(monkeypatch):
    monkeypatch.setattr(distributed.dist, "all_reduce", lambda *a, **k: pytest.fail("no collective in one process"))
    table = torch.tensor([[1.0, -math.inf], [math.nan, 2.0]])
    assert agree_on_decisions(table, torch.device("cpu")) is table


def test_every_rank_sees_the_worst_value_nan_and_inf_included(other_rank):
    ours = torch.tensor([[0.5, -math.inf, math.nan], [3.0, -math.inf, 1.0]])
    other_rank["table"] = torch.tensor([[0.25, -20.0, 7.0], [1.0, -math.inf, math.inf]])
    agreed = agree_on_decisions(ours, torch.device("cpu"))
    (op, device, sent), = other_rank["calls"]  # one all-reduce, with MAX, of the whole table
    assert op == distributed.dist.ReduceOp.MAX and sent.shape == (2, 3)
    # a rank's NaN (a measurement that went non-finite) is the worst value on every rank, never dropped by MAX;
    # -inf (nothing measured) stays the floor
    assert agreed.tolist() == [[0.5, -20.0, math.inf], [3.0, -math.inf, math.inf]]
    assert agreed.device.type == "cpu" and ours.isnan().any()  # the caller's table is left as it was


@pytest.fixture
def summing_rank(monkeypatch):
    """A second rank whose gradients are 3x this rank's: a SUM all-reduce leaves 4x, the average 2x."""
    calls = []

    def all_reduce(tensor, op):
        calls.append((op, tensor.untyped_storage().data_ptr(), tensor.numel()))
        tensor.mul_(4)

    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    return calls


def test_a_few_gradients_are_averaged_in_one_collective_whatever_their_layout(summing_rank):
    # before: one all-reduce per run of the flat buffer and one for the loose gradients (LayerNorm's, autograd's own):
    # 2-3 collectives per step, each 15-75 us of the training thread's CPU time, on a model whose step is ~1.5 ms
    flat = torch.arange(10.0)
    run = [flat[:4].view(2, 2), flat[4:]]
    loose = [torch.full((3,), 5.0), torch.ones(1)]
    distributed.average_across_ranks_([*run, *loose])
    assert [(op, n) for op, _, n in summing_rank] == [(distributed.dist.ReduceOp.SUM, 14)]
    assert torch.equal(flat, 2 * torch.arange(10.0)) and run[0].data_ptr() == flat.data_ptr()  # still its views
    assert loose[0].tolist() == [10.0] * 3 and loose[1].tolist() == [2.0]


def test_many_elements_are_averaged_in_place_in_their_flat_buffer(summing_rank):
    # no concatenated copy of a large buffer (+4 B per parameter at the peak): the run all-reduced where it lies
    n = distributed.CONCAT_BELOW
    flat = torch.ones(n + 2)
    loose = torch.ones(3)
    distributed.average_across_ranks_([flat[:n], flat[n:], loose])
    assert [(ptr, numel) for _, ptr, numel in summing_rank] == [(flat.untyped_storage().data_ptr(), n + 2),
                                                                 (summing_rank[1][1], 3)]
    assert torch.equal(flat, torch.full((n + 2,), 2.0)) and loose.tolist() == [2.0] * 3


def test_the_average_says_every_rank_holds_the_same_values():
    # what lets the step skip the inf/NaN flag's own agreement after it (numerics/step.py)
    assert distributed.average_across_ranks_.same_on_every_rank is True
