"""ActivationRangeMonitor read back the way a user reads it: TensorBoard event files, the picture as a PNG."""

import io
import warnings

import lightning as L
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image
from torch import nn

from lightning_mp import GradientRangeMonitor, LossScaleMonitor, MixedPrecisionPlugin, ranges_plot
from lightning_mp.monitors.activation_range import ActivationRangeMonitor
from tests.conftest import module_device, regression_data, trainer_kwargs
from tests.test_activation_range_monitor import needs_matplotlib
from tests.test_callbacks_integration import events, left_edges, scalars
from tests.test_overflow_locator import Scale
from tests.test_overflow_locator_integration import Middle

HIST, IMAGE = "precision/activation_log2_magnitude", "precision/ranges_vs_formats"

pytestmark = pytest.mark.on_device  # every test here is a Trainer run
OVER, UNDER = "precision/activation_overflow_fraction", "precision/activation_underflow_fraction"


class Fill(nn.Module):
    """Returns ``value`` in every element (times 1 + 0 * x, so gradients still flow)."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, x):
        return x * 0 + self.value


def fit(model, callbacks, log_dir, plugin=None, max_steps=4, **kwargs):
    logger = TensorBoardLogger(log_dir)
    plugins = [plugin] if plugin is not None else []
    kwargs.update(logger=logger, max_steps=max_steps, log_every_n_steps=1)
    trainer = L.Trainer(plugins=plugins, callbacks=callbacks, **trainer_kwargs(**kwargs))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, regression_data())
    return events(logger.log_dir), [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def fp32_overflow_run(request, tmp_path_factory):
    """A plain FP32 run (no plugin) whose `net.1` multiplies by 1e6: fine in FP32, an overflow in FP16."""
    accelerator = module_device(request)  # set up before the per-test device switch
    monitor = ActivationRangeMonitor(every_n_steps=2, per_module=True)
    acc, messages = fit(Middle(Scale(1e6)), [monitor], tmp_path_factory.mktemp("tb"), accelerator=accelerator)
    return acc, messages, monitor


def test_an_fp32_run_lists_exactly_the_module_fp16_would_overflow_in(fp32_overflow_run):
    _, messages, monitor = fp32_overflow_run
    assert monitor.fp16_overflow_modules == ["net.1"]
    named = [m for m in messages if "FP16's largest value" in m]
    assert len(named) == 1 and "`net.1`" in named[0] and "fp32_modules" in named[0]


@needs_matplotlib
def test_the_tags_are_in_the_event_file_on_the_sampled_steps(fp32_overflow_run):
    acc, _, _ = fp32_overflow_run
    tags = acc.Tags()
    assert HIST in tags["histograms"] and IMAGE in tags["images"]
    assert {OVER, UNDER, "precision/activation_amax/net.1", "precision/activation_amax/<model>"} <= set(tags["scalars"])
    assert [s for s, _ in scalars(acc, OVER)] == [1, 3]
    assert [e.step for e in acc.Histograms(HIST)] == [1, 3]
    assert [e.step for e in acc.Images(IMAGE)] == [1, 3]
    amax = dict(scalars(acc, "precision/activation_amax/net.1"))
    before = dict(scalars(acc, "precision/activation_amax/net.0"))
    assert amax[1] == pytest.approx(before[1] * 1e6, rel=1e-3) and amax[1] > 65504
    assert all(0.3 < v < 1 for _, v in scalars(acc, OVER))


@needs_matplotlib
def test_the_picture_decodes_as_a_png(fp32_overflow_run):
    acc, _, _ = fp32_overflow_run
    data = acc.Images(IMAGE)[-1].encoded_image_string
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(io.BytesIO(data))
    image.load()
    assert image.format == "PNG" and image.size == (1000, 560)


def test_the_histogram_holds_each_output_once_in_its_octave(tmp_path):
    # net.1 fills 8 x 16 elements with 2^-30 and the ReLU keeps them: 256 elements in bucket [-30, -29), and
    # 2^-30 is below FP16's smallest subnormal (2^-24), so all of them count as underflow
    acc, _ = fit(Middle(Fill(2.0**-30)), [ActivationRangeMonitor(every_n_steps=1, log_image=False)], tmp_path)
    for event in acc.Histograms(HIST):
        assert left_edges(event.histogram_value)[-30] == 256
    numel = 8 * 16 * 3 + 8  # three distinct (8, 16) outputs and the (8, 1) one; the containers return the last
    assert all(v == pytest.approx(256 / numel) for _, v in scalars(acc, UNDER))
    assert "images" not in acc.Tags() or IMAGE not in acc.Tags()["images"]


@needs_matplotlib
def test_in_an_fp16_run_with_every_monitor_all_tags_arrive(tmp_path):
    callbacks = [LossScaleMonitor(), GradientRangeMonitor(every_n_steps=2), ActivationRangeMonitor(every_n_steps=2)]
    acc, _ = fit(Middle(Scale(2.0)), callbacks, tmp_path, plugin=MixedPrecisionPlugin("fp16", init_scale=2.0**8))
    tags = acc.Tags()
    assert {HIST, "precision/grad_log2_magnitude"} <= set(tags["histograms"])
    assert {OVER, UNDER, "precision/loss_scale"} <= set(tags["scalars"]) and IMAGE in tags["images"]
    assert all(v == 0 for _, v in scalars(acc, OVER))


def test_without_matplotlib_one_warning_and_no_image(tmp_path, monkeypatch):
    monkeypatch.setattr(ranges_plot, "plotting_available", lambda: False)
    acc, messages = fit(Middle(Scale(1.0)), [ActivationRangeMonitor(every_n_steps=1)], tmp_path)
    assert len([m for m in messages if "matplotlib, which is not installed" in m]) == 1
    assert IMAGE not in acc.Tags()["images"] and len(scalars(acc, OVER)) == 4


@needs_matplotlib
def test_gradients_in_the_picture_come_from_the_plugins_unscaled_grads(tmp_path, monkeypatch):
    drawn = []
    original = ranges_plot.render_ranges_vs_formats

    def spy(acts, grads, scale, step, scale_label="loss scale"):
        drawn.append((sum(grads), scale, scale_label))
        return original(acts, grads, scale, step, scale_label)

    monkeypatch.setattr(ranges_plot, "render_ranges_vs_formats", spy)
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8, growth_interval=1000)
    fit(Middle(Scale(1.0)), [ActivationRangeMonitor(every_n_steps=2)], tmp_path, plugin=plugin)
    numel = sum(p.numel() for p in Middle(Scale(1.0)).parameters())
    assert [(n <= numel, s, label) for n, s, label in drawn] == [(True, 256.0, "loss scale")] * 2
    assert all(n > 0 for n, _, _ in drawn)
    fit(Middle(Scale(1.0)), [ActivationRangeMonitor(every_n_steps=2)], tmp_path, plugin=MixedPrecisionPlugin("bf16"))
    assert drawn[-1][1:] == (2.0**16, "FP16's starting scale")
