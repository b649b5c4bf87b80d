"""benchmarks/zoo.py at its --quick size: the header names the CPU capability and versions, the table has one row
per model with positive step times and ratios; a variant that raises is reported in its row and the zoo goes on;
without transformers its models are skipped with one line."""

import argparse
import importlib.util
import logging
import mmap
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ZOO = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo.py"
NUMBER = r"(\d+\.\d+)"


def _table(output: str) -> tuple[list[str], dict[str, list[str]]]:
    lines = [line for line in output.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])}
    return header, rows


@pytest.fixture
def zoo():
    spec = importlib.util.spec_from_file_location("benchmarks_zoo", ZOO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads, level = torch.get_num_threads(), logging.getLogger("lightning.pytorch").level
    yield module
    torch.set_num_threads(threads)  # main() sets the process's threads and quiets Lightning's logger
    logging.getLogger("lightning.pytorch").setLevel(level)


@pytest.mark.slow
def test_quick_zoo_prints_one_row_of_positive_times_and_ratios_per_model(tmp_path):
    models = ["gpt", "gpt2-2x64" if importlib.util.find_spec("transformers") else "encoder"]
    path = os.pathsep.join(filter(None, [str(ZOO.parents[1]), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run([sys.executable, str(ZOO), "--quick", "--rounds", "2", "--models", *models], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert f"CPU capability: {torch.backends.cpu.get_cpu_capability()}" in output
    assert f"torch {torch.__version__}" in output and "1 thread(s)" in output
    header, rows = _table(proc.stdout)
    assert header == ["model", "fp32 ms", "bf16-mixed ms", "ours bf16 ms", "ours fp16 ms",
                      "ours bf16 / bf16-mixed (CPU)", "ours bf16 / bf16-mixed (wall)",
                      "ours fp16 / fp32 (CPU)", "ours fp16 / fp32 (wall)"]  # fmt: skip
    assert list(rows) == models
    for model, cells in rows.items():
        for name, cell in zip(header[1:], cells):
            match = re.match(NUMBER, cell)
            assert match and float(match.group(1)) > 0, f"{model}, {name}: {cell!r}\n{output[-3000:]}"
        assert re.fullmatch(rf"{NUMBER} \[{NUMBER}-{NUMBER}\]", cells[4]), cells[4]  # 2 rounds: median [range]
    assert "ERROR" not in proc.stdout


@pytest.mark.slow
def test_a_failing_variant_is_reported_in_its_row_and_the_others_are_timed(zoo, monkeypatch, capsys):
    def broken():
        raise RuntimeError("boom\nsecond line")

    # no lightning_mp plugin involved: "ours" are stand-ins, one of which raises
    monkeypatch.setitem(zoo.VARIANTS, "ours bf16", broken)
    monkeypatch.setitem(zoo.VARIANTS, "ours fp16", lambda: {"precision": "32-true"})
    zoo.main(["--quick", "--rounds", "2", "--models", "gpt"])
    output = capsys.readouterr().out
    header, rows = _table(output)
    cells = dict(zip(header[1:], rows["gpt"]))
    assert cells["ours bf16 ms"] == cells["ours bf16 / bf16-mixed (CPU)"] == "error"
    assert float(cells["fp32 ms"]) > 0 and float(cells["ours fp16 / fp32 (CPU)"].split()[0]) > 0
    assert "ERROR gpt / ours bf16: RuntimeError: boom\n" in output


def test_without_transformers_its_models_are_skipped_with_the_install_hint(zoo, monkeypatch, capsys):
    monkeypatch.setattr(zoo, "transformers", None)
    zoo.main(["--quick", "--rounds", "1", "--models", "gpt2-2x64", "llama-2x64"])
    output = capsys.readouterr().out
    assert 'skipped gpt2-2x64, llama-2x64: transformers is not installed (pip install -e ".[bench]")' in output
    assert _table(output)[1] == {}


@pytest.mark.slow
def test_bytecode_counts_are_deterministic_and_printed_as_a_second_table(zoo, capsys):
    args = argparse.Namespace(quick=True, steps=3)
    build = zoo.MODELS["gpt"][0]
    first = zoo.bytecodes(build, "ours bf16", args)
    assert first > 1000 and zoo.bytecodes(build, "ours bf16", args) == first  # no noise: the same count again
    assert zoo.bytecodes(build, "fp32", args) < first  # the plugin's hooks and checks are Python the count sees
    zoo.main(["--quick", "--rounds", "1", "--models", "gpt", "--bytecodes"])
    output = capsys.readouterr().out
    table = output.split("Python bytecodes in one training step")[1]
    header, rows = _table(table)
    assert header == ["model", *zoo.VARIANTS] and list(rows) == ["gpt"]
    assert all(cell.isdigit() and int(cell) > 1000 for cell in rows["gpt"])
    assert rows["gpt"][list(zoo.VARIANTS).index("ours bf16")] == str(first)


@pytest.mark.slow
def test_unchecked_adds_ours_bf16_without_the_check_and_its_ratio_to_bf16_mixed(zoo, capsys):
    (make,) = zoo.UNCHECKED.values()
    assert make()["plugins"][0].core.check_finite is False
    zoo.main(["--quick", "--rounds", "1", "--models", "gpt", "--unchecked"])
    header, rows = _table(capsys.readouterr().out)
    assert header[5] == "ours bf16 unchecked ms" and header[-2:] == [
        "ours bf16 unchecked / bf16-mixed (CPU)", "ours bf16 unchecked / bf16-mixed (wall)"]
    assert all(float(cell.split()[0]) > 0 for cell in rows["gpt"])


def test_the_fault_counter_sees_this_threads_first_touch_of_fresh_memory(zoo):
    # a mapping of our own: a 64 MiB tensor from the allocator came back already mapped once in a full suite run (no
    # fault at all), and torch's fill splits its pages among the intra-op threads; small pages only, each written
    # once from this thread
    pages = 16 << 10
    region = mmap.mmap(-1, pages * mmap.PAGESIZE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)  # a huge page would fault once for 512 small ones
    offsets = range(0, len(region), mmap.PAGESIZE)
    before = zoo._faults()
    for offset in offsets:
        region[offset] = 1
    touched = zoo._faults() - before
    assert touched >= 0.9 * pages, touched  # each page faults once
    before = zoo._faults()
    for offset in offsets:
        region[offset] = 2  # the same pages again: mapped already
    assert zoo._faults() - before < 100
    region.close()


@pytest.mark.slow
def test_faults_adds_a_table_of_page_faults_per_step_per_variant(zoo, capsys):
    zoo.main(["--quick", "--rounds", "1", "--models", "gpt", "--faults"])
    output = capsys.readouterr().out
    table = output.split("Minor page faults in one training step")[1]
    header, rows = _table(table)
    assert header == ["model", *zoo.VARIANTS] and list(rows) == ["gpt"]
    assert all(cell.isdigit() for cell in rows["gpt"]), rows
    assert _table(output.split("Minor page faults")[0])[0][0] == "model"  # the timing table comes first, whole


def test_steady_malloc_reruns_the_same_zoo_in_a_child_whose_glibc_keeps_freed_memory(zoo, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(zoo.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 0)
    for key in zoo.STEADY_MALLOC:
        monkeypatch.delenv(key, raising=False)
    zoo.main(["--quick", "--rounds", "3", "--models", "gpt", "--steady-malloc", "--faults"])
    ((cmd, env),) = calls
    assert cmd[1:] == [str(ZOO), "--quick", "--rounds", "3", "--models", "gpt", "--faults", "--steady-malloc"]
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) >= 1 << 30 and int(env["MALLOC_TRIM_THRESHOLD_"]) >= 1 << 40
    assert "--steady-malloc: MALLOC_MMAP_THRESHOLD_=" in capsys.readouterr().out
    # a failing child fails the command
    monkeypatch.setattr(zoo.subprocess, "call", lambda cmd, env: 3)
    with pytest.raises(SystemExit) as exit_info:
        zoo.main(["--quick", "--models", "gpt", "--steady-malloc"])
    assert exit_info.value.code == 3
