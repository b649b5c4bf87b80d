"""Train the same GPT under each precision and print one table: lightning_mp's fp32/fp16/bf16 and, as reference
rows, Lightning's own 16-mixed and bf16-mixed.

    python benchmarks/compare_precisions.py --max-steps 30 --output runs/compare
    python benchmarks/compare_precisions.py --max-steps 800 --output runs/long --runs fp32 fp16 bf16
    python benchmarks/compare_precisions.py --max-steps 200 --output runs/big -- --model.n_layer 6 --data.batch_size 64

By default Lightning's own rows whose format has no native 16-bit GEMMs on this machine are left out (with a
line saying why): Lightning's plugin has no GEMM emulation, so such a row runs 5-100x slower than all the others
(fp16 on most CPUs, bf16 on CPUs without AVX512-BF16/AMX). Name it in ``--runs`` to include it anyway.

Every run is ``python benchmarks/gpt_run.py`` in its own subprocess (same seed, same batches, a fresh memory peak),
one after the other so they do not compete for the machine. Arguments after ``--`` go to every run unchanged.
Under ``--output``:

* ``tensorboard/<precision>``: each run's TensorBoard version (``tensorboard --logdir OUTPUT/tensorboard``);
* ``summaries/<precision>.json``: gpt_run.py's ``--summary`` of each run; ``logs/<precision>.log``: its output;
* ``results.md`` and ``results.csv``: the table, one row per run, starting with the precision name.

Columns: the mean training loss over the last 10 steps; validation loss, perplexity and next-byte accuracy after
the last step; wall time of the whole ``fit`` (validation included); training throughput in tokens/s (validation
excluded) and its ratio to the fp32 row; peak memory (``torch.cuda.max_memory_allocated`` on a GPU, the process's
peak RSS on a CPU); optimizer steps skipped on inf/NaN gradients; the final loss scale. ``-`` where a run has no such
thing: Lightning's bf16-mixed has no scaler and no inf/NaN guard, so nothing is skipped or counted there.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_GPT = REPO_ROOT / "benchmarks" / "gpt_run.py"

# run name -> gpt_run.py arguments. The names are the TensorBoard versions gpt_run.py picks for these runs.
RUNS: dict[str, list[str]] = {
    "fp32": ["--precision", "fp32"],
    "fp16": ["--precision", "fp16"],
    "bf16": ["--precision", "bf16"],
    "native-16-mixed": ["--precision", "fp16", "--native"],
    "native-bf16-mixed": ["--precision", "bf16", "--native"],
}
BASELINE = "fp32"

# (header, summary key or derived name, format); the CSV keeps full precision under the key names
COLUMNS: list[tuple[str, str, str]] = [
    ("precision", "precision", "s"),
    ("train loss", "train_loss", ".4f"),
    ("val loss", "val_loss", ".4f"),
    ("val ppl", "val_ppl", ".3f"),
    ("val acc", "val_acc", ".4f"),
    ("wall (s)", "wall_time_s", ".1f"),
    ("tokens/s", "tokens_per_s", ".0f"),
    (f"vs {BASELINE}", "speedup_vs_fp32", ".2f"),
    ("peak mem (MiB)", "peak_memory_mib", ".0f"),
    ("skipped", "skipped_steps", "d"),
    ("loss scale", "loss_scale", "g"),
]


def parse_args(argv: Optional[list[str]]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=30, help="training steps per run (default 30)")
    parser.add_argument("--output", type=Path, default=Path("runs/compare"), help="directory for logs and tables")
    parser.add_argument(
        "--runs",
        nargs="+",
        default=None,
        metavar="NAME",
        help=f"which runs, in order; a name may repeat (default: {' '.join(RUNS)}, less Lightning's own rows in a "
        "format this machine has no native 16-bit GEMMs for)",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds after which one run is stopped")
    parser.add_argument("--show-output", action="store_true", help="stream each run's output (progress bar) here")
    args = parser.parse_args(argv)
    args.left_out = []
    if args.runs is None:
        args.runs, args.left_out = default_runs()
    if args.max_steps < 1:
        parser.error(f"--max-steps={args.max_steps!r} must be >= 1")
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown:
        parser.error(f"--runs: {', '.join(map(repr, unknown))} not known. Allowed: {', '.join(RUNS)}")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout={args.timeout!r} must be > 0")
    return args, extra


def default_runs() -> tuple[list[str], list[str]]:
    """Every run, less Lightning's own rows whose format is slow here; and a line for each row left out."""
    import torch

    from lightning_mp.gemm_emulation import gemm_support

    device = "cuda" if torch.cuda.is_available() else "cpu"
    runs, left_out = [], []
    for name, argv in RUNS.items():
        fmt = argv[argv.index("--precision") + 1]
        if "--native" in argv and fmt in ("fp16", "bf16"):
            support = gemm_support(device, {"fp16": torch.float16, "bf16": torch.bfloat16}[fmt])
            if not support.native:
                left_out.append(
                    f"{name} left out: {support.reason}, and Lightning's own plugin has no GEMM emulation "
                    f"(lightning_mp's {fmt} row emulates them). HINT: --runs {' '.join(RUNS)} includes it."
                )
                continue
        runs.append(name)
    return runs, left_out


def cpu_label() -> str:
    from lightning_mp.gemm_emulation import cpu_capability

    return f"CPU capability {cpu_capability()}"


def child_env() -> dict[str, str]:
    """gpt_run.py imports lightning_mp: let it find this checkout's copy even when the package is not installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_one(
    name: str, tag: str, args: argparse.Namespace, extra: list[str]
) -> tuple[Optional[dict[str, Any]], str]:
    """Run gpt_run.py once; return (its summary or None, a status word). ``tag`` names its files."""
    out = args.output
    summary_path = out / "summaries" / f"{tag}.json"
    log_path = out / "logs" / f"{tag}.log"
    summary_path.unlink(missing_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(TRAIN_GPT),
        *RUNS[name],
        "--trainer.max_steps", str(args.max_steps),
        "--trainer.enable_checkpointing", "false",
        "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", "true" if args.show_output else "false",
        "--log_dir", str(out / "tensorboard"),
        "--summary", str(summary_path),
        *extra,
    ]  # fmt: skip
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n\n")
        log.flush()
        sink = None if args.show_output else log
        try:
            rc = subprocess.run(
                cmd, stdout=sink, stderr=subprocess.STDOUT if sink else None, env=child_env(), timeout=args.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return None, "timeout"
    if rc != 0 or not summary_path.is_file():
        return None, f"failed (exit {rc})"
    return json.loads(summary_path.read_text()), "ok"


def table_rows(results: list[tuple[str, Optional[dict[str, Any]], str]]) -> list[dict[str, Any]]:
    base = next((s for name, s, _ in results if name == BASELINE and s), None)
    rows = []
    for name, summary, status in results:
        row: dict[str, Any] = {key: None for _, key, _ in COLUMNS}
        row["precision"] = name
        if summary is not None:
            row.update({k: summary.get(k) for k in row if k in summary and k != "precision"})
            peak = summary["peak_memory_bytes"]
            row["peak_memory_mib"] = peak / 2**20 if peak is not None else None
            if base and base.get("tokens_per_s") and summary.get("tokens_per_s"):
                row["speedup_vs_fp32"] = summary["tokens_per_s"] / base["tokens_per_s"]
            row["peak_memory_kind"] = summary.get("peak_memory_kind")
            row["device"] = summary.get("device")
        row["status"] = status
        rows.append(row)
    return rows


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
        "|" + "|".join("---" if k == "precision" else "---:" for _, k, _ in COLUMNS) + "|",
    ]
    for row in rows:
        cells = [_cell(row[k], fmt) for _, k, fmt in COLUMNS]
        if row["status"] != "ok":
            cells[1] = row["status"].upper()
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    keys = [k for _, k, _ in COLUMNS] + ["peak_memory_kind", "device", "status"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in keys})


def main(argv: Optional[list[str]] = None) -> int:
    args, extra = parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    print(
        f"comparing {len(args.runs)} runs of benchmarks/gpt_run.py, {args.max_steps} steps each"
        + (f", extra arguments: {' '.join(extra)}" if extra else "")
        + f"; output in {args.output}; {cpu_label()}",
        flush=True,
    )
    for line in args.left_out:
        print(line, flush=True)
    results: list[tuple[str, Optional[dict[str, Any]], str]] = []
    start = time.perf_counter()
    for i, name in enumerate(args.runs, 1):
        repeat = args.runs[: i - 1].count(name)  # a run listed twice (to see the noise) keeps both sets of files
        tag = f"{name}_{repeat}" if repeat else name
        print(f"[{i}/{len(args.runs)}] {name}: running ...", flush=True)
        t0 = time.perf_counter()
        summary, status = run_one(name, tag, args, extra)
        took = time.perf_counter() - t0
        if summary is not None:
            val = summary.get("val_loss")
            print(f"[{i}/{len(args.runs)}] {name}: done in {took:.0f} s, val_loss {_cell(val, '.4f')}", flush=True)
        else:
            log = args.output / "logs" / f"{tag}.log"
            print(f"[{i}/{len(args.runs)}] {name}: {status} after {took:.0f} s; see {log}")
            if log.is_file():
                print("    " + "\n    ".join(log.read_text().splitlines()[-15:]), flush=True)
        results.append((name, summary, status))

    rows = table_rows(results)
    table = markdown(rows)
    device = next((r["device"] for r in rows if r.get("device")), "unknown")
    kind = next((r["peak_memory_kind"] for r in rows if r.get("peak_memory_kind")), None)
    note = (
        f"{args.max_steps} steps per run on {device} ({cpu_label()}); peak memory is "
        + ("torch.cuda.max_memory_allocated" if kind == "cuda_max_memory_allocated" else "the process's peak RSS")
        + f"; total {time.perf_counter() - start:.0f} s."
    )
    (args.output / "results.md").write_text(table + "\n" + note + "\n")
    write_csv(args.output / "results.csv", rows)
    print()
    print(table)
    print(note)
    print(f"wrote {args.output / 'results.md'} and {args.output / 'results.csv'}")
    return 0 if all(status == "ok" for _, _, status in results) else 1


if __name__ == "__main__":
    sys.exit(main())
