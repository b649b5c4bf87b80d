"""The GPU check keeps what it measured: the suite's deadline (tests/conftest.py), the CUDA marker that selects the
CUDA-only tests, and the table's rows, each in its own process (benchmarks/gpu_table.py). The whole check at tiny
sizes is `bash scripts/gpu_check.sh --dry-run`, which CI runs."""

import importlib.util
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module(name):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pytest(*args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_MP_TEST_DEADLINE": ""}  # empty: no deadline
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_the_cuda_suites_marker_selects_the_cuda_only_no_sync_test():
    # `@cuda` was a skipif only: `-m "on_device or cuda"` (the CUDA suite) dropped the clean step's one CUDA test
    run = _pytest("--collect-only", "-q", "-m", "on_device or cuda", "tests/test_deferred.py")
    assert "test_a_clean_cuda_step_with_a_fused_optimizer_makes_no_host_sync" in run.stdout, run.stdout + run.stderr


def test_a_test_that_would_start_after_the_deadline_skips_and_the_run_keeps_its_counts_and_junit_file(tmp_path):
    # the first test moves the deadline into the past (what the clock does in a long run); the second must not start
    (tmp_path / "test_late.py").write_text(
        "import time\n"
        "def test_runs_before_the_deadline(request):\n"
        "    request.config.option.deadline = time.time() - 1\n"
        "def test_would_start_after_it():\n"
        "    raise AssertionError('started after the deadline')\n"
    )
    junit = tmp_path / "suite.xml"
    run = _pytest(str(tmp_path / "test_late.py"), "-p", "tests.conftest", "--rootdir", str(tmp_path), "-q", "-rs",
                  "--deadline", str(time.time() + 3600), "--junitxml", str(junit))  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "1 passed, 1 skipped" in out.splitlines()[-1], out
    assert "--deadline: the run's deadline passed" in out
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert cases["test_runs_before_the_deadline"].find("skipped") is None
    assert "deadline passed" in cases["test_would_start_after_it"].find("skipped").get("message")


def _probe(variant, order, limit=60, needs=None):
    return dict(model="probe", table="probe", variant=variant, name=f"{variant} {order}", order=order, limit=limit,
                needs=needs, compile=False, dry=True)  # fmt: skip


def test_a_row_that_raises_or_hangs_keeps_the_rows_before_it_and_the_rows_after_it_still_run(tmp_path):
    table = _module("gpu_table")
    specs = [_probe("ok", 0), _probe("raise", 1), _probe("hang", 2, limit=3), _probe("ok", 3)]
    done = table.run_table(specs, tmp_path, deadline=time.time() + 600)
    lines = [json.loads(line) for line in (tmp_path / "table_rows.jsonl").read_text().splitlines()]
    assert [r["name"] for r in lines] == ["ok 0", "raise 1", "hang 2", "ok 3"] == [r["name"] for r in done]
    assert lines[0]["tokens_per_s"] == lines[3]["tokens_per_s"] == 1.0
    assert lines[1]["error"] == "RuntimeError: the probe row raised, as asked"
    assert lines[2]["error"] == "timed out after 3 s (killed)"
    assert lines[2]["seconds"] < 30  # killed at its limit, not at the child's hour of sleep
    md = (tmp_path / "table.md").read_text()
    assert "| probe | raise 1 | FAILED: RuntimeError: the probe row raised, as asked |" in md
    assert "| probe | hang 2 | FAILED: timed out after 3 s (killed) |" in md


def test_rows_without_torchao_or_past_the_deadline_say_so_without_starting(tmp_path, monkeypatch):
    table = _module("gpu_table")
    real = importlib.util.find_spec
    monkeypatch.setattr(table.importlib.util, "find_spec", lambda name: None if name == "torchao" else real(name))
    table.run_table([_probe("hang", 0, needs="torchao")], tmp_path, deadline=time.time() + 600)
    table.run_table([_probe("hang", 0)], tmp_path / "late", deadline=time.time() - 1)
    assert "| probe | hang 0 | skipped: no torchao |" in (tmp_path / "table.md").read_text()
    late = (tmp_path / "late" / "table.md").read_text()
    assert "| probe | hang 0 | not run: the table's deadline had passed |" in late


def test_every_wide_fp8_and_torchao_row_is_compiled_and_ratios_are_against_the_same_models_bf16_mixed():
    table = _module("gpu_table")
    rows = table.rows(dry=False)
    llama = {r["name"] for r in rows if r["table"] == table.LLAMA}
    assert llama == {"Lightning bf16-mixed compiled", "ours bf16 compiled", "ours fp8 rowwise compiled",
                     "ours fp8 tensorwise compiled", "torchao fp8 tensorwise compiled"}  # fmt: skip
    done = [dict(table=table.GPT, name="Lightning bf16-mixed", variant="Lightning bf16-mixed", order=0,
                 tokens_per_s=100.0, peak_mib=10.0, loss=1.0, steps=3),
            dict(table=table.LLAMA, name="Lightning bf16-mixed compiled", variant="Lightning bf16-mixed", order=1,
                 tokens_per_s=10.0, peak_mib=50.0, loss=1.0, steps=3),
            dict(table=table.LLAMA, name="ours fp8 rowwise compiled", variant="ours fp8 rowwise", order=2,
                 tokens_per_s=15.0, peak_mib=40.0, loss=1.0, steps=3, graphs=1, breaks=0)]  # fmt: skip
    line = table.markdown(done, None).splitlines()[-1]
    assert line.startswith("| Llama 4096 wide | ours fp8 rowwise compiled | 15 | 1.500 | 40 | 0.800 |"), line


@pytest.mark.parametrize("floor, verdict", [("2.11", "at or above our floor"), ("99.0", "BELOW our floor")])
def test_the_check_says_whether_torch_is_at_our_floor_and_what_a_missing_torchao_means(floor, verdict, monkeypatch):
    env = _module("gpu_env")
    monkeypatch.setattr(env, "torch_floor", lambda: tuple(int(p) for p in floor.split(".")))
    real = importlib.util.find_spec
    monkeypatch.setattr(env.importlib.util, "find_spec", lambda name: None if name == "torchao" else real(name))
    lines = env.pieces()
    assert verdict in lines[0]
    assert any(line.startswith("torchao: absent -> no FP8 rows") for line in lines)


def test_the_dry_runs_probe_wheel_installs_from_a_local_folder_with_no_index(tmp_path):
    wheel = _module("gpu_env").probe_wheel(tmp_path / "wheels")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target),
                    str(wheel)], check=True, timeout=300)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", "import gpu_check_probe as p; print(p.VERSION)"], text=True,
                         capture_output=True, env={**os.environ, "PYTHONPATH": str(target)}, check=True)  # fmt: skip
    assert out.stdout.strip() == "1.0"
