"""LossScaleMonitor on tiny Trainer runs with an in-memory logger: which keys are logged, at which steps, how often."""

import lightning as L
import pytest
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mp import LossScaleMonitor, MixedPrecisionPlugin
from tests.conftest import TinyRegressor, TwoOptimizers, regression_data, trainer_kwargs

SCALE, SKIPPED, FORMAT = "precision/loss_scale", "precision/skipped_steps", "precision/format"


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call in memory."""

    def __init__(self):
        super().__init__()
        self.calls = []  # (step, metrics)

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))

    def series(self, key):
        """[(step, value)] of one key, in logging order."""
        return [(step, m[key]) for step, m in self.calls if key in m]


def run(model, plugin, monitor, logger, **kwargs):
    kwargs.setdefault("log_every_n_steps", 1)
    plugins = [plugin] if plugin is not None else []
    trainer = L.Trainer(plugins=plugins, callbacks=[monitor], **trainer_kwargs(logger=logger, **kwargs))
    trainer.fit(model, regression_data())
    return trainer


# ---------------------------------------------------------------------------------------------- what is logged
@pytest.mark.on_device
def test_scale_curve_grows_backs_off_after_the_overflow_and_counts_the_skip():
    logger = RecordingLogger()
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8, growth_interval=3)
    run(TinyRegressor(fault_at={5}), plugin, LossScaleMonitor(), logger, max_steps=10)
    # growth after 3 clean steps (0-2, then 6-8); step 5 overflows with 512, so 6 starts again from 256
    assert logger.series(SCALE) == [
        (0, 256.0), (1, 256.0), (2, 256.0), (3, 512.0), (4, 512.0), (5, 512.0),
        (6, 256.0), (7, 256.0), (8, 256.0), (9, 512.0),
    ]  # fmt: skip
    assert logger.series(SKIPPED) == [(s, 0.0) for s in range(5)] + [(s, 1.0) for s in range(5, 10)]
    assert all(set(m) == {SCALE, SKIPPED, FORMAT} for _, m in logger.calls)
    assert logger.series(FORMAT) == [(s, 11.0) for s in range(10)]  # fp16's significand: 11 bits
    assert all(isinstance(v, float) for _, m in logger.calls for v in m.values())


@pytest.mark.on_device
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_without_scaling_the_scale_is_one_and_skips_still_count(precision):
    logger = RecordingLogger()
    model = TinyRegressor(fault_at={2}, fault=float("nan"))
    run(model, MixedPrecisionPlugin(precision), LossScaleMonitor(), logger, max_steps=4)
    assert logger.series(SCALE) == [(s, 1.0) for s in range(4)]
    assert logger.series(SKIPPED) == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0)]


@pytest.mark.on_device
@pytest.mark.parametrize("interval, log_every_n_steps, steps", [(None, 4, [3, 7]), (3, 4, [2, 5, 8]), (None, 0, [])])
def test_logs_every_n_steps_of_the_trainer_or_its_own_interval(interval, log_every_n_steps, steps):
    logger = RecordingLogger()
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8)
    run(TinyRegressor(), plugin, LossScaleMonitor(interval), logger, max_steps=10, log_every_n_steps=log_every_n_steps)
    assert [s for s, _ in logger.series(SCALE)] == steps
    assert [s for s, _ in logger.series(SKIPPED)] == steps


@pytest.mark.on_device
def test_gradient_accumulation_logs_once_per_optimizer_step():
    logger = RecordingLogger()
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8, growth_interval=2)
    run(TinyRegressor(), plugin, LossScaleMonitor(), logger, max_steps=4, accumulate_grad_batches=2)  # 8 batches
    assert logger.series(SCALE) == [(0, 256.0), (1, 256.0), (2, 512.0), (3, 512.0)]


@pytest.mark.on_device
def test_manual_optimization_with_two_optimizers_logs_once_per_training_step():
    logger = RecordingLogger()
    plugin = MixedPrecisionPlugin("fp16", init_scale=4.0, growth_interval=2)
    run(TwoOptimizers(), plugin, LossScaleMonitor(), logger, max_steps=8)  # 8 optimizer steps = 4 training steps
    assert logger.series(SCALE) == [(0, 4.0), (1, 4.0), (2, 8.0), (3, 8.0)]


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.on_device
def test_no_logger_is_refused_at_fit():
    with pytest.raises(MisconfigurationException, match="LossScaleMonitor.*no logger"):
        run(TinyRegressor(), MixedPrecisionPlugin("bf16"), LossScaleMonitor(), logger=False, max_steps=1)


@pytest.mark.on_device
def test_a_trainer_without_the_plugin_is_refused_with_a_hint():
    with pytest.raises(MisconfigurationException, match=r"MixedPrecisionPlugin.*HINT.*plugins="):
        run(TinyRegressor(), None, LossScaleMonitor(), RecordingLogger(), max_steps=1, precision="bf16-mixed")


@pytest.mark.on_device
def test_validate_alone_needs_neither_logger_nor_plugin():
    trainer = L.Trainer(callbacks=[LossScaleMonitor()], **trainer_kwargs())
    (metrics,) = trainer.validate(TinyRegressor(), regression_data())
    assert set(metrics) == {"val_loss"}  # validation ran and the monitor logged nothing of its own


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "10"])
def test_logging_interval_must_be_a_positive_integer_or_none(bad):
    with pytest.raises(ValueError, match=rf"logging_interval={bad!r}.*integer >= 1.*None"):
        LossScaleMonitor(bad)
