"""benchmarks/fidelity.py at its --quick size: every row of the table exists for both models with numbers in every
cell (FP32's own differences are '-'), the statements of issue 47 are printed as PASS/FAIL lines, the FP8 rows say
that Linears computed in FP8, the scheduled rows say that they switched at their step, and --out gets the table."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao.optim")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fidelity.py"
ROWS = ["fp32", "bf16", "fp8", "fp8 -> bf16 at 90%", "fp16", "fp16 -> bf16 at 90%", "masters + AdamW8bit",
        "lean + AdamW8bit"]
HEADER = ["model", "row", "val loss mean", "val loss min-max", "val vs fp32 (mean)", "val vs fp32 (max)",
          "FP32-eval val vs fp32 (mean)", "FP32-eval val vs fp32 (max)", "train loss mean", "train loss min-max",
          "train vs fp32 (mean)", "train vs fp32 (max)"]


def _table(text: str) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    return cells[0], cells[1:]


def test_quick_run_prints_every_row_for_both_models_and_the_statements(tmp_path):
    models = ["gpt", "llama"] if importlib.util.find_spec("transformers") else ["gpt"]
    out = tmp_path / "fidelity.md"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--models", *models, "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}" in proc.stdout

    header, rows = _table(proc.stdout)
    assert header == HEADER
    assert [(r[0], r[1]) for r in rows] == [(m, row) for m in models for row in ROWS]
    for r in rows:
        assert len(r) == len(HEADER), r
        for mean, spread in ((r[2], r[3]), (r[8], r[9])):  # val and train loss: mean, min-max over the 2 seeds
            assert re.fullmatch(r"\d+\.\d{4}", mean) and re.fullmatch(r"\d+\.\d{4}-\d+\.\d{4}", spread), r
        differences = [r[4], r[5], r[6], r[7], r[10], r[11]]
        if r[1] == "fp32":
            assert differences == ["-"] * 6
        else:
            assert all(re.fullmatch(r"[+-]\d+\.\d\d%", d) for d in differences), r

    for model in models:  # three statements per model, each judged
        statements = [line for line in proc.stdout.splitlines() if re.match(rf"(PASS|FAIL) {model}: ", line)]
        assert len(statements) == 3, proc.stdout[-3000:]
    assert re.search(r"lean \+ AdamW8bit ends within .*final FP32 weights (bit-identical|NOT bit-identical)",
                     proc.stdout)
    fp8_counts = [int(n) for n in re.findall(r", (\d+) Linears in FP8", proc.stdout)]
    assert len(fp8_counts) == 2 * 2 * len(models) and min(fp8_counts) > 0  # fp8 and fp8 -> bf16, 2 seeds each
    switches = re.findall(r"steps 0-(\d+) in \[(.*?)\], steps (\d+)-(\d+) in \['bf16'\]", proc.stdout)
    assert len(switches) == 2 * 2 * len(models)  # fp8 -> bf16 and fp16 -> bf16, 2 seeds each
    assert "PASS every fp8 run computed some Linears in FP8 and every scheduled run switched at its step" in output

    written = out.read_text()
    assert _table(written) == (header, rows)
    assert "PASS" in written or "FAIL" in written
