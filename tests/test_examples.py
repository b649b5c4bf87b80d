"""The examples and the GPT harness run end to end at a tiny size: examples/train_gpt.py (the copyable example),
benchmarks/gpt_run.py (command line, YAML config, --native, --summary, errors) and compare_precisions.py (one table
row per run). Each run trains a 1-layer, 32-wide GPT for 3 steps."""

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jsonargparse", reason="the examples use LightningCLI, which needs jsonargparse[signatures]")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BENCHMARKS = EXAMPLES.parent / "benchmarks"

TINY = [
    "--trainer.max_steps", "3",
    "--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2",
    "--data.block_size", "32", "--data.batch_size", "4", "--data.max_bytes", "262144", "--data.max_val_batches", "1",
    "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false", "--trainer.num_sanity_val_steps", "0",
    "--trainer.log_every_n_steps", "1", "--grad_range_monitor.every_n_steps", "1",
]  # fmt: skip


def _load(name):
    folder = BENCHMARKS if (BENCHMARKS / f"{name}.py").exists() else EXAMPLES
    spec = importlib.util.spec_from_file_location(f"examples_{name}", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_gpt():
    return _load("gpt_run")


@pytest.fixture
def run_train_gpt(train_gpt, monkeypatch, tmp_path):
    """train_gpt.main in this process (LightningCLI parses the list as if it were the command line)."""
    monkeypatch.setattr(sys, "argv", ["gpt_run.py"])

    def run(*args):
        return train_gpt.main([*TINY, "--log_dir", str(tmp_path / "runs"), *args])

    return run


def _scalar_tags(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return set(acc.Tags()["scalars"]), set(acc.Tags()["histograms"])


def test_cli_precision_fp16_as_a_script(tmp_path):
    """The real command line, in its own process: the version directory and the JSON summary."""
    summary_path = tmp_path / "summary.json"
    path = os.pathsep.join(filter(None, [str(EXAMPLES.parent), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)  # this checkout's lightning_mp, installed or not
    cmd = [sys.executable, str(BENCHMARKS / "gpt_run.py"), "--precision", "fp16", *TINY,
           "--log_dir", str(tmp_path / "runs"), "--summary", str(summary_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    train_gpt = _load("gpt_run")
    assert tuple(summary) == train_gpt.SUMMARY_KEYS
    assert summary["precision"] == "fp16"
    assert Path(summary["log_dir"]) == tmp_path / "runs" / "fp16"
    assert summary["steps"] == 3
    for key in ("train_loss", "val_loss", "val_ppl", "val_acc", "wall_time_s", "tokens_per_s"):
        assert isinstance(summary[key], float) and summary[key] > 0, key
    assert summary["tokens"] == 3 * 4 * 32
    assert summary["peak_memory_bytes"] > 0 and summary["peak_memory_kind"] == "process_peak_rss"
    assert summary["skipped_steps"] == 0 and summary["loss_scale"] == 2.0**16
    assert "[fp16] 3 steps" in proc.stdout


def test_yaml_config_sets_the_plugin_and_its_init_args(run_train_gpt, tmp_path):
    config = tmp_path / "fp16.yaml"
    config.write_text(
        "trainer:\n"
        "  plugins:\n"
        "    - class_path: lightning_mp.MixedPrecisionPlugin\n"
        "      init_args:\n"
        "        precision: fp16\n"
        "        init_scale: 1024.0\n"
        "        growth_interval: 1000\n"
        "        fp32_ops: [softmax, layer_norm, cross_entropy]\n"
        "        fp32_modules: [torch.nn.LayerNorm]\n"
    )
    summary = run_train_gpt("--config", str(config), "--summary", str(tmp_path / "s.json"))
    assert summary == json.loads((tmp_path / "s.json").read_text())
    assert summary["precision"] == "fp16"
    assert summary["plugin"]["init_scale"] == 1024.0 and summary["plugin"]["growth_interval"] == 1000
    assert summary["plugin"]["fp32_ops"] == ["cross_entropy", "layer_norm", "softmax"]
    assert summary["plugin"]["fp32_modules"] == ["LayerNorm"]
    assert summary["loss_scale"] == 1024.0
    log_dir = tmp_path / "runs" / "fp16"
    assert Path(summary["log_dir"]) == log_dir
    scalars, histograms = _scalar_tags(log_dir)
    assert {"train_loss", "val_loss", "val_ppl", "val_acc"} <= scalars
    assert {"precision/loss_scale", "precision/skipped_steps"} <= scalars
    assert "precision/grad_underflow_fraction" in scalars
    assert "precision/grad_log2_magnitude" in histograms
    # the config.yaml LightningCLI saved beside the logs reproduces the run
    again = run_train_gpt("--config", str(log_dir / "config.yaml"))
    assert again["precision"] == "fp16" and Path(again["log_dir"]) == tmp_path / "runs" / "fp16_1"
    assert again["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-6)


@pytest.mark.parametrize("config", ["gpt_fp32.yaml", "gpt_fp16.yaml", "gpt_bf16.yaml"])
def test_shipped_configs_parse(train_gpt, monkeypatch, capsys, config):
    monkeypatch.setattr(sys, "argv", ["gpt_run.py"])
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.TrainGPTCLI(["--config", str(EXAMPLES / "configs" / config), "--print_config"])
    assert exit_info.value.code == 0
    assert f"precision: {config.split('_')[1].split('.')[0]}" in capsys.readouterr().out


def test_native_bf16_reference_run(run_train_gpt):
    summary = run_train_gpt("--precision", "bf16", "--native")
    assert summary["precision"] == "native-bf16-mixed"
    assert summary["plugin"]["class"].endswith("MixedPrecision") and summary["plugin"]["precision"] == "bf16-mixed"
    assert summary["skipped_steps"] is None and summary["loss_scale"] is None  # no scaler, no inf/NaN guard
    assert summary["log_dir"].endswith("native-bf16-mixed")


def test_unknown_precision_names_the_argument(run_train_gpt, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_train_gpt("--precision", "fp8")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--precision" in err and "'fp8'" in err and "'bf16'" in err


def test_unknown_precision_in_plugin_init_args_names_the_key(run_train_gpt, capsys):
    with pytest.raises(SystemExit):
        run_train_gpt("--trainer.plugins.class_path", "lightning_mp.MixedPrecisionPlugin",
                      "--trainer.plugins.init_args.precision", "fp9")  # fmt: skip
    assert "trainer.plugins[0].init_args.precision: precision='fp9'" in capsys.readouterr().err


def test_precision_twice_is_refused(run_train_gpt, capsys):
    with pytest.raises(SystemExit):
        run_train_gpt("--config", str(EXAMPLES / "configs" / "gpt_fp16.yaml"), "--precision", "bf16")
    assert "set it twice" in capsys.readouterr().err


def test_compare_precisions_writes_one_row_per_run(tmp_path, capsys):
    compare = _load("compare_precisions")
    out = tmp_path / "cmp"
    rc = compare.main(["--max-steps", "3", "--output", str(out), "--runs", "fp16", "native-16-mixed", "--", *TINY[2:]])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "[1/2] fp16: running" in printed and "[2/2] native-16-mixed: done" in printed
    md_rows = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("| ")][1:]
    assert [row.split("|")[1].strip() for row in md_rows] == ["fp16", "native-16-mixed"]
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["precision"] for r in rows] == ["fp16", "native-16-mixed"]
    assert all(float(r["val_loss"]) > 0 and float(r["tokens_per_s"]) > 0 and r["status"] == "ok" for r in rows)
    assert all(r["skipped_steps"] == "0" and float(r["loss_scale"]) == 2.0**16 for r in rows)
    assert (out / "tensorboard" / "fp16").is_dir() and (out / "tensorboard" / "native-16-mixed").is_dir()


def test_compare_precisions_rejects_unknown_run(tmp_path, capsys):
    compare = _load("compare_precisions")
    with pytest.raises(SystemExit):
        compare.main(["--output", str(tmp_path), "--runs", "fp8"])
    assert "--runs: 'fp8' not known" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- the copyable example
def run_example(tmp_path, *args):
    """examples/train_gpt.py as a user runs it, in its own process and working directory."""
    path = os.pathsep.join(filter(None, [str(EXAMPLES.parent), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, str(EXAMPLES / "train_gpt.py"), *args, *TINY]  # a --config first, as LightningCLI wants
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=180,
                          env=dict(os.environ, PYTHONPATH=path))  # fmt: skip


def test_the_example_a_user_copies_is_short():
    assert len((EXAMPLES / "train_gpt.py").read_text().splitlines()) < 100


@pytest.mark.parametrize("args, precision", [((), "bf16"), (("--precision", "fp16"), "fp16"),
                                             (("--config", str(EXAMPLES / "configs" / "gpt_fp16.yaml")), "fp16")])
def test_example_trains_and_logs_the_precision_tags_to_tensorboard(tmp_path, args, precision):
    proc = run_example(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (version,) = (tmp_path / "runs" / "gpt" / precision).iterdir()
    scalars, histograms = _scalar_tags(version)
    assert {"precision/loss_scale", "precision/skipped_steps", "precision/grad_underflow_fraction"} <= scalars
    assert "precision/grad_log2_magnitude" in histograms


def test_example_bad_precision_names_the_allowed_ones(tmp_path):
    proc = run_example(tmp_path, "--precision", "fp8")
    assert proc.returncode != 0 and "precision='fp8' is not supported. Allowed:" in proc.stderr


def test_the_harnesses_load_and_report_no_rss_where_resource_is_missing(monkeypatch):
    """`resource` is POSIX-only: without it (Windows) the scripts still import and leave the RSS figures empty."""
    import torch

    monkeypatch.setitem(sys.modules, "resource", None)  # `import resource` now raises ImportError
    gpt_run = _load("gpt_run")
    assert gpt_run.resource is None
    assert gpt_run.peak_memory(torch.device("cpu")) == (None, "unavailable (no resource module)")
    memory = _load("memory_benchmark")
    assert memory.resource is None and memory._maxrss_mib() == 0.0
    spec = importlib.util.spec_from_file_location("examples_train_resnet_nores", EXAMPLES / "train_resnet.py")
    resnet = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(resnet)
    assert resnet._maxrss() is None
