"""The seed's experiment: a ResNet with BatchNorm trained on real images in FP32 and in mixed precision, one table.

    python examples/train_resnet.py                                   # every row, 3 seeds: ~3 min on 2 quiet cores
    python examples/train_resnet.py --runs fp32 bf16 --max-steps 30   # a quick look
    python examples/train_resnet.py --seeds 5                         # seeds 0-4; --seeds 0 7 9: exactly those
    python examples/train_resnet.py --repeats 3                       # wall time: median of 3, order alternating

The images are scikit-learn's handwritten digits (1,797 real 8x8 scans, shipped inside its wheel, no download),
upsampled to 16x16; the model is a ResNet-14 (width 16, BatchNorm after every convolution); see
``lightning_mp.demos``. Each run is its own subprocess (its own memory peak), one after the other: fp32, fp16 and
bf16 through ``MixedPrecisionPlugin`` (with ``LossScaleMonitor`` and ``GradientRangeMonitor``), bf16-lean (the
same bf16 with ``master_weights="compensated"`` and bf16 optimizer state: 10 B/param of model state), then Lightning's
own ``16-mixed`` (an explicit ``MixedPrecision("16-mixed", "cpu")``: real FP16 with a GradScaler;
``precision="16-mixed"`` switches to bf16 on a CPU, with a warning) and ``bf16-mixed``. Lightning's two rows run by
default only where the CPU has that format's arithmetic (:func:`lightning_mp.gemm.support.gemm_support`): it has no
GEMM emulation, so elsewhere a row takes 15-50x the FP32 time. One line says which rows were skipped and why; a
row named in ``--runs`` always runs.

Every row trains on each of ``--seeds`` (default 3: seeds 0, 1, 2; a seed sets the initialisation, the batch order
and the augmentation), every other seed in reverse row order. Accuracy and loss are given as the mean and the
min-max range over seeds, and a row's difference from fp32 is called *beyond the seed spread* only when the two
ranges do not overlap; otherwise it is *within seed spread* and not claimed (``lightning_mp.demos.seeds``). With
more than one seed, a per-run table follows.

Columns: validation accuracy and loss after the last step (mean, min-max over seeds); wall time of ``fit`` (the
median over seeds and repeats: every run does the same work); peak tensor memory, what the seed measured
on its GPU (``torch.cuda.max_memory_allocated``: the most bytes held in tensors at once, activations, gradients,
parameters, optimizer state and every temporary included), counted on the CPU from every allocation and free of
torch's CPU allocator (``torch.profiler`` with ``profile_memory``) during a separate 3-step ``fit`` of a fresh model
with the same batches, plus the parameters and buffers allocated before it; and the process's peak RSS during the
timed ``fit`` (Linux's high-water mark, reset before ``fit`` through ``/proc/self/clear_refs``; elsewhere
``ru_maxrss``, never reset), which adds the allocator's cached pages and everything Python, torch and Lightning
hold. The default batch (512) makes activations most of it. Skipped steps (summed over seeds) and the final loss
scales for the runs that have a scaler. Output under ``--output``: ``results.md``, ``results.csv`` (one row per
precision), ``runs.csv`` (one row per run), ``tensorboard/<precision>`` for the first seed and
``tensorboard/<precision>_seed<S>`` for the others (``tensorboard --logdir runs/resnet/tensorboard``), ``logs/``.
"""

from __future__ import annotations

import argparse
import csv
import json
import itertools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

try:
    import resource  # POSIX only: the process's peak RSS
except ImportError:  # e.g. Windows: the peak RSS columns stay empty
    resource = None

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_mp import GradientRangeMonitor, LossScaleMonitor, MixedPrecisionPlugin
from lightning_mp.demos import DigitsDataModule, ResNet
from lightning_mp.demos.seeds import SeedSpread, compare, seed_list
from lightning_mp.gemm.support import gemm_support

RUNS = ("fp32", "fp16", "bf16", "bf16-lean", "native-16-mixed", "native-bf16-mixed")
NATIVE_DTYPES = {"native-16-mixed": torch.float16, "native-bf16-mixed": torch.bfloat16}  # Lightning's own rows
# bf16-lean: bf16 parameters with exact int16 remainders and bf16 Adam moments (docs/behaviour.md, "Lean bf16")
LEAN = {"master_weights": "compensated", "optimizer_state_dtype": torch.bfloat16}
BASELINE = "fp32"
DEFAULT_SEEDS = 3
SEED_METRICS = [("val_acc", "val acc", ".4f"), ("val_loss", "val loss", ".4f")]  # (key, header, format)
COLUMNS = [  # per precision: (header, key, format)
    ("precision", "precision", "s"),
    ("seeds ok", "seeds_ok", "s"),
    ("val acc mean", "val_acc", ".4f"),
    ("val acc min-max", "val_acc_range", "s"),
    ("val loss mean", "val_loss", ".4f"),
    ("val loss min-max", "val_loss_range", "s"),
    ("wall (s)", "wall_time_s", ".1f"),
    ("time vs fp32", "time_ratio", ".2f"),
    ("peak tensors (MiB)", "peak_tensor_mib", ".1f"),
    ("mem vs fp32", "mem_ratio", ".2f"),
    ("peak RSS (MiB)", "peak_rss_mib", ".0f"),
    ("skipped", "skipped_steps", "d"),
    ("loss scale", "loss_scale", "s"),
]
RUN_COLUMNS = [  # per run: (header, key, format)
    ("seed", "seed", "d"),
    ("precision", "precision", "s"),
    ("val acc", "val_acc", ".4f"),
    ("val loss", "val_loss", ".4f"),
    ("wall (s)", "wall_time_s", ".1f"),
    ("skipped", "skipped_steps", "d"),
    ("loss scale", "loss_scale", "g"),
]


def _status_kib(field: str) -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _maxrss() -> Optional[int]:
    if resource is None:
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB elsewhere
    return rss if sys.platform == "darwin" else rss * 1024


def reset_peak_rss() -> tuple[Optional[int], str]:
    """Start a fresh peak; return the RSS now (bytes) and how the peak will be read."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS
        return _status_kib("VmRSS") * 1024, "VmHWM after resetting it before fit"
    except (OSError, TypeError):
        return _maxrss(), ("ru_maxrss (not reset)" if resource is not None else "unavailable")


def peak_rss() -> Optional[int]:
    hwm = _status_kib("VmHWM")
    return hwm * 1024 if hwm is not None else _maxrss()


def slow_native_rows(runs: list[str]) -> dict[str, str]:
    """Lightning's own rows in ``runs`` whose 16-bit format has a slow op family on this CPU, each with the verdict of
    :func:`lightning_mp.gemm.support.gemm_support`. Lightning's plugin has no emulation, so such a row runs torch's
    slow 16-bit kernels: FP16 convolutions fall back to ``aten::_slow_conv2d`` (an AVX512 CPU with native bf16 and
    no FP16: a step ~50x as long as in FP32, 90% of it in that kernel's backward), bf16 on an AVX2 CPU took ~20x
    FP32 (one row past 10 minutes), and an Intel Xeon with AVX512-FP16 runs the fp16 convolution weight gradient in
    oneDNN's reference kernel (280x FP32). Ours computes those families as FP32 GEMMs there (``gemm="auto"``)."""
    slow = {}
    for name in runs:
        dtype = NATIVE_DTYPES.get(name)
        if dtype is not None:
            support = gemm_support("cpu", dtype)
            if not support.native:
                slow[name] = support.reason
    return slow


def rows_to_run(requested: Optional[list[str]]) -> tuple[list[str], dict[str, str]]:
    """The rows in order and those left out with why: every row by default, less :func:`slow_native_rows`; rows
    named in ``--runs`` always run."""
    if requested:
        return list(requested), {}
    skip = slow_native_rows(list(RUNS))
    return [name for name in RUNS if name not in skip], skip


def skip_line(skip: dict[str, str]) -> str:
    """One line: which rows are left out, why, and how to run them anyway."""
    why = "; ".join(f"{name}: {reason}" for name, reason in skip.items())
    return (f"skipping {', '.join(skip)} (Lightning's own plugin has no GEMM emulation: such a row takes 15-50x "
            f"the FP32 time) because {why}. HINT: name a row in --runs to run it anyway, e.g. --runs {' '.join(RUNS)}")


def make_plugin(name: str) -> Any:
    if name.startswith("native-"):
        return MixedPrecision(name[len("native-") :], "cpu")
    if name == "bf16-lean":
        return MixedPrecisionPlugin("bf16", **LEAN)
    return MixedPrecisionPlugin(name)


def _trainer(plugin: Any, max_steps: int, **kwargs: Any) -> L.Trainer:
    quiet = dict(num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
                 enable_model_summary=False)  # fmt: skip
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, plugins=[plugin], **quiet, **kwargs)


def peak_tensor_bytes(name: str, batch_size: int, steps: int = 3, seed: int = 0) -> int:
    """Most bytes held in tensors at once during a ``steps``-step ``fit`` of a fresh model (no callbacks, no
    validation), counted from the profiler's record of every allocation (+) and free (-) of torch's CPU allocator,
    in order; plus the parameters and buffers allocated before ``fit``. Step 1 creates the optimizer state, so
    3 steps reach the steady peak of a longer run."""
    L.seed_everything(seed, verbose=False)
    data = DigitsDataModule(batch_size=batch_size, seed=seed)
    model = ResNet()
    before = sum(t.untyped_storage().nbytes() for t in itertools.chain(model.parameters(), model.buffers()))
    trainer = _trainer(make_plugin(name), steps, logger=False, limit_val_batches=0)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        trainer.fit(model, data)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() ==
              torch.autograd.DeviceType.CPU]  # fmt: skip
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()  # negative for a free
        peak = max(peak, live)
    return before + peak


def train_one(
    name: str, max_steps: int, batch_size: int, log_dir: Path, seed: int = 0, version: Optional[str] = None
) -> dict[str, Any]:
    """One row: train, validate, measure. Runs in the calling process (the table gives each row its own)."""
    L.seed_everything(seed, verbose=False)
    data = DigitsDataModule(batch_size=batch_size, seed=seed)
    data.setup()
    model = ResNet()
    plugin = make_plugin(name)
    ours = isinstance(plugin, MixedPrecisionPlugin)
    trainer = _trainer(
        plugin,
        max_steps,
        callbacks=[LossScaleMonitor(), GradientRangeMonitor(every_n_steps=min(10, max_steps))] if ours else [],
        logger=TensorBoardLogger(save_dir=str(log_dir), name="", version=version or name),
        log_every_n_steps=min(5, max_steps),
        check_val_every_n_epoch=5,
    )
    rss_before, peak_kind = reset_peak_rss()
    start = time.perf_counter()
    trainer.fit(model, data)
    wall = time.perf_counter() - start
    peak = peak_rss()
    metrics = trainer.validate(model, data, verbose=False)[0]
    scaler = getattr(plugin, "scaler", None)  # Lightning's 16-mixed keeps a GradScaler; bf16-mixed has none
    return {
        "precision": name,
        "seed": seed,
        "val_acc": float(metrics["val_acc"]),
        "val_loss": float(metrics["val_loss"]),
        "wall_time_s": wall,
        "peak_rss_mib": peak / 2**20 if peak is not None else None,
        "train_rss_mib": (peak - rss_before) / 2**20 if peak is not None and rss_before is not None else None,
        "peak_tensor_mib": peak_tensor_bytes(name, batch_size, seed=seed) / 2**20,
        "skipped_steps": plugin.skipped_steps if ours else None,
        "loss_scale": plugin.loss_scale if ours else (scaler.get_scale() if scaler is not None else None),
        "steps": trainer.global_step,
        "batch_size": batch_size,
        "peak_kind": peak_kind,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }


def _tag(name: str, seed: int, first_seed: int) -> str:
    """File and TensorBoard name of a run: the precision for the first seed (as with one seed), else with the seed."""
    return name if seed == first_seed else f"{name}_seed{seed}"


def run_row(name: str, seed: int, tag: str, args: argparse.Namespace) -> tuple[Optional[dict[str, Any]], str]:
    """``train_one`` in a fresh subprocess: its own memory peak, nothing left over from an earlier run."""
    summary, log = args.output / "summaries" / f"{tag}.json", args.output / "logs" / f"{tag}.log"
    summary.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    summary.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--one", name, "--seed", str(seed), "--summary", str(summary), "--output",
           str(args.output), "--max-steps", str(args.max_steps), "--batch-size", str(args.batch_size)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1]),
                                                                     os.environ.get("PYTHONPATH")])))  # fmt: skip
    with open(log, "w") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            return None, "timeout"
    if rc != 0 or not summary.is_file():
        return None, f"failed (exit {rc}), see {log}"
    return json.loads(summary.read_text()), "ok"


def _markdown(columns: list[tuple[str, str, str]], rows: list[dict[str, Any]], status_col: int) -> str:
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |",
             "|" + "|".join("---" if k == "precision" else "---:" for _, k, _ in columns) + "|"]  # fmt: skip
    for r in rows:
        cells = ["-" if r.get(k) is None else format(r[k], f) for _, k, f in columns]
        if r.get("status", "ok") != "ok":
            cells[status_col] = r["status"].upper()
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def aggregate(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """One row per precision from its runs (several seeds, several repeats): accuracy and loss per seed (a repeat
    of a seed trains the same weights, so its first run stands for it), wall time the median of every run (they do
    the same work), memory the first run's (it does not depend on the seed)."""
    rows = []
    for name in names:
        mine = [r for r in runs if r["precision"] == name]
        ok = [r for r in mine if r["status"] == "ok"]
        seeds = sorted({r["seed"] for r in mine})
        row: dict[str, Any] = {"precision": name, "status": "ok" if ok else mine[0]["status"] if mine else "no runs"}
        row["seeds_ok"] = f"{len({r['seed'] for r in ok})}/{len(seeds)}"
        for key, _, fmt in SEED_METRICS:
            spread = SeedSpread({r["seed"]: r[key] for r in reversed(ok)})  # the first run of a seed wins
            row[f"{key}_spread"] = spread
            row.update({key: spread.mean, f"{key}_min": spread.min, f"{key}_max": spread.max})
            row[f"{key}_range"] = spread.range_text(fmt)
        if ok:
            first = ok[0]
            row["wall_time_s"] = statistics.median(r["wall_time_s"] for r in ok)
            for key in ("peak_tensor_mib", "peak_rss_mib", "train_rss_mib", "steps", "batch_size", "cpu_capability",
                        "peak_kind"):  # fmt: skip
                row[key] = first.get(key)
            skipped = [r["skipped_steps"] for r in ok if r.get("skipped_steps") is not None]
            row["skipped_steps"] = sum(skipped) if skipped else None
            scales = sorted({r["loss_scale"] for r in ok if r.get("loss_scale") is not None})
            row["loss_scale"] = " / ".join(format(v, "g") for v in scales) if scales else None
        rows.append(row)
    base = next((r for r in rows if r["precision"] == BASELINE and r["status"] == "ok"), None)
    for r in rows:
        if base and r["status"] == "ok":
            r["time_ratio"] = r["wall_time_s"] / base["wall_time_s"]
            r["mem_ratio"] = r["peak_tensor_mib"] / base["peak_tensor_mib"]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    return _markdown(COLUMNS, rows, status_col=2)


def difference_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each row against fp32 (or the first row), accuracy then loss; see :func:`lightning_mp.demos.seeds.compare`."""
    base = next((r for r in rows if r["precision"] == BASELINE), rows[0])
    return [
        compare(header, r["precision"], r[f"{key}_spread"], base["precision"], base[f"{key}_spread"]).line(fmt)
        for r in rows
        if r is not base and r["status"] == "ok"
        for key, header, fmt in SEED_METRICS
    ]


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", choices=RUNS, metavar="NAME",
                        help=f"rows, in order (default: {', '.join(RUNS)}; Lightning's native-* rows only where the CPU "
                             "has that format's arithmetic)")  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=60, help="training steps per row (default 60, 20 epochs)")
    parser.add_argument("--batch-size", type=int, default=512, help="images per step (default 512)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[DEFAULT_SEEDS], metavar="S",
                        help=f"one number N: seeds 0..N-1 (default {DEFAULT_SEEDS}); several: exactly those")  # fmt: skip
    parser.add_argument("--output", type=Path, default=Path("runs/resnet"), help="directory for tables and logs")
    parser.add_argument("--timeout", type=float, default=None, help="seconds after which one row is stopped")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every row this many times per seed, order alternating; wall time: the median")  # fmt: skip
    parser.add_argument("--one", choices=RUNS, help=argparse.SUPPRESS)  # a row's subprocess
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--summary", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for flag, value in (("--max-steps", args.max_steps), ("--batch-size", args.batch_size), ("--repeats", args.repeats)):
        if value < 1:
            parser.error(f"{flag}={value!r} must be >= 1")
    try:
        args.seeds = seed_list(args.seeds)
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.one:
        log_dir = args.output / "tensorboard"
        result = train_one(args.one, args.max_steps, args.batch_size, log_dir, args.seed, args.summary.stem)
        args.summary.write_text(json.dumps(result, indent=1))
        return 0
    start = time.perf_counter()
    runs = args.runs or list(RUNS)
    names, skip = rows_to_run(args.runs)
    if skip:
        print(skip_line(skip), flush=True)
    # every other (repeat, seed) pass runs the rows in reverse, so no row always follows the same one
    passes = [(rep, seed) for rep in range(args.repeats) for seed in args.seeds]
    plan = [(rep, seed, name) for k, (rep, seed) in enumerate(passes) for name in (names[::-1] if k % 2 else names)]
    print(f"{len(names)} rows x {len(args.seeds)} seeds ({', '.join(map(str, args.seeds))})"
          + (f" x {args.repeats} repeats" if args.repeats > 1 else "") + f" = {len(plan)} runs", flush=True)  # fmt: skip
    results: list[dict[str, Any]] = []
    for i, (rep, seed, name) in enumerate(plan, 1):
        tag = _tag(name, seed, args.seeds[0])
        where = f"[{i}/{len(plan)}] seed {seed}" + (f", repeat {rep + 1}" if args.repeats > 1 else "") + f", {name}"
        print(f"{where} ...", flush=True)
        summary, status = run_row(name, seed, tag, args)
        elapsed = time.perf_counter() - start
        left = f"; {elapsed:.0f} s elapsed, ~{elapsed / i * (len(plan) - i):.0f} s left" if i < len(plan) else ""
        acc = f", val acc {summary['val_acc']:.4f}" if summary else ""
        print(f"{where}: {status}{acc}{left}", flush=True)
        results.append({**(summary or {}), "precision": name, "seed": seed, "status": status})
    rows = aggregate(results, names) + [
        {"precision": name, "status": "skipped: not native on this CPU"} for name in runs if name in skip
    ]
    rows.sort(key=lambda r: runs.index(r["precision"]))
    ok = [r for r in rows if r["status"] == "ok"]
    walls = f"{args.repeats} alternating runs" + (f" x {len(args.seeds)} seeds" if len(args.seeds) > 1 else "")
    if args.repeats == 1:
        walls = f"the runs of {len(args.seeds)} seeds, order alternating"
    note = (
        f"ResNet-14 on the digits (16x16), {args.max_steps} steps of {args.batch_size} images per run, seeds "
        f"{', '.join(map(str, args.seeds))} (accuracy and loss: mean and min-max over seeds)"
        f"{f', wall time the median of {walls}' if args.repeats * len(args.seeds) > 1 else ''}; CPU "
        f"capability {ok[0]['cpu_capability'] if ok else '?'}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}; peak tensors: most bytes in torch's CPU allocator at once over a 3-step fit (profiler), "
        f"parameters included; peak RSS: {ok[0]['peak_kind'] if ok else '?'}; total {time.perf_counter() - start:.0f} s."
    )
    report = table(rows) + "\n" + "\n".join(difference_lines([r for r in rows if "val_acc_spread" in r]))
    if len(args.seeds) > 1 or args.repeats > 1:
        report += "\n\n" + _markdown(RUN_COLUMNS, results, status_col=2)
    report += "\n" + note + "\n"
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "results.md").write_text(report)
    keys = [k for _, k, _ in COLUMNS if not k.endswith("_range")]
    keys += ["val_acc_min", "val_acc_max", "val_loss_min", "val_loss_max", "train_rss_mib", "steps", "batch_size",
             "cpu_capability", "peak_kind", "status"]  # fmt: skip
    _write_csv(args.output / "results.csv", keys, rows)
    _write_csv(args.output / "runs.csv", [k for _, k, _ in RUN_COLUMNS] + ["status"], results)
    print("\n" + report, end="")
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped") for r in rows) else 1


def _write_csv(path: Path, keys: list[str], rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: "" if r.get(k) is None else r[k] for k in keys} for r in rows)


if __name__ == "__main__":
    sys.exit(main())
