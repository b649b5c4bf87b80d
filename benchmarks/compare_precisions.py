"""Train the same GPT under each precision, over several seeds, and print what differs beyond the seed-to-seed
spread: lightning_mp's fp32/fp16/bf16 and, as reference rows, Lightning's own 16-mixed and bf16-mixed.

    python benchmarks/compare_precisions.py --max-steps 30 --output runs/compare
    python benchmarks/compare_precisions.py --max-steps 800 --output runs/long --runs fp32 fp16 bf16 --seeds 3
    python benchmarks/compare_precisions.py --max-steps 200 --seeds 0 7 --output runs/big -- --model.n_layer 6

``--seeds N`` runs seeds 0..N-1 (default 3); two or more numbers run exactly those seeds. A seed sets both the
model's initialisation (``--seed_everything``) and the order of the training batches (``--data.seed``). One seed
measures luck: an early loss spike of one run can decide a comparison (see ``lightning_mp.demos.gpt.RECIPE``).

By default Lightning's own rows whose format has no native 16-bit GEMMs on this machine are left out (with a
line saying why): Lightning's plugin has no GEMM emulation, so such a row runs 5-100x slower than all the others
(fp16 on most CPUs, bf16 on CPUs without AVX512-BF16/AMX). Name it in ``--runs`` to include it anyway.

Every run is ``python benchmarks/gpt_run.py`` in its own subprocess (a fresh memory peak), one after the other so
they do not compete for the machine; seeds are the outer loop and every other seed runs the precisions in reverse
order, so no precision always follows the same one. Arguments after ``--`` go to every run unchanged. Under
``--output``:

* ``tensorboard/seed<S>/<precision>``: each run's TensorBoard version (``tensorboard --logdir OUTPUT/tensorboard``);
* ``summaries/seed<S>/<precision>.json``: gpt_run.py's ``--summary`` of each run; ``logs/seed<S>/<precision>.log``;
* ``results.md``: the per-precision table, the differences, and the per-run table; ``results.csv``: one row per
  run (seed and precision first); ``summary.csv``: one row per precision (mean, min and max over seeds).

Per precision: the mean and the min-max range over seeds of the final validation loss and next-byte accuracy; the
mean over seeds of the training loss (the mean of each run's last 10 steps; its range is in ``summary.csv``); the
median training throughput (tokens/s, validation excluded) and its ratio to the baseline's; the largest peak
memory (``torch.cuda.max_memory_allocated`` on a GPU, the process's peak RSS on a CPU); optimizer steps skipped on
inf/NaN gradients, summed over seeds; the final loss scales. ``-`` where a run has no such thing: Lightning's
bf16-mixed has no scaler and no inf/NaN guard.

Differences (each precision against the baseline, fp32 when it ran, else the first run): ``X - fp32 = D``, the
difference of the means, called *beyond the seed spread* only when the two min-max ranges do not overlap (every
seed of one ended better than every seed of the other); otherwise *within seed spread*, and no difference is
claimed. With one seed there is no spread, and nothing is claimed. The per-seed differences follow in brackets
(both precisions start from the same weights and see the same batches on a seed). The tables are printed at the
end; while it runs, one line per run says where it is and about how long is left.

Runs of a few dozen steps end inside or just after the recipe's 40-step warmup: use them to check that everything
runs, and 800 steps to compare.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from lightning_mp.demos.seeds import SeedSpread, compare, seed_list

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
DEFAULT_SEEDS = 3

# Per-run table: (header, summary key or derived name, format); the CSV keeps full precision under the key names.
COLUMNS: list[tuple[str, str, str]] = [
    ("seed", "seed", "d"),
    ("precision", "precision", "s"),
    ("train loss", "train_loss", ".4f"),
    ("val loss", "val_loss", ".4f"),
    ("val ppl", "val_ppl", ".3f"),
    ("val acc", "val_acc", ".4f"),
    ("wall (s)", "wall_time_s", ".1f"),
    ("tokens/s", "tokens_per_s", ".0f"),
    ("peak mem (MiB)", "peak_memory_mib", ".0f"),
    ("skipped", "skipped_steps", "d"),
    ("loss scale", "loss_scale", "g"),
]
# Metrics summarised over seeds (mean, min, max): (key, header, format). Those in COMPARED are compared between
# precisions and shown with their range; the others show their mean (the range is in summary.csv).
SEED_METRICS: list[tuple[str, str, str]] = [
    ("val_loss", "val loss", ".4f"),
    ("val_acc", "val acc", ".4f"),
    ("train_loss", "train loss", ".4f"),
]
COMPARED = ("val_loss", "val_acc")


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
        help=f"which precisions, in order; a name may repeat, its runs are pooled (default: {' '.join(RUNS)}, less "
        "Lightning's own rows in a format this machine has no native 16-bit GEMMs for)",
    )
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=[DEFAULT_SEEDS],
        metavar="S",
        help=f"one number N: seeds 0..N-1 (default {DEFAULT_SEEDS}); two or more: exactly those seeds",
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
    try:
        args.seeds = seed_list(args.seeds)
    except ValueError as err:
        parser.error(str(err))
    for flag in ("--seed_everything", "--data.seed"):
        if any(a == flag or a.startswith(flag + "=") for a in extra):
            parser.error(f"{flag} after '--' would give every seed the same value. HINT: use --seeds instead.")
    return args, extra


def default_runs() -> tuple[list[str], list[str]]:
    """Every run, less Lightning's own rows whose format is slow here; and a line for each row left out."""
    import torch

    from lightning_mp.gemm.support import gemm_support

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
    from lightning_mp.gemm.support import cpu_capability

    return f"CPU capability {cpu_capability()}"


def child_env() -> dict[str, str]:
    """gpt_run.py imports lightning_mp: let it find this checkout's copy even when the package is not installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_one(
    name: str, tag: str, seed: int, args: argparse.Namespace, extra: list[str]
) -> tuple[Optional[dict[str, Any]], str]:
    """Run gpt_run.py once; return (its summary or None, a status word). ``tag`` names its files."""
    out = args.output
    summary_path = out / "summaries" / f"seed{seed}" / f"{tag}.json"
    log_path = out / "logs" / f"seed{seed}" / f"{tag}.log"
    summary_path.unlink(missing_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(TRAIN_GPT),
        *RUNS[name],
        "--seed_everything", str(seed),
        "--data.seed", str(seed),
        "--trainer.max_steps", str(args.max_steps),
        "--trainer.enable_checkpointing", "false",
        "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", "true" if args.show_output else "false",
        "--log_dir", str(out / "tensorboard" / f"seed{seed}"),
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


# ------------------------------------------------------------------------------------------------------ the tables
def run_rows(results: list[tuple[int, str, Optional[dict[str, Any]], str]]) -> list[dict[str, Any]]:
    """One row per run, keyed as :data:`COLUMNS` (plus status, device and the kind of peak memory)."""
    rows = []
    for seed, name, summary, status in results:
        row: dict[str, Any] = {key: None for _, key, _ in COLUMNS}
        row.update(seed=seed, precision=name, status=status)
        if summary is not None:
            row.update({k: summary.get(k) for k in row if k in summary and k not in ("precision", "seed", "status")})
            peak = summary.get("peak_memory_bytes")
            row["peak_memory_mib"] = peak / 2**20 if peak is not None else None
            row["peak_memory_kind"] = summary.get("peak_memory_kind")
            row["device"] = summary.get("device")
        rows.append(row)
    return rows


def _values(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rows if r["status"] == "ok" and r.get(key) is not None]


def seed_stats(rows: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, Any]]:
    """Per precision: runs ok/total, a :class:`SeedSpread` per :data:`SEED_METRICS` key, and the cost columns."""
    baseline = BASELINE if BASELINE in names else names[0]
    stats: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(names):
        mine = [r for r in rows if r["precision"] == name]
        ok = [r for r in mine if r["status"] == "ok"]
        entry: dict[str, Any] = {"precision": name, "runs": len(mine), "ok": len(ok)}
        for key, *_ in SEED_METRICS:
            # a precision listed twice runs each seed twice; the later run of a seed stands for it
            spread = SeedSpread({r["seed"]: r[key] for r in ok if r.get(key) is not None})
            entry[key] = spread
            entry.update({f"{key}_mean": spread.mean, f"{key}_min": spread.min, f"{key}_max": spread.max})
        tps = _values(mine, "tokens_per_s")
        entry["tokens_per_s"] = statistics.median(tps) if tps else None
        peaks = _values(mine, "peak_memory_mib")
        entry["peak_memory_mib"] = max(peaks) if peaks else None
        skipped = _values(mine, "skipped_steps")
        entry["skipped_steps"] = sum(skipped) if skipped else None
        entry["loss_scales"] = sorted(set(_values(mine, "loss_scale")))
        stats[name] = entry
    base_tps = stats[baseline]["tokens_per_s"]
    for entry in stats.values():
        entry["speedup"] = entry["tokens_per_s"] / base_tps if entry["tokens_per_s"] and base_tps else None
    return stats


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def summary_markdown(stats: dict[str, dict[str, Any]], baseline: str) -> str:
    headers = ["precision", "seeds ok"]
    for key, header, _ in SEED_METRICS:
        headers += [f"{header} mean", f"{header} min-max"] if key in COMPARED else [f"{header} mean"]
    headers += ["tokens/s (median)", f"vs {baseline}", "peak mem (MiB, max)", "skipped (sum)", "final loss scale"]
    lines = ["| " + " | ".join(headers) + " |", "|---|" + "---:|" * (len(headers) - 1)]
    for e in stats.values():
        cells = [e["precision"], f"{e['ok']}/{e['runs']}"]
        for key, _, fmt in SEED_METRICS:
            cells += [_cell(e[key].mean, fmt)] + ([e[key].range_text(fmt)] if key in COMPARED else [])
        scales = e["loss_scales"]
        cells += [
            _cell(e["tokens_per_s"], ".0f"),
            _cell(e["speedup"], ".2f"),
            _cell(e["peak_memory_mib"], ".0f"),
            _cell(e["skipped_steps"], "d"),
            "-" if not scales else " / ".join(format(v, "g") for v in scales),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def difference_lines(stats: dict[str, dict[str, Any]], baseline: str) -> list[str]:
    """Each precision against ``baseline`` on :data:`COMPARED`, one line each (see :func:`compare`)."""
    lines = []
    for name, e in stats.items():
        for key, header, fmt in SEED_METRICS:
            if name != baseline and key in COMPARED:
                lines.append(compare(header, name, e[key], baseline, stats[baseline][key]).line(fmt))
    return lines


def run_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
        "|" + "|".join("---" if k == "precision" else "---:" for _, k, _ in COLUMNS) + "|",
    ]
    value_col = [k for _, k, _ in COLUMNS].index("train_loss")
    for row in rows:
        cells = [_cell(row[k], fmt) for _, k, fmt in COLUMNS]
        if row["status"] != "ok":
            cells[value_col] = row["status"].upper()
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(path: Path, keys: list[str], rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in keys})


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def main(argv: Optional[list[str]] = None) -> int:
    args, extra = parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    plan = [(seed, name) for i, seed in enumerate(args.seeds) for name in (args.runs[::-1] if i % 2 else args.runs)]
    print(
        f"comparing {len(dict.fromkeys(args.runs))} precisions x {len(args.seeds)} seeds "
        f"({', '.join(map(str, args.seeds))}) = {len(plan)} runs of benchmarks/gpt_run.py, {args.max_steps} steps each"
        + (f", extra arguments: {' '.join(extra)}" if extra else "")
        + f"; output in {args.output}; {cpu_label()}",
        flush=True,
    )
    for line in args.left_out:
        print(line, flush=True)
    results: list[tuple[int, str, Optional[dict[str, Any]], str]] = []
    start = time.perf_counter()
    for i, (seed, name) in enumerate(plan, 1):
        # a precision listed twice keeps both sets of files
        repeat = sum(1 for s, n, *_ in results if (s, n) == (seed, name))
        tag = f"{name}_{repeat}" if repeat else name
        where = f"[{i}/{len(plan)}] seed {seed}, {name}"
        print(f"{where}: running ...", flush=True)
        t0 = time.perf_counter()
        summary, status = run_one(name, tag, seed, args, extra)
        took = time.perf_counter() - t0
        elapsed = time.perf_counter() - start
        left = ""
        if i < len(plan):  # runs of one precision take about as long as each other; a rough estimate
            left = f"; {_duration(elapsed)} elapsed, ~{_duration(elapsed / i * (len(plan) - i))} left"
        if summary is not None:
            val = summary.get("val_loss")
            print(f"{where}: done in {took:.0f} s, val_loss {_cell(val, '.4f')}{left}", flush=True)
        else:
            log = args.output / "logs" / f"seed{seed}" / f"{tag}.log"
            print(f"{where}: {status} after {took:.0f} s; see {log}{left}")
            if log.is_file():
                print("    " + "\n    ".join(log.read_text().splitlines()[-15:]), flush=True)
        results.append((seed, name, summary, status))

    rows = run_rows(results)
    names = list(dict.fromkeys(args.runs))
    baseline = BASELINE if BASELINE in names else names[0]
    stats = seed_stats(rows, names)
    device = next((r["device"] for r in rows if r.get("device")), "unknown")
    kind = next((r["peak_memory_kind"] for r in rows if r.get("peak_memory_kind")), None)
    note = (
        f"{args.max_steps} steps per run, seeds {', '.join(map(str, args.seeds))}, on {device} ({cpu_label()}); "
        "mean and min-max over seeds; peak memory is "
        + ("torch.cuda.max_memory_allocated" if kind == "cuda_max_memory_allocated" else "the process's peak RSS")
        + f"; total {_duration(time.perf_counter() - start)}."
    )
    report = (
        f"## Per precision, over {len(args.seeds)} seed{'s' if len(args.seeds) > 1 else ''}\n\n"
        + summary_markdown(stats, baseline)
        + f"\n## Differences against {baseline}\n\n"
        + "\n".join(difference_lines(stats, baseline))
        + "\n\n## Per run\n\n"
        + run_markdown(rows)
        + "\n"
        + note
        + "\n"
    )
    (args.output / "results.md").write_text(report)
    write_csv(args.output / "results.csv", [k for _, k, _ in COLUMNS] + ["peak_memory_kind", "device", "status"], rows)
    summary_keys = ["precision", "runs", "ok"]
    for key, *_ in SEED_METRICS:
        summary_keys += [f"{key}_mean", f"{key}_min", f"{key}_max"]
    summary_keys += ["tokens_per_s", "speedup", "peak_memory_mib", "skipped_steps"]
    write_csv(args.output / "summary.csv", summary_keys, list(stats.values()))
    print()
    print(report, end="")
    print(f"wrote {args.output / 'results.md'}, {args.output / 'results.csv'} and {args.output / 'summary.csv'}")
    return 0 if all(status == "ok" for *_, status in results) else 1


if __name__ == "__main__":
    sys.exit(main())
