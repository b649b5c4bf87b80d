"""The agreement of the ranks on the autopilot's decisions, without a process group: what a rank proposes, what
the reduced table gives back, and how many collectives a step makes. In real gloo processes:
tests/test_autopilot_distributed.py."""

import threading

import pytest
import torch

from lightning_mp.doctor.report import OverflowReport
from lightning_mp.core import agreement
from lightning_mp.core.agreement import LOCATED_TENSORS, Proposals
from lightning_mp.numerics import distributed

NAMES, TYPES = ["", "0", "1"], ["Sequential", "Linear", "Scale"]


class FakeRanks:
    """``world`` ranks as threads of this process, for the agreement without a process group: ``all_reduce`` (which
    the shared :func:`~lightning_mp.numerics.distributed.agree_on_decisions` calls) is the element-wise MAX of the
    ranks' tables, behind a barrier (a rank that skips a collective the others make breaks it, as a real group would
    hang or abort)."""

    def __init__(self, monkeypatch, world=2):
        self.world, self.calls = world, 0
        self._barrier = threading.Barrier(world, timeout=20)
        self._tables: dict[int, torch.Tensor] = {}
        self._local = threading.local()
        monkeypatch.setattr(agreement, "world_size", lambda: world)
        # the collective's world follows the agreement's: a test that sets agreement.world_size to 1 is one process
        monkeypatch.setattr(distributed, "world_size", lambda: agreement.world_size())
        monkeypatch.setattr(agreement, "rank", lambda: self._local.rank)
        monkeypatch.setattr(distributed.dist, "all_reduce", self._all_reduce_max_)

    def _all_reduce_max_(self, table, op):
        assert op == distributed.dist.ReduceOp.MAX
        self._tables[self._local.rank] = table.clone()
        self._barrier.wait()
        reduced = torch.stack([self._tables[r] for r in range(self.world)]).amax(0)
        self._barrier.wait()
        if self._local.rank == 0:
            self.calls += 1
        return table.copy_(reduced)

    def run(self, fn):
        """``fn(rank)`` on every rank at once; its results by rank."""
        results, errors = {}, []

        def target(rank):
            self._local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as err:  # noqa: BLE001 (re-raised below, in the test's thread)
                errors.append(err)
                self._barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return [results[r] for r in range(self.world)]


@pytest.mark.parametrize("tensor", LOCATED_TENSORS)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("input_amax", [None, 0.0, 3.5, 65504.0, float("inf")])
def test_a_located_report_comes_back_whole_from_the_table(tensor, value, input_amax):
    report = OverflowReport("forward", "1", "Scale", tensor, value, input_amax)
    proposals = Proposals()
    assert proposals.located(2, report)
    (agreed,) = proposals.agree(NAMES, TYPES, torch.device("cpu"))
    assert agreed.located == report and agreed.index == 2 and agreed.output_amax is None
    assert agreed.where() == ""  # one process: no rank to name


def test_reports_that_move_no_module_are_not_proposed():
    proposals = Proposals()
    assert not proposals.located(1, OverflowReport("backward", "0", "Linear", "input gradient", "inf"))
    assert not proposals.located(1, OverflowReport("forward", None, None, "loss", "nan"))
    assert proposals.agree(NAMES, TYPES, torch.device("cpu")) == []


def test_a_calibration_measure_keeps_the_largest_of_several_forwards_and_non_finite_as_inf():
    proposals = Proposals()
    proposals.measured(1, 9000.0, 2.0)
    proposals.measured(1, float("nan"), 1.0)  # a second micro-batch went non-finite
    (agreed,) = proposals.agree(NAMES, TYPES, torch.device("cpu"))
    assert agreed.output_amax == float("inf") and agreed.input_amax == 2.0 and agreed.located is None
    assert proposals.agree(NAMES, TYPES, torch.device("cpu")) == []  # agreed once: the next step starts empty


def test_two_ranks_agree_on_the_union_the_largest_values_and_one_ranks_report(monkeypatch):
    ranks = FakeRanks(monkeypatch)

    def rank(r):
        proposals = Proposals()
        if r == 0:
            proposals.measured(1, 9000.0, 2.0)
            proposals.located(2, OverflowReport("forward", "1", "Scale", "output", "inf", 2.0))
        else:
            proposals.measured(1, 20000.0, 1.5)
            proposals.located(2, OverflowReport("forward", "1", "Scale", "own code", "nan"))
        return proposals.agree(NAMES, TYPES, torch.device("cpu"))

    on0, on1 = ranks.run(rank)
    assert on0 == on1 and ranks.calls == 1
    measured, located = on0
    assert (measured.index, measured.output_amax, measured.input_amax) == (1, 20000.0, 2.0)
    assert (measured.first_rank, measured.last_rank) == (0, 1)
    # one rank's report kind whole (rank 1's: the larger code), never a mix of the two
    assert located.located == OverflowReport("forward", "1", "Scale", "own code", "nan")
    assert located.where() == " (ranks 0 to 1 of 2: the largest values measured)"


def test_a_rank_with_nothing_to_propose_still_takes_part(monkeypatch):
    ranks = FakeRanks(monkeypatch, world=3)

    def rank(r):
        proposals = Proposals()
        if r == 2:
            proposals.measured(0, 1e4, 1.0)
        return proposals.agree(NAMES, TYPES, torch.device("cpu"))

    results = ranks.run(rank)
    assert all(len(r) == 1 and r[0].where() == " (rank 2 of 3)" for r in results) and ranks.calls == 1


def test_one_process_makes_no_collective(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("no collective in one process")

    monkeypatch.setattr(distributed.dist, "all_reduce", refuse)
    proposals = Proposals()
    proposals.measured(1, 1e4, 1.0)
    assert [a.index for a in proposals.agree(NAMES, TYPES, torch.device("cpu"))] == [1]
