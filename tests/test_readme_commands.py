"""Every command the README and the documentation pages (``docs/*.md``) give, as written, is driven by a test with
tiny step counts.

The commands are read from the pages themselves (fenced ``bash`` blocks and inline `` `python ...` `` commands), so
a new or changed command fails :func:`test_every_readme_command_is_driven` until it is mapped here: either to the
test elsewhere that already runs it (the examples, the ResNet table, the install and the suite in ``.ci/run``, the
wheel, the docs build), or to the tiny arguments this file appends to run it itself (argparse keeps the last value
of a repeated flag, so the page's own arguments are all passed and only the sizes shrink). ``docs/pypi.md`` is the
package page for an index, not a page of this repository, and is not read.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "2"]

# README command (comments and ``.venv/bin/`` stripped) -> "tests/<file>.py::<test>" that runs it
DRIVEN_ELSEWHERE = {
    'python3 -m venv .venv && pip install -c .ci/constraints.txt -e ".[dev]" && python examples/train_gpt.py':
        "tests/test_examples.py::test_example_trains_and_logs_the_precision_tags_to_tensorboard",  # + .ci/run
    "python -m pytest -q": "tests/test_readme_commands.py::test_the_ci_script_runs_the_readme_test_command",
    "python examples/train_gpt.py --precision fp16":
        "tests/test_examples.py::test_example_trains_and_logs_the_precision_tags_to_tensorboard",
    "python examples/train_gpt.py --config examples/configs/gpt_fp16.yaml":
        "tests/test_examples.py::test_example_trains_and_logs_the_precision_tags_to_tensorboard",
    "python benchmarks/compare_precisions.py --max-steps 30 --seeds 1 --output runs/compare":
        "tests/test_examples.py::test_compare_precisions_writes_one_row_per_run",
    "python benchmarks/compare_precisions.py --max-steps 800 --output runs/compare":
        "tests/test_examples.py::test_compare_precisions_writes_one_row_per_run",
    "python benchmarks/compare_precisions.py --max-steps 800 --seeds 3 --runs fp32 bf16":
        "tests/test_examples.py::test_compare_precisions_over_seeds_reports_mean_spread_and_progress",
    "python examples/train_resnet.py": "tests/test_demos_resnet.py::test_example_table_with_tiny_runs",
    "python examples/train_resnet.py --runs fp32 bf16 --max-steps 30":
        "tests/test_demos_resnet.py::test_example_table_with_tiny_runs",
    "python benchmarks/zoo.py": "tests/test_zoo.py::test_quick_zoo_prints_one_row_of_positive_times_and_ratios_per_model",
    "python benchmarks/zoo.py --rounds 16 --bytecodes --unchecked --faults":
        "tests/test_zoo.py::test_bytecode_counts_are_deterministic_and_printed_as_a_second_table",  # + _unchecked_, _faults_
    "python benchmarks/zoo.py --rounds 16 --unchecked --faults --steady-malloc":
        "tests/test_zoo.py::test_steady_malloc_reruns_the_same_zoo_in_a_child_whose_glibc_keeps_freed_memory",
    # installing into one's own project: pip builds the same wheel from the repository as from a checkout
    'pip install "lightning-mp @ git+<repository URL>"':
        "tests/test_packaging.py::test_first_python_block_runs_in_the_clean_environment",
    "pip wheel . --no-deps -w dist && pip install dist/lightning_mp-*.whl":
        "tests/test_packaging.py::test_first_python_block_runs_in_the_clean_environment",
    "python benchmarks/fidelity.py --out runs/fidelity.md":
        "tests/test_fidelity_script.py::test_quick_run_prints_every_row_for_both_models_and_the_statements",
    'pip install -e ".[site]" && mkdocs build --strict -d build/site':
        "tests/test_docs.py::test_the_docs_build_with_warnings_as_errors",  # + .ci/run
}  # fmt: skip

# README command -> (arguments appended to make it tiny, a line its output must contain)
RUN_HERE = {
    "tensorboard --logdir runs/gpt": (["--version_tb"], ""),
    "tensorboard --logdir runs/resnet/tensorboard": (["--version_tb"], ""),
    "python benchmarks/gpt_run.py --precision fp16 --native": (
        ["--trainer.max_steps", "2", "--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2",
         "--data.block_size", "16", "--data.batch_size", "2", "--data.max_bytes", "65536",
         "--data.max_val_batches", "1", "--trainer.enable_progress_bar", "false"],
        "[native-16-mixed] 2 steps",
    ),
    "python benchmarks/gpt_run.py --trainer.plugins lightning_mp.MixedPrecisionPlugin "
    "--trainer.plugins.init_args.master_weights compensated --trainer.plugins.init_args.optimizer_state_dtype "
    "torch.bfloat16 --trainer.plugins.init_args.parity_guard 0.05": (
        ["--trainer.max_steps", "2", "--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2",
         "--data.block_size", "16", "--data.batch_size", "2", "--data.max_bytes", "65536",
         "--data.max_val_batches", "1", "--trainer.enable_progress_bar", "false"],
        "[bf16] 2 steps",
    ),
    "python benchmarks/benchmark.py": (["--rounds", "1", "--steps", "2", "--warmup", "1", "--only", "bf16-mixed",
                                        *TINY_GPT], "RATIO ours / native, bf16"),
    'python benchmarks/benchmark.py --only "no overflow locator" ActivationRangeMonitor --rounds 3 --steps 10 '
    "--clock cpu --threads 1": (["--rounds", "1", "--steps", "2", "--warmup", "1", *TINY_GPT],
                                "RATIO overflow locator on (default) / off, fp16"),
    'python benchmarks/benchmark.py --model resnet --only bf16-mixed "bf16, no overflow"': (
        ["--rounds", "1", "--steps", "2", "--warmup", "1", "--batch-size", "16"], "RATIO ours / native, bf16"),
    "python examples/train_resnet.py --runs fp32 bf16 bf16-lean --seeds 3": (
        ["--max-steps", "2", "--batch-size", "16", "--seeds", "1", "--output", "out"], "bf16-lean"),
    "python examples/train_resnet.py --repeats 3": (
        ["--runs", "fp32", "--max-steps", "2", "--batch-size", "16", "--repeats", "2", "--output", "out"],
        "wall time the median of 2 alternating runs"),
    "python benchmarks/memory_benchmark.py": (["--n-layer", "1", "--n-embd", "32", "--block-size", "16",
                                               "--batch-size", "2", "--steps", "2"], "lightning_mp bf16"),
    "python benchmarks/fabric_benchmark.py": (["--rounds", "1", "--steps", "1", "--warmup", "1", "--batch-size", "2",
                                               "--block-size", "16", "--n-layer", "1", "--n-embd", "32"], "|"),
    "python benchmarks/fabric_benchmark.py --models mlp --rounds 10 --steps 20": (
        ["--rounds", "1", "--steps", "1", "--warmup", "1", "--settings", "one"], "tiny MLP"),
    "python benchmarks/fabric_benchmark.py --settings one --models mlp --ablation --rounds 20 --steps 20": (
        ["--rounds", "1", "--steps", "1", "--warmup", "1"], "fp32_ops=[] / Fabric bf16"),
    "python benchmarks/after_fabric_benchmark.py --rounds 7": (["--rounds", "1", "--reps", "5"], "vs fresh"),
    "python benchmarks/lora_memory_benchmark.py": (["--hidden", "64", "--layers", "1", "--vocab", "512", "--seq", "16",
                                                    "--steps", "1", "--threads", "1"], "peak above base"),
    "python benchmarks/fsdp_benchmark.py --rounds 6 --steps 10": (["--rounds", "1", "--steps", "2", "--warmup", "1"],
                                                                   "vs FSDP2 bf16 policy"),
    "python benchmarks/fp8_quality.py --max-steps 150 --seeds 3": (
        ["--max-steps", "2", "--seeds", "2", "--recipes", "rowwise", *TINY_GPT, "--max-bytes", "65536",
         "--max-val-batches", "1"], "| fp8 rowwise |"),
    "python benchmarks/gemm_families.py": (["--rounds", "1", "--conv", "2", "4", "8", "--mm", "32", "32", "32"],
                                           "| conv weight grad |"),
    "python benchmarks/fp8_eval.py": (["--max-steps", "2", "--recipes", "rowwise", "--n-layer", "1", "--n-embd", "32",
                                       "--max-bytes", "65536", "--max-val-batches", "1"], "| rowwise |"),
}  # fmt: skip


PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "pypi.md")]


def readme_commands() -> list[str]:
    text = "\n".join(page.read_text() for page in PAGES)
    found = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        found += [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    found += re.findall(r"`((?:\.venv/bin/)?python3? (?:examples|benchmarks|docs|scripts)/[^`]+)`", text)
    return sorted({cmd.replace(".venv/bin/", "") for cmd in found})


def test_every_readme_command_is_driven():
    commands = readme_commands()
    assert len(commands) >= 10  # the parser still finds the README's commands
    undriven = [c for c in commands if c not in DRIVEN_ELSEWHERE and c not in RUN_HERE]
    assert not undriven, f"README/docs commands no test runs (map them in {Path(__file__).name}): {undriven}"
    stale = sorted((set(DRIVEN_ELSEWHERE) | set(RUN_HERE)) - set(commands))
    assert not stale, f"mapped commands no longer in the README or docs/*.md: {stale}"
    for target in set(DRIVEN_ELSEWHERE.values()):  # the named tests exist
        path, name = target.split("::")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert callable(getattr(module, name, None)), target


def test_the_ci_script_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert ".venv/bin/python -m pytest -q" in readme and "-m pytest -q" in ci


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(RUN_HERE))
def test_readme_command_runs_at_a_tiny_size(command, tmp_path):
    extra, expected = RUN_HERE[command]
    argv = shlex.split(command)
    if argv[0] == "tensorboard":
        argv = [str(Path(sys.executable).with_name("tensorboard"))] + argv[1:]
    else:
        argv = [sys.executable, str(ROOT / argv[1])] + argv[2:]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(argv + extra, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert expected in output, output[-3000:]
