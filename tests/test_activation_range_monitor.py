"""ActivationRangeMonitor with an in-memory logger (which keys, which steps) and the picture's pieces without a Trainer."""

import math
import warnings

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.monitors.activation_range import ActivationRangeMonitor
from lightning_mp.monitors.gradient_range import NUM_BUCKETS, gradient_range
from lightning_mp.doctor.ranges_plot import FormatBand, format_bands, plotting_available, render_ranges_vs_formats
from tests.conftest import TinyRegressor, regression_data, trainer_kwargs
from tests.test_loss_scale_monitor import RecordingLogger
from tests.test_overflow_locator import Scale
from tests.test_overflow_locator_integration import Middle

needs_matplotlib = pytest.mark.skipif(not plotting_available(), reason="needs matplotlib (the plot extra)")
OVER, UNDER = "precision/activation_overflow_fraction", "precision/activation_underflow_fraction"


def run(model, monitor, logger, plugin=None, **kwargs):
    kwargs.setdefault("max_steps", 6)
    plugins = [plugin] if plugin is not None else []
    trainer = L.Trainer(plugins=plugins, callbacks=[monitor], **trainer_kwargs(logger=logger, **kwargs))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, regression_data())
    return [str(w.message) for w in caught if "ActivationRangeMonitor" in str(w.message)]


# ---------------------------------------------------------------------------------------------- what is logged
@pytest.mark.on_device
def test_fractions_are_logged_on_the_sampled_steps_only():
    logger = RecordingLogger()
    run(TinyRegressor(), ActivationRangeMonitor(every_n_steps=2), logger)
    assert [s for s, _ in logger.series(OVER)] == [1, 3, 5]
    assert [s for s, _ in logger.series(UNDER)] == [1, 3, 5]
    assert all(v == 0.0 for _, v in logger.series(OVER))  # a small MLP on unit data is far from 65504


@pytest.mark.on_device
def test_per_module_amax_is_logged_for_every_module_with_the_model_as_model():
    logger = RecordingLogger()
    run(TinyRegressor(), ActivationRangeMonitor(every_n_steps=3, per_module=True), logger)
    keys = {k for _, m in logger.calls for k in m if k.startswith("precision/activation_amax/")}
    names = ["net.0", "net.1", "net.2", "net", "<model>"]
    assert keys == {f"precision/activation_amax/{n}" for n in names}
    # a Sequential returns its last child's tensor, the model returns the Sequential's: the same largest value
    last = logger.calls[-1][1]
    assert last["precision/activation_amax/net"] == last["precision/activation_amax/net.2"]
    assert last["precision/activation_amax/<model>"] == last["precision/activation_amax/net.2"]
    assert last["precision/activation_amax/net.1"] <= last["precision/activation_amax/net.0"]  # ReLU only shrinks


@pytest.mark.on_device
def test_an_overflow_in_fp32_is_found_and_named_once_with_the_remedy():
    logger = RecordingLogger()
    monitor = ActivationRangeMonitor(every_n_steps=2)
    messages = [m for m in run(Middle(Scale(1e6)), monitor, logger) if "FP16's largest" in m]  # no plugin: FP32
    assert monitor.fp16_overflow_modules == ["net.1"]  # not the ReLU or Linear after it, not the containers
    assert len(messages) == 1
    assert "`net.1`" in messages[0] and "fp32_modules=DEFAULT_FP32_MODULES + (Scale,)" in messages[0]
    assert "precision='bf16'" in messages[0]
    assert all(v > 0.3 for _, v in logger.series(OVER))  # Scale, ReLU and the last Linear's outputs


@pytest.mark.on_device
def test_works_with_the_plugin_in_every_format_and_with_lightnings_own_precision():
    for plugin, precision in [(MixedPrecisionPlugin("fp16"), None), (MixedPrecisionPlugin("bf16"), None),
                              (None, "bf16-mixed")]:  # fmt: skip
        monitor = ActivationRangeMonitor(every_n_steps=2)
        kwargs = {"precision": precision} if precision else {}
        run(Middle(Scale(1e3)), monitor, RecordingLogger(), plugin=plugin, **kwargs)
        assert monitor.fp16_overflow_modules == [], (plugin, precision)


@pytest.mark.on_device
def test_a_logger_without_histograms_gets_the_scalars_and_one_warning():
    logger = RecordingLogger()
    messages = run(TinyRegressor(), ActivationRangeMonitor(every_n_steps=1), logger)
    assert len(logger.series(OVER)) == 6
    assert len([m for m in messages if "only the scalars" in m]) == 1


@pytest.mark.on_device
def test_no_logger_is_refused_at_fit():
    with pytest.raises(MisconfigurationException, match="ActivationRangeMonitor.*no logger"):
        run(TinyRegressor(), ActivationRangeMonitor(), logger=False)


@pytest.mark.on_device
def test_the_hooks_are_off_between_sampled_steps_and_after_fit():
    seen = []

    class Spy(TinyRegressor):
        def training_step(self, batch, batch_idx):
            seen.append(sum(len(m._forward_hooks) for m in self.modules()))
            return super().training_step(batch, batch_idx)

    model = Spy()
    run(model, ActivationRangeMonitor(every_n_steps=3), RecordingLogger())
    assert [bool(n) for n in seen] == [False, False, True, False, False, True]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# ---------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "50", None])
def test_every_n_steps_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=rf"every_n_steps={bad!r}.*integer >= 1"):
        ActivationRangeMonitor(every_n_steps=bad)


@pytest.mark.parametrize("name", ["per_module", "log_image"])
@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_flags_must_be_bools(name, bad):
    with pytest.raises(ValueError, match=rf"{name}={bad!r} is not allowed: use True or False"):
        ActivationRangeMonitor(**{name: bad})


def test_defaults():
    m = ActivationRangeMonitor()
    assert (m.every_n_steps, m.per_module, m.log_image, m.fp16_overflow_modules) == (50, False, True, [])


# ---------------------------------------------------------------------------------------------- the picture
# (format, smallest subnormal, smallest normal, largest value), as log2: what the bands are drawn from
BANDS = [
    ("fp16", -24, -14, math.log2(65504)),
    ("bf16", -133, -126, math.log2(torch.finfo(torch.bfloat16).max)),
    ("fp8 e4m3", -9, -6, math.log2(448)),
    ("fp8 e5m2", -16, -14, math.log2(57344)),
]


@pytest.mark.parametrize("name, sub, normal, top", BANDS, ids=[b[0] for b in BANDS])
def test_format_bands_are_the_formats_limits(name, sub, normal, top):
    band = {b.name: b for b in format_bands()}[name]
    assert band == FormatBand(name, sub, normal, pytest.approx(top))


@needs_matplotlib
@pytest.mark.parametrize("with_grads", [True, False])
def test_the_picture_is_an_rgb_image_with_something_drawn(with_grads):
    acts = gradient_range([torch.randn(1000)], 1.0).histogram
    grads = gradient_range([torch.randn(1000) * 2.0**-20], 1.0).histogram if with_grads else None
    image = render_ranges_vs_formats(acts, grads, 2.0**16, step=49)
    assert image.dtype == np.uint8 and image.shape == (560, 1000, 3)
    assert (image < 128).mean() > 0.01  # text, bars and bands, not a blank canvas
    empty = render_ranges_vs_formats([0] * NUM_BUCKETS, None, 1.0, step=0)
    assert empty.shape == image.shape
