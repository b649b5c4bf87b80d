"""Both monitors on tiny Trainer runs, read back the way a user reads them: TensorBoard event files, the TensorBoard
server's HTTP API, a CSV file."""

import contextlib
import csv
import json
import math
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lightning_mp import GradientRangeMonitor, LossScaleMonitor, MixedPrecisionPlugin
from lightning_mp import gradient_range_monitor as grm
from tests.conftest import TinyRegressor, module_device, regression_data, trainer_kwargs
from tests.conftest import TwoOptimizers
from tests.test_loss_scale_monitor import RecordingLogger

pytestmark = pytest.mark.on_device  # every test here is a Trainer run

HIST = "precision/grad_log2_magnitude"
UNDER, OVER, ZERO = (f"precision/grad_{k}_fraction" for k in ("underflow", "overflow", "zero"))
PROBE = 16  # elements in the probe parameter
NUMEL = 8 * 16 + 16 + 16 + 1 + PROBE  # gradient elements of Probed: two Linear layers and the probe


class Probed(TinyRegressor):
    """TinyRegressor plus a parameter whose gradient is exactly ``probe_grad`` in every element, every step."""

    def __init__(self, probe_grad=2.0**-20, **kwargs):
        super().__init__(**kwargs)
        self.probe = nn.Parameter(torch.ones(PROBE))
        self.probe_grad = probe_grad

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + (self.probe.float() * self.probe_grad).sum()


def fit(model, plugin, callbacks, logger, **kwargs):
    kwargs.setdefault("log_every_n_steps", 1)
    plugins = [plugin] if plugin is not None else []
    trainer = L.Trainer(plugins=plugins, callbacks=callbacks, **trainer_kwargs(logger=logger, **kwargs))
    trainer.fit(model, regression_data())
    return trainer


def events(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={k: 0 for k in ("scalars", "histograms", "tensors")})
    acc.Reload()
    return acc


def scalars(acc, tag):
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def left_edges(histogram_value):
    """{left edge (integer log2): count} of the non-empty buckets of a logged histogram."""
    lefts = [histogram_value.min, *histogram_value.bucket_limit[:-1]]
    return {int(left): int(c) for left, c in zip(lefts, histogram_value.bucket) if c}


@pytest.fixture(scope="module")
def fp16_run(request, tmp_path_factory):
    """fp16, scale 2^8 growing every 3 clean steps, an overflow at step 5, histograms every 2nd step."""
    accelerator = module_device(request)  # set up before the per-test device switch
    logger = TensorBoardLogger(tmp_path_factory.mktemp("tb"))
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8, growth_interval=3)
    callbacks = [LossScaleMonitor(), GradientRangeMonitor(every_n_steps=2, per_param=True)]
    fit(Probed(fault_at={5}), plugin, callbacks, logger, max_steps=10, accelerator=accelerator)
    return logger


EXPECTED_SCALE = [256.0] * 3 + [512.0] * 3 + [256.0] * 3 + [512.0]  # steps 0-9; step 5 overflows at 512
EXPECTED_SKIPPED = [0.0] * 5 + [1.0] * 5


# ---------------------------------------------------------------------------------------------- the main run
def test_tensorboard_scale_curve_grows_drops_after_the_overflow_and_counts_one_skip(fp16_run):
    acc = events(fp16_run.log_dir)
    assert scalars(acc, "precision/loss_scale") == list(enumerate(EXPECTED_SCALE))
    assert scalars(acc, "precision/skipped_steps") == list(enumerate(EXPECTED_SKIPPED))


def test_histograms_exist_exactly_for_the_sampled_steps_with_the_probe_in_its_bucket(fp16_run):
    acc = events(fp16_run.log_dir)
    params = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias", "probe"]
    assert set(acc.Tags()["histograms"]) == {HIST} | {f"{HIST}/{p}" for p in params}
    sampled = [1, 3, 5, 7, 9]  # every_n_steps=2: steps n-1, 2n-1, ...
    for tag in acc.Tags()["histograms"]:
        assert [h.step for h in acc.Histograms(tag)] == sampled, tag
    for tag in (UNDER, OVER, ZERO):
        assert [s for s, _ in scalars(acc, tag)] == sampled, tag

    for h in acc.Histograms(f"{HIST}/probe"):  # |g| = 2^-20 exactly: one bucket, [-20, -19), with exact edges
        assert (h.histogram_value.min, h.histogram_value.max) == (-20.0, -19.0)
        assert left_edges(h.histogram_value) == {-20: PROBE}
    for h in acc.Histograms(HIST):
        if h.step != 5:
            assert left_edges(h.histogram_value)[-20] >= PROBE
            assert h.histogram_value.num <= NUMEL  # every element at most once


def test_the_overflow_step_is_measured_without_crashing(fp16_run):
    acc = events(fp16_run.log_dir)
    overflow = dict(scalars(acc, OVER))
    assert overflow[5] > 0.5  # the inf loss poisons the gradients: counted as overflow...
    assert all(overflow[s] == 0.0 for s in (1, 3, 7, 9))
    zero = dict(scalars(acc, ZERO))
    at_5 = [h for h in acc.Histograms(HIST) if h.step == 5][0].histogram_value
    # ...and kept out of the histogram, which still shows the finite ones: the probe's term is added after the fault
    assert at_5.num == round((1 - overflow[5] - zero[5]) * NUMEL) == PROBE
    assert left_edges(at_5) == {-20: PROBE}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tensorboard_server_serves_the_logged_scale_curve(fp16_run, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never route localhost via a proxy

    def get(path, **query):
        url = f"{base}{path}?{urllib.parse.urlencode(query)}" if query else base + path
        with opener.open(url, timeout=5) as response:
            return json.loads(response.read())

    log = open(tmp_path / "tensorboard.log", "w+")
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", fp16_run.root_dir, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--load_fast", "false", "--reload_interval", "1"]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        series, deadline = [], time.monotonic() + 60
        while len(series) < len(EXPECTED_SCALE):  # until the server has loaded the whole run
            if server.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"tensorboard did not serve the run (exit {server.poll()}):\n{log.read()[-3000:]}")
            with contextlib.suppress(OSError, ValueError):  # not listening yet, or the run not loaded yet
                runs = get("/data/runs")
                if runs:
                    series = get("/data/plugin/scalars/scalars", run=runs[0], tag="precision/loss_scale")
            time.sleep(0.5)
        assert runs == ["version_0"]
        assert [(step, value) for _, step, value in series] == list(enumerate(EXPECTED_SCALE))
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


# ---------------------------------------------------------------------------------------------- step accounting
def test_gradient_accumulation_logs_both_monitors_once_per_optimizer_step(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8)
    callbacks = [LossScaleMonitor(), GradientRangeMonitor(every_n_steps=1, per_param=True)]
    fit(Probed(), plugin, callbacks, logger, max_steps=4, accumulate_grad_batches=2)  # 8 micro-batches
    acc = events(logger.log_dir)
    assert [s for s, _ in scalars(acc, "precision/loss_scale")] == [0, 1, 2, 3]
    assert [s for s, _ in scalars(acc, UNDER)] == [0, 1, 2, 3]
    probe = acc.Histograms(f"{HIST}/probe")
    assert [h.step for h in probe] == [0, 1, 2, 3]
    # measured after accumulation: Lightning divides each micro-batch's loss by 2, the two halves sum back to 2^-20
    assert all(left_edges(h.histogram_value) == {-20: PROBE} for h in probe)


def test_manual_optimization_with_two_optimizers_logs_once_per_training_step(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8)
    callbacks = [LossScaleMonitor(), GradientRangeMonitor(every_n_steps=1, per_param=True)]
    fit(TwoOptimizers(), plugin, callbacks, logger, max_steps=8)  # 8 optimizer steps = 4 training steps
    acc = events(logger.log_dir)
    assert [s for s, _ in scalars(acc, "precision/loss_scale")] == [0, 1, 2, 3]
    assert [s for s, _ in scalars(acc, ZERO)] == [0, 1, 2, 3]
    params = ["g.weight", "g.bias", "d.weight", "d.bias"]
    for tag in [HIST] + [f"{HIST}/{p}" for p in params]:
        assert [h.step for h in acc.Histograms(tag)] == [0, 1, 2, 3], tag
    # each optimizer's own parameters once: d's gradients, still scaled when g's optimizer steps, are not re-read
    for h in acc.Histograms(HIST):
        assert h.histogram_value.num <= 8 * 8 + 8 + 8 + 1
    for h in acc.Histograms(f"{HIST}/d.weight"):
        assert h.histogram_value.num <= 8


# ---------------------------------------------------------------------------------------------- other loggers, fp32
def test_csv_logger_gets_the_scalars_and_one_warning_about_histograms(tmp_path, recwarn):
    logger = CSVLogger(tmp_path)
    plugin = MixedPrecisionPlugin("fp32")
    callbacks = [LossScaleMonitor(), GradientRangeMonitor(every_n_steps=1)]
    fit(Probed(probe_grad=2.0**-45), plugin, callbacks, logger, max_steps=3)
    with open(f"{logger.log_dir}/metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for key in ("precision/loss_scale", "precision/skipped_steps", UNDER, OVER, ZERO):
        assert [int(r["step"]) for r in rows if r.get(key)] == [0, 1, 2], key
    assert [float(r["precision/loss_scale"]) for r in rows if r["precision/loss_scale"]] == [1.0] * 3
    # an FP32 run answers "would FP16 at its default scale 2^16 lose these?": 2^-45 * 2^16 = 2^-29 < 2^-24, yes
    assert [float(r[UNDER]) for r in rows if r.get(UNDER)] == pytest.approx([PROBE / NUMEL] * 3)
    warned = [w for w in recwarn if "add_histogram_raw" in str(w.message)]
    assert len(warned) == 1 and "CSVLogger" in str(warned[0].message)


def test_gradient_range_monitor_needs_a_logger_and_the_plugin():
    with pytest.raises(MisconfigurationException, match="GradientRangeMonitor.*no logger"):
        fit(TinyRegressor(), MixedPrecisionPlugin("bf16"), [GradientRangeMonitor()], logger=False, max_steps=1)
    with pytest.raises(MisconfigurationException, match=r"GradientRangeMonitor.*MixedPrecisionPlugin.*HINT"):
        fit(TinyRegressor(), None, [GradientRangeMonitor()], RecordingLogger(), max_steps=1)


def test_non_sampled_steps_do_no_work(monkeypatch):
    calls = []
    real = grm.measure_on_device
    monkeypatch.setattr(grm, "measure_on_device", lambda *a, **k: calls.append(1) or real(*a, **k))
    logger = RecordingLogger()
    fit(TinyRegressor(), MixedPrecisionPlugin("bf16"), [GradientRangeMonitor(every_n_steps=4)], logger, max_steps=10)
    assert len(calls) == 2  # steps 3 and 7
    assert [s for s, _ in logger.series(ZERO)] == [3, 7]
    assert not math.isnan(logger.series(ZERO)[0][1])
