"""The plugin pickles after it has run (issue 45, item 3): ``pickle.dumps(plugin)`` after a fit in every format,
``torch.save(trainer)`` and ``torch.load`` as Lightning's ``test_model_torch_save`` does, and a Fabric plugin after
its first steps, with the model it hooks. The copy keeps the run's state (scale, step counts, the last report) and
works: ``describe()``, and another fit."""

import io
import pickle

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.fabric import MixedPrecisionPlugin as FabricPlugin
from tests.conftest import TinyRegressor, fabric, regression_data, trainer_kwargs

pytestmark = [pytest.mark.slow, pytest.mark.on_device]


def state(plugin):
    """What a user reads off a plugin after a run."""
    return plugin.loss_scale, plugin.skipped_steps, plugin.training_steps, str(plugin.last_overflow)


def fitted(precision, steps=4, **knobs):
    """A plugin after a fit; fp16 skips its second step (an inf loss), so the scale and the counters have moved."""
    plugin = MixedPrecisionPlugin(precision, **knobs)
    torch.manual_seed(0)  # the weights, whatever tests ran before: only the injected inf overflows
    model = TinyRegressor(fault_at=(1,) if precision == "fp16" else ())
    trainer = L.Trainer(plugins=[plugin], max_steps=steps, **trainer_kwargs())
    trainer.fit(model, regression_data())
    return plugin, trainer, model


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_the_plugin_pickles_after_a_fit_and_the_copy_keeps_its_state_and_trains(precision):
    plugin, _, _ = fitted(precision)
    copy = pickle.loads(pickle.dumps(plugin))  # before: "Can't pickle local object 'defer_flags.<locals>.late_skip'"
    assert state(copy) == state(plugin)
    if precision == "fp16":
        assert copy.skipped_steps == 1 and copy.loss_scale == 2.0**15  # the backoff of the skipped step
    assert copy.describe() == plugin.describe()
    trainer = L.Trainer(plugins=[copy], max_steps=2, **trainer_kwargs())
    trainer.fit(TinyRegressor(), regression_data())  # the copy is set up again by its next fit
    assert copy.training_steps == plugin.training_steps + 2


@pytest.mark.parametrize(
    "knobs", [{}, {"master_weights": "compensated"}, {"fp32_modules": "auto", "calibration_steps": 1}],
    ids=["fp16", "compensated", "autopilot"],
)
def test_torch_save_of_the_trainer_loads_as_in_lightnings_test_model_torch_save(tmp_path, knobs):
    precision = "bf16" if knobs.get("master_weights") == "compensated" else "fp16"
    plugin, trainer, model = fitted(precision, **knobs)
    path = tmp_path / "temp.pt"
    torch.save(trainer.model, path)
    torch.save(trainer, path)
    loaded = torch.load(path, weights_only=False)
    assert state(loaded.strategy.precision_plugin) == state(plugin)
    assert all(torch.equal(a, b) for a, b in zip(loaded.lightning_module.parameters(), model.parameters()))
    assert loaded.strategy.precision_plugin.describe() == plugin.describe()


def test_the_fp8_plugin_pickles_after_a_fit():
    plugin, _, _ = fitted("fp8")  # torchao's matmul of the recipe was a closure kept on the plugin
    assert state(pickle.loads(pickle.dumps(plugin))) == state(plugin)


def fabric_run(precision, fault_at=(), steps=2, **knobs):
    """A plain Fabric loop: ``steps`` iterations, an inf loss at ``fault_at``; the plugin and model as it left them."""
    plugin = FabricPlugin(precision, **knobs)
    f = fabric(plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    model, optimizer = f.setup(model, optimizer)
    plugin.guard_schedulers(scheduler)
    for i in range(steps):
        loss = model(torch.randn(8, 16, device=f.device)).float().pow(2).mean()
        f.backward(loss * (float("inf") if i in fault_at else 1.0))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return plugin, model


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_a_fabric_plugin_pickles_after_one_step(precision):
    plugin, _ = fabric_run(precision, steps=1)
    copy = pickle.loads(pickle.dumps(plugin))
    assert state(copy) == state(plugin) and copy.training_steps == 1
    assert copy.describe() == plugin.describe()


@pytest.mark.parametrize("knobs", [{"precision": "fp16"}, {"precision": "fp16", "locate_overflows": "forward"},
                                   {"precision": "bf16", "master_weights": "compensated"}, {"precision": "fp8"}],
                         ids=["fp16-skip", "forward-checks", "compensated", "fp8"])
def test_a_fabric_plugin_and_its_model_pickle_mid_run_with_their_hooks_on(knobs):
    """The locator's forward hooks (armed at a skip), lean bf16's state-dict hooks and the FP8 forwards sit on the
    model while a Fabric loop runs: model and plugin pickle with them."""
    plugin, model = fabric_run(fault_at=(0,) if knobs["precision"] == "fp16" else (), steps=3, **knobs)
    if knobs["precision"] == "fp16":
        assert plugin.skipped_steps == 1
    buffer = io.BytesIO()
    torch.save({"model": model, "plugin": plugin}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert state(loaded["plugin"]) == state(plugin)
    assert loaded["plugin"].describe() == plugin.describe()
    if knobs["precision"] == "fp16":  # the loaded run still names a skipped step's gradient (Fabric connects once)
        core = loaded["plugin"].core
        assert core.step.on_overflow is not None and core.step.on_overflow.core is core
