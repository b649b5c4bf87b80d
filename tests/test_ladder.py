"""The precision schedule's ladder (lightning_mp.core.ladder) without a Trainer: what a ``schedule`` may say, the
errors for what it may not (each naming the entry and its value), the knobs a rung drops where its precision cannot
take them, fractions becoming steps, the rung of each step, and the rung a checkpoint names."""

import pytest
import torch
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.core.ladder import Ladder, label, run_length

pytestmark = pytest.mark.usefixtures("fp8_needs_torchao")


def ladder(precision="fp16", schedule=None, **kwargs):
    return MixedPrecisionPlugin(precision, schedule=schedule, **kwargs).ladder


# ------------------------------------------------------------------------------------------------ what is taken
def test_without_a_schedule_there_is_one_rung_and_nothing_to_save():
    lad = ladder("fp16")
    assert not lad.scheduled and len(lad.rungs) == 1 and lad.state_dict() == {}


def test_a_precision_string_and_a_dict_of_arguments_each_make_a_rung_on_top_of_the_one_before():
    lad = ladder("fp16", {5: "bf16", 8: {"master_weights": "compensated"}, 9: {"precision": "fp32"}})
    assert [r["precision"] for r in lad.rungs] == ["fp16", "bf16", "bf16", "fp32"]
    assert [r["master_weights"] for r in lad.rungs] == [None, None, "compensated", None]
    assert lad.whens == [5, 8, 9] and lad.scheduled
    assert lad.state_dict() == {"schedule_rung": 0}


def test_entries_are_ordered_by_when_not_by_how_they_were_written():
    lad = ladder("fp16", {0.9: "fp32", 0.5: "bf16"})
    assert lad.whens == [0.5, 0.9]
    assert [r["precision"] for r in lad.rungs] == ["fp16", "bf16", "fp32"]


def test_aliases_are_taken_as_the_plugin_takes_them():
    assert ladder("16-mixed", {3: "bf16-mixed"}).rungs[1]["precision"] == "bf16-mixed"


# ------------------------------------------------------------------------------------------------ refused
@pytest.mark.parametrize(
    "schedule, says",
    [
        ({0: "bf16"}, r"schedule key 0 is not allowed: step 0 computes in the plugin's own precision"),
        ({-3: "bf16"}, r"schedule key -3 is not allowed"),
        ({1.5: "bf16"}, r"schedule key 1.5 is not allowed: a fraction of the run is in \(0, 1\)"),
        ({1.0: "bf16"}, r"schedule key 1.0 is not allowed"),
        ({float("nan"): "bf16"}, r"schedule key nan is not allowed"),
        ({True: "bf16"}, r"schedule key True is not allowed: use an int optimizer step >= 1, or a float in \(0, 1\)"),
        ({"x": "bf16"}, r"schedule key 'x' is not allowed"),
        ([5], r"schedule=\[5\] is not allowed: use a dict \{step or fraction: precision or dict of arguments\}"),
        ({5: 3}, r"schedule\[5\]=3 is not allowed: use a precision \('bf16'\) or a dict"),
        ({5: {}}, r"schedule\[5\]=\{\} is not allowed"),
        ({5: None}, r"schedule\[5\]=None is not allowed"),
        ({5: "fp12"}, r"schedule\[5\]=\{'precision': 'fp12'\}: precision='fp12' is not supported. Allowed: 'fp32'"),
        ({5: {"precision": None}}, r"schedule\[5\]=\{'precision': None\}: precision=None is not supported"),
        ({5: {"master_weight": True}}, r"schedule\[5\] names \['master_weight'\], which the plugin does not take"),
        ({5: {"schedule": {9: "fp32"}}}, r"schedule\[5\] names \['schedule'\]"),
        ({5: {"loss_scale": -1.0}}, r"schedule\[5\]=\{'loss_scale': -1.0\}: loss_scale=-1.0 is not supported"),
        ({5: {"fp8_recipe": "bogus"}}, r"schedule\[5\]=\{'fp8_recipe': 'bogus'\}: fp8_recipe='bogus' is not allowed"),
        # a knob the new precision cannot take, named by the entry itself: refused, not dropped
        ({5: {"precision": "fp32", "master_weights": "compensated"}},
         r"schedule\[5\]=.*master_weights='compensated' with precision='fp32' is not allowed.*HINT"),
        ({5: {"precision": "bf16", "fp8_recipe": "tensorwise"}},
         r"schedule\[5\]=.*fp8_recipe='tensorwise' is not allowed with precision='bf16'.*HINT"),
        # a fraction's place among the steps is known only from the run's length
        ({5: "bf16", 0.9: "fp32"}, r"schedule=\{5: 'bf16', 0.9: 'fp32'\} mixes optimizer steps \(int\) and "
                                   r"fractions.*HINT: write every key as a step, or every key as a fraction"),
    ],
)
def test_a_bad_schedule_is_refused_when_the_plugin_is_made_naming_the_entry_and_its_value(schedule, says):
    with pytest.raises(ValueError, match=says):
        MixedPrecisionPlugin("fp16", schedule=schedule)


def test_the_allowed_arguments_are_listed_once_each():
    with pytest.raises(ValueError) as error:
        MixedPrecisionPlugin("bf16", schedule={5: {"master_weight": True}})
    allowed = str(error.value).split("Allowed: ")[1].rstrip(".").split(", ")
    assert len(allowed) == len(set(allowed)) and "'precision'" in allowed and "'master_weights'" in allowed
    assert "'schedule'" not in allowed


@pytest.mark.parametrize(
    "schedule, total, says",
    [
        # two entries on one step: the second would never compute a step
        ({0.11: "bf16", 0.12: "fp32"}, 10, r"0.11 -> step 1, 0.12 -> step 1: each must begin at step >= 1 and after"),
        ({0.5: "bf16", 0.54: "fp32"}, 10, r"0.5 -> step 5, 0.54 -> step 5"),
        # a fraction of a short run rounding to step 0: that step is the plugin's own precision
        ({0.04: "bf16"}, 10, r"0.04 -> step 0: each must begin at step >= 1"),
    ],
)
def test_fractions_that_round_onto_one_step_or_onto_step_0_are_refused_naming_the_steps(schedule, total, says):
    lad = ladder("fp16", schedule)  # accepted when made: the run's length is not known yet
    with pytest.raises(ValueError, match=says + r".*\(total steps " + str(total) + r"\)"):
        lad.resolve(total)


@pytest.mark.parametrize("total", [None, 0, float("inf")])
def test_a_fraction_without_a_run_length_is_refused_with_a_hint(total):
    with pytest.raises(ValueError, match=r"schedule=\{0.5: \.\.\.\}: a fraction of the run needs its length.*HINT: "
                                         r"give the step as an int"):
        ladder("fp16", {0.5: "bf16"}).resolve(total)


def test_under_fabric_a_fraction_is_refused_at_the_first_step():
    # Fabric's plugin asks for the rung after each optimizer step with no run length (Fabric has none)
    plugin = MixedPrecisionPlugin("fp16", schedule={0.5: "bf16"})
    with pytest.raises(ValueError, match=r"a fraction of the run needs its length.*Fabric has no length: write steps"):
        plugin.ladder.due(1, lambda: None, plugin.core)


def test_steps_need_no_run_length():
    lad = ladder("fp16", {3: "bf16", 7: "fp32"})
    lad.resolve(None)
    assert lad.starts == [3, 7]


# ------------------------------------------------------------------------------------------------ knob fall-back
def test_fp8_to_bf16_drops_the_fp8_knobs_which_bf16_refuses():
    lad = ladder("fp8", {5: "bf16"}, fp8_recipe="tensorwise", fp8_modules=[nn.Linear])
    assert lad.rungs[0]["fp8_recipe"] == "tensorwise" and lad.rungs[0]["fp8_modules"] == [nn.Linear]
    defaults = MixedPrecisionPlugin("fp8").ladder.rungs[0]
    assert lad.rungs[1]["fp8_recipe"] == defaults["fp8_recipe"]
    assert lad.rungs[1]["fp8_modules"] == defaults["fp8_modules"]
    # ...and they come back only where an entry names them again
    back = ladder("fp8", {5: "bf16", 8: {"precision": "fp8", "fp8_recipe": "tensorwise"}}, fp8_recipe="rowwise")
    assert back.rungs[2]["fp8_recipe"] == "tensorwise"


def test_lean_bf16_to_fp16_drops_compensated_masters_and_their_knobs():
    lad = ladder("bf16", {5: "fp16"}, master_weights="compensated", optimizer_state_dtype=torch.bfloat16,
                 parity_guard=0.5)
    assert lad.rungs[1]["precision"] == "fp16"
    assert lad.rungs[1]["master_weights"] is None  # fp16's default: FP32 masters
    assert lad.rungs[1]["optimizer_state_dtype"] is None and lad.rungs[1]["parity_guard"] == 0.0


def test_lean_bf16_to_fp32_masters_drops_the_lean_knobs_and_keeps_the_rest():
    lad = ladder("bf16", {5: {"master_weights": True}}, master_weights="compensated",
                 optimizer_state_dtype=torch.bfloat16, locate_overflows=False)
    assert lad.rungs[1]["master_weights"] is True and lad.rungs[1]["optimizer_state_dtype"] is None
    assert lad.rungs[1]["locate_overflows"] is False  # a knob every precision takes stays


def test_a_lean_knob_named_by_the_entry_stays():
    lad = ladder("bf16", {5: {"master_weights": "compensated", "optimizer_state_dtype": torch.bfloat16}})
    assert lad.rungs[1]["optimizer_state_dtype"] is torch.bfloat16


# ------------------------------------------------------------------------------------------------ which rung, when
def test_rung_at_gives_the_rung_computing_each_step():
    lad = ladder("fp16", {3: "bf16", 7: "fp32"})
    lad.resolve(None)
    assert [lad.rung_at(step) for step in range(10)] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]


def test_due_resolves_fractions_once_and_names_only_a_rung_that_is_not_the_current_one():
    plugin = MixedPrecisionPlugin("fp16", schedule={0.5: "bf16", 0.8: "fp32"})
    lad, asked = plugin.ladder, []

    def length():
        asked.append(1)
        return 10

    assert lad.due(0, length, plugin.core) is None and lad.starts == [5, 8]
    assert lad.due(4, length, plugin.core) is None
    assert lad.due(5, length, plugin.core) == 1
    lad.current = 1
    assert lad.due(6, length, plugin.core) is None and lad.due(8, length, plugin.core) == 2
    assert len(asked) == 1  # the run's length is asked once
    # a checkpoint written in rung 2 (rung 0 now): due names rung 0 again for a step before 5
    lad.current = 2
    assert lad.due(1, length, plugin.core) == 0


@pytest.mark.parametrize("max_steps, epochs_estimate, expected", [(10, 99, 10), (-1, 12, 12), (-1, float("inf"), None)])
def test_run_length_is_max_steps_else_the_estimated_stepping_batches(max_steps, epochs_estimate, expected):
    class Trainer:
        pass

    trainer = Trainer()
    trainer.max_steps, trainer.estimated_stepping_batches = max_steps, epochs_estimate
    assert run_length(trainer) == expected


# ------------------------------------------------------------------------------------------------ checkpoints
def test_a_checkpoint_names_a_rung_of_this_schedule_or_is_refused_with_a_hint():
    lad = ladder("fp16", {3: "bf16"})
    assert lad.saved_rung({}) == 0 and lad.saved_rung({"schedule_rung": 1}) == 1
    for rung in (2, -1, True, "1", 1.0):
        with pytest.raises(ValueError, match=rf"written in rung {rung!r} of a precision schedule, and this plugin's "
                                             r"schedule has 2 rung\(s\).*HINT: resume with the schedule"):
            lad.saved_rung({"schedule_rung": rung})


def test_a_plugin_loading_a_rung_it_lacks_refuses_and_stays_in_its_own():
    plugin = MixedPrecisionPlugin("fp16", schedule={3: "bf16"})
    with pytest.raises(ValueError, match=r"written in rung 4"):
        plugin.load_state_dict({**plugin.state_dict(), "schedule_rung": 4})
    assert plugin.ladder.current == 0 and plugin.format.name == "fp16"


def test_a_plugin_without_a_schedule_resumes_any_rung_in_its_own_precision():
    plugin = MixedPrecisionPlugin("bf16")
    plugin.load_state_dict({**MixedPrecisionPlugin("fp16", schedule={3: "bf16"}).state_dict(), "schedule_rung": 1})
    assert plugin.format.name == "bf16" and plugin.ladder.current == 0 and "schedule_rung" not in plugin.state_dict()


def test_a_plugin_loading_a_later_rung_computes_in_it():
    plugin = MixedPrecisionPlugin("fp16", schedule={3: "bf16"})
    later = MixedPrecisionPlugin("bf16").state_dict()
    plugin.load_state_dict({**later, "schedule_rung": 1})
    assert plugin.ladder.current == 1 and plugin.format.name == "bf16" and plugin.scaler is None
    assert plugin.state_dict()["schedule_rung"] == 1


# ------------------------------------------------------------------------------------------------ label
@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(precision="fp16"), "fp16, loss scale 'dynamic'"),
        (dict(precision="fp16", loss_scale=128.0), "fp16, loss scale 128.0"),
        (dict(precision="bf16"), "bf16"),
        (dict(precision="bf16", master_weights=False), "bf16 (autocast, no master weights)"),
        (dict(precision="bf16", master_weights="compensated"), "lean bf16"),
        (dict(precision="fp32"), "fp32"),
        (dict(precision="fp8"), "fp8"),
    ],
)
def test_label_says_how_a_rung_computes(kwargs, expected):
    plugin = MixedPrecisionPlugin(**kwargs)
    assert label(plugin.core) == expected


def test_describe_names_what_a_rung_changed():
    lad = ladder("fp16", {3: "bf16", 6: {"master_weights": "compensated"}})
    assert lad.describe(0) == "precision='fp16'"
    assert "precision='bf16'" in lad.describe(1)
    assert lad.describe(2) == "master_weights='compensated'"
