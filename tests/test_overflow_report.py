"""OverflowReport's text and how device records are read back into one, without hooks or a model."""

import math

import pytest
import torch

from lightning_mp.doctor.report import OverflowReport, _first_report, _Found

NAMES, TYPES = ["", "block", "block.linear"], ["Net", "Block", "Linear"]
INF, NAN = math.inf, math.nan


def t(*values):
    return [torch.tensor(v) for v in values]


def test_report_phase_is_checked():
    with pytest.raises(ValueError, match=r"phase='sideways' is not allowed.*forward.*backward"):
        OverflowReport("sideways", "a", "Linear", "output", "inf")


def test_the_text_says_where_what_and_how_large_the_input_was():
    assert str(OverflowReport("forward", "", "Net", "output", "inf", 3.0)) == (
        "forward overflow in `<model>` (Net): output went inf; largest input magnitude 3"
    )
    assert str(OverflowReport("forward", "a", "Block", "output", "nan", INF)).endswith("already non-finite")
    assert str(OverflowReport("forward", "a", "Block", "own code", "inf", 2.0)).startswith(
        "forward overflow in `a` (Block): its own forward code, between its submodules, made a inf"
    )
    assert str(OverflowReport("backward", "a", "Linear", "gradient of weight", "-inf")) == (
        "backward overflow in `a` (Linear): gradient of weight went -inf"
    )


def test_a_clean_step_reads_as_none():
    assert _first_report([], {}, NAMES, TYPES) is None
    assert _first_report([(1, 2, 0, "output", t(-1.0, 1.0), t(0.0, 2.0))], {}, NAMES, TYPES) is None


def test_a_forward_overflow_wins_over_an_earlier_backward_one():
    records = [
        (1, 2, 1, "gradient of weight", t(0.0, INF), None),
        (2, 1, 0, "output", t(-1.0, NAN), t(-2.0, 3.0)),
    ]
    assert _first_report(records, {}, NAMES, TYPES) == OverflowReport("forward", "block", "Block", "output", "nan", 3.0)


def test_the_earlier_of_a_cpu_culprit_and_a_device_record_wins():
    cpu = OverflowReport("forward", "", "Net", "output", "inf")
    records = [(2, 2, 0, "output", t(0.0, INF), None)]
    assert _first_report(records, {0: _Found(1, cpu)}, NAMES, TYPES) is cpu
    assert _first_report(records, {0: _Found(3, cpu)}, NAMES, TYPES).module == "block.linear"


def test_a_non_finite_input_made_by_the_parents_own_code_names_the_parent():
    records = [
        (1, 2, 0, "output", t(0.0, INF), t(0.0, INF)),  # the Linear's input was already inf
        (2, 1, 0, "output", [], t(-0.5, 0.5)),  # its parent's own input was finite: the parent made the inf
    ]
    report = _first_report(records, {}, NAMES, TYPES)
    assert report == OverflowReport("forward", "block", "Block", "own code", "inf", 0.5)


def test_of_an_input_gradient_and_a_parameter_gradient_the_module_later_in_the_forward_came_first():
    records = [(1, 1, 1, "input gradient", t(0.0, INF), None)]  # `block`'s input gradient, during the backward
    linear = _Found(0, OverflowReport("backward", "block.linear", "Linear", "gradient of weight", "inf"), 2)
    root = _Found(0, OverflowReport("backward", "", "Net", "gradient of scale", "nan"), 0)
    rank = {0: (0, 0), 1: (1, 1), 2: (2, 2)}.__getitem__  # forward execution order: "", block, block.linear
    assert _first_report(records, {}, NAMES, TYPES, lambda: linear, rank) is linear.report
    assert _first_report(records, {}, NAMES, TYPES, lambda: root, rank).tensor == "input gradient"
    assert _first_report([], {}, NAMES, TYPES, lambda: root, rank) is root.report


def test_the_parameter_gradients_are_not_read_when_a_forward_output_was_non_finite():
    records = [(1, 1, 0, "output", t(0.0, INF), t(0.0, 1.0))]
    never = lambda: pytest.fail("read the gradients although the forward named the culprit")  # noqa: E731
    assert _first_report(records, {}, NAMES, TYPES, never, None).phase == "forward"


def test_a_non_finite_loss_comes_after_a_forward_output_and_before_every_gradient():
    loss = OverflowReport("forward", None, None, "loss", "inf")
    never = lambda: pytest.fail("read the gradients although the loss showed the forward went non-finite")  # noqa: E731
    forward = [(1, 1, 0, "output", t(0.0, INF), t(0.0, 1.0))]
    backward = [(1, 2, 1, "input gradient", t(0.0, INF), None)]  # what the loss's inf did in the backward
    assert _first_report(forward, {}, NAMES, TYPES, never, None, lambda: loss).module == "block"
    assert _first_report(backward, {}, NAMES, TYPES, never, None, lambda: loss) is loss
    # a finite loss (None) leaves the backward to name the culprit
    assert _first_report(backward, {}, NAMES, TYPES, None, None, lambda: None).tensor == "input gradient"


def test_the_text_of_a_loss_report_says_whether_the_module_outputs_were_checked():
    reached = OverflowReport("backward", "block.linear", "Linear", "gradient of weight", "nan")
    unchecked = OverflowReport("forward", None, None, "loss", "inf", forward_checked=False, reached=reached)
    assert str(unchecked) == (
        "forward overflow: the loss was already inf, so the forward made it; no module output was checked in this "
        "step (the forward checks were off), so the module is not named; the backward carried it to "
        "`block.linear` (Linear) first: gradient of weight went nan"
    )
    assert str(OverflowReport("forward", None, None, "loss", "nan")).startswith(
        "forward overflow in the loss: every module's output was finite, the loss went nan"
    )
