"""docs/screenshots.py without a browser: its event-file reader on hand-written and real event files, and its CLI's
errors. The screenshot step itself (Playwright, Chromium) is not run here."""

import importlib.util
import sys
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.tensorboard import SummaryWriter

from lightning_mp import GradientRangeMonitor, LossScaleMonitor, MixedPrecisionPlugin
from lightning_mp.doctor.log2_histogram import LOG2_LOW, NUM_BUCKETS, histogram_kwargs
from tests.conftest import TinyRegressor, regression_data, trainer_kwargs

TOOL = Path(__file__).resolve().parents[1] / "docs" / "screenshots.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("docs_screenshots", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool():
    return load_tool()


def counts(**octaves):
    """A GradientRangeMonitor bucket row: ``counts(m20=5)`` puts 5 elements with log2|g| in [-20, -19)."""
    row = [0] * NUM_BUCKETS
    for key, n in octaves.items():
        row[-int(key[1:]) - LOG2_LOW] = n
    return row


@pytest.fixture
def written(tmp_path):
    """A hand-written fp16 run: the scale 2^16, 2^17, back to 2^16 with one skipped step; three histograms."""
    with SummaryWriter(str(tmp_path / "gpt" / "fp16")) as w:
        for step, (scale, skipped) in enumerate([(2**16, 0), (2**16, 0), (2**17, 0), (2**17, 0), (2**16, 1)]):
            w.add_scalar("precision/loss_scale", scale, step)
            w.add_scalar("precision/skipped_steps", skipped, step)
        for step, value in [(0, 0.25), (2, 0.5), (4, 0.125)]:
            w.add_scalar("precision/grad_underflow_fraction", value, step)
        # 2^-24 and 2^-14 themselves are not below the floors: buckets [-24, -23) and [-14, -13) count as above.
        # The middle histogram must be ignored (first and last only).
        w.add_histogram_raw("precision/grad_log2_magnitude", global_step=0,
                            **histogram_kwargs(counts(m30=4, m24=6, m20=42, m13=48)))
        w.add_histogram_raw("precision/grad_log2_magnitude", global_step=2, **histogram_kwargs(counts(m40=1000)))
        w.add_histogram_raw("precision/grad_log2_magnitude", global_step=4,
                            **histogram_kwargs(counts(m15=1, m14=1, m10=2)))
    return tmp_path


def test_read_run_reports_the_scale_changes_skips_fractions_and_histogram_mass(tool, written):
    info = tool.read_run(written / "gpt" / "fp16")
    assert info["scale_changes"] == [(0, 2**16), (2, 2**17), (4, 2**16)]
    assert info["skipped"] == (4, 1.0)
    assert info["fractions"] == {"precision/grad_underflow_fraction": ((0, 0.25), (4, 0.125), 0.5)}
    first, last = info["histograms"]
    assert (first["step"], first["min"], first["max"], first["total"]) == (0, -30.0, -12.0, 100)
    assert (first["mode"], first["median"]) == (-13, -20)  # median: 4 + 6 + 42 of 100 reach half in [-20, -19)
    assert first["below_2^-24"] == pytest.approx(0.04)
    assert first["below_2^-14"] == pytest.approx(0.52)
    assert (last["step"], last["total"], last["mode"], last["median"]) == (4, 4, -10, -14)
    assert (last["below_2^-24"], last["below_2^-14"]) == (0.0, pytest.approx(0.25))


def test_summary_names_each_run_and_prints_the_numbers(tool, written):
    with SummaryWriter(str(written / "gpt" / "bf16")) as w:  # a second run without a loss scale
        w.add_histogram_raw("precision/grad_log2_magnitude", global_step=0, **histogram_kwargs(counts(m12=7)))
    lines = tool.summary(written)
    text = "\n".join(lines)
    assert "[gpt/fp16] precision/loss_scale, (step, value) where it changed: (0, 2^16), (2, 2^17), (4, 2^16)" in text
    assert "[gpt/fp16] precision/skipped_steps at step 4: 1" in text
    assert "[gpt/fp16] precision/grad_underflow_fraction: step 0 0.25, step 4 0.125, max 0.5" in text
    assert "|g| < 2^-24: 4.00%, |g| < 2^-14: 52.00% of 100 nonzero elements" in text
    assert "[gpt/bf16] precision/grad_log2_magnitude step 0: log2|g| in [-12, -11), mode bucket -12" in text
    assert not any(line.startswith("[gpt/bf16] precision/loss_scale") for line in lines)
    assert sum(line.startswith("[gpt/bf16] precision/grad_log2_magnitude") for line in lines) == 1  # one histogram


def test_reader_agrees_with_a_real_fp16_run(tool, tmp_path):
    """Scale 2^8 growing every 3 clean steps, an inf loss at step 5: the reader sees what the plugin did."""
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8, growth_interval=3)
    trainer = L.Trainer(plugins=[plugin], callbacks=[LossScaleMonitor(), GradientRangeMonitor(every_n_steps=2)],
                        **trainer_kwargs(logger=TensorBoardLogger(tmp_path, name="gpt", version="fp16"),
                                         max_steps=10, log_every_n_steps=1))
    trainer.fit(TinyRegressor(fault_at={5}), regression_data())
    info = tool.read_run(tmp_path / "gpt" / "fp16")
    assert info["scale_changes"] == [(0, 256.0), (3, 512.0), (6, 256.0), (9, 512.0)]
    assert info["skipped"] == (9, float(plugin.skipped_steps)) == (9, 1.0)
    assert [h["step"] for h in info["histograms"]] == [1, 9]
    assert all(h["total"] > 0 and h["min"] <= h["mode"] < h["max"] for h in info["histograms"])
    assert set(info["fractions"]) == set(tool.FRACTIONS)


def test_the_tool_loads_and_summarizes_without_playwright(written, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "playwright", None)  # import playwright now raises ImportError
    monkeypatch.setitem(sys.modules, "playwright.sync_api", None)
    load_tool().main(["summary", str(written)])
    assert "[gpt/fp16] precision/skipped_steps at step 4: 1" in capsys.readouterr().out


def test_train_refuses_to_append_to_existing_runs(tool, written):
    with pytest.raises(SystemExit) as exc:  # before any training: TensorBoardLogger would mix the two runs
        tool.main(["train", str(written), "--steps", "1", "--precisions", "fp16"])
    assert "already holds runs of fp16: give an empty OUT_DIR" in str(exc.value.code)


@pytest.mark.parametrize("argv, message", [
    (["summary", "{tmp}/missing"], "no TensorBoard event files under"),
    (["summary", "{tmp}"], "no TensorBoard event files under"),
    (["shoot", "{tmp}", "--chromium", "{tmp}/no-such-browser"], "no Chromium at"),
    (["shoot", "{tmp}", "--chromium", sys.executable], "no TensorBoard event files under"),  # checked before serving
])
def test_cli_exits_with_a_clear_message(tool, tmp_path, argv, message):
    with pytest.raises(SystemExit) as exc:
        tool.main([a.format(tmp=tmp_path) for a in argv])
    assert message in str(exc.value.code)


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: command"),
    (["film", "out"], "invalid choice: 'film'"),
    (["train", "out", "--steps", "0"], "--steps must be a positive integer, got 0"),
    (["train", "out", "--steps", "many"], "invalid int value: 'many'"),
    (["train", "out", "--precisions", "fp8"], "invalid choice: 'fp8'"),
    (["summary"], "the following arguments are required: out"),
])
def test_cli_usage_errors(tool, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        tool.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
