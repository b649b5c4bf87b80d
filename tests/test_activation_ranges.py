"""The activation measurements without a Trainer: what one forward records, and where an FP16 overflow starts."""

import math

import torch
from torch import nn

from lightning_mp.doctor.activation_ranges import ActivationRecorder, _encloses, overflow_starts, Sample, _SampleValues
from lightning_mp.doctor.log2_histogram import LOG2_LOW, gradient_range
from tests.test_overflow_locator import Scale

X = torch.full((2, 4), 0.5)


def record(model, x=X, sample=None):
    sample = sample if sample is not None else Sample(step=0)
    recorder = ActivationRecorder(model, sample)
    model(x)  # a training forward: autograd on
    recorder.remove()
    return sample


def test_each_module_gets_its_largest_output_and_input_and_each_tensor_is_counted_once():
    model = nn.Sequential(Scale(4.0), Scale(-2.0))
    values = record(model).read()
    assert values.names == ["0", "1", "<model>"]  # first-call order: the model's forward ends last
    assert values.amax == [2.0, 4.0, 4.0] and values.input_amax == [0.5, 2.0, 0.5]
    assert values.has_input == [True, True, True] and values.grads is None
    assert values.acts.numel == 16  # the model returns the last Scale's tensor: counted once, not again
    assert values.acts.counts[0][1 - LOG2_LOW] == 8 and values.acts.counts[0][2 - LOG2_LOW] == 8


def test_the_fractions_are_those_of_the_outputs_against_fp16():
    values = record(nn.Sequential(Scale(1e6), Scale(1e-20))).read()
    assert values.acts.overflow_fraction == 0.5  # the first Scale's 5e5; the second's 5e-15 underflows
    assert values.acts.underflow_fraction == 0.5


def test_a_shared_module_keeps_its_largest_output():
    shared = Scale(3.0)
    values = record(nn.Sequential(shared, nn.ReLU(), shared)).read()
    assert values.names == ["0", "1", "<model>"] and values.amax[0] == 4.5  # 0.5 * 3 * 3


def test_forwards_without_autograd_record_nothing_and_remove_takes_the_hooks_off():
    model = nn.Sequential(Scale(2.0))
    sample = Sample(step=0)
    recorder = ActivationRecorder(model, sample)
    with torch.no_grad():
        model(X)
    assert sample.packed is None and not sample.modules
    recorder.remove()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_gradients_for_the_picture_are_counted_at_scale_one():
    sample = Sample(step=0)
    sample.add_grads([torch.full((3,), 2.0**-30)])
    sample.add_grads([torch.full((2,), 2.0**-30)])
    record(nn.Sequential(Scale(1.0)), sample=sample)
    grads = sample.read().grads
    assert grads == gradient_range([torch.full((5,), 2.0**-30)], scale=1.0)


def test_an_overflow_starts_where_the_output_left_fp16_from_inputs_within_it():
    model = nn.Sequential(nn.Sequential(Scale(1e6), Scale(2.0)), Scale(1.0))
    assert overflow_starts(record(model).read()) == ["0.0"]  # not the modules downstream, not the containers


def test_a_module_without_a_floating_input_can_start_one():
    values = _SampleValues(gradient_range([], 1.0), ["emb", "<model>"], [1e5, 1e5], [0.0, 0.0], [False, False], None)
    assert overflow_starts(values) == ["emb"]
    inf_in = _SampleValues(gradient_range([], 1.0), ["a"], [math.inf], [math.inf], [True], None)
    assert overflow_starts(inf_in) == []  # inherited: its input was already out of range


def test_encloses():
    assert _encloses("<model>", "a") and _encloses("a", "a.b") and not _encloses("a", "ab")
    assert not _encloses("a", "a") and not _encloses("a.b", "a")


def test_a_recorder_on_a_model_compiled_with_fullgraph_steps_aside_and_the_eager_modules_are_measured():
    # armed before the first compile (an ActivationRangeMonitor sampling step 0 of a compiled model), its hooks were
    # traced and fullgraph=True raised ("Could not guard on data-dependent expression")
    import torch._dynamo as dynamo

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    model = nn.Sequential(nn.Linear(8, 8), inner)
    recorder = ActivationRecorder(model, Sample(step=0))
    dynamo.reset()
    model[1] = torch.compile(inner, fullgraph=True, backend="eager")
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    recorder.remove()
    assert "0" in recorder.sample.modules and not any(name.startswith("1.") for name in recorder.sample.modules)
