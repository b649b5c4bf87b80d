"""The GPU check's table: each precision's throughput, peak memory, host syncs, late-flag waits, skipped steps and
loss, one row per process, each row kept in the table's files the moment it ends.

    python3 benchmarks/gpu_table.py --deadline $(( $(date +%s) + 230 ))   # on a CUDA machine (scripts/gpu_check.sh)
    python3 benchmarks/gpu_table.py --dry-run --timeout-probe             # every row at tiny sizes, on the CPU

Two models (benchmarks/gpu_models.py), every batch on the device before the fit, fused AdamW:

* **GPT-2 small** (12 x 768, sequence 1024, eager): correctness and overhead. Lightning's ``32-true``,
  ``bf16-mixed`` and ``16-mixed``; ours bf16, fp16 and lean bf16 (``master_weights="compensated"``); Lightning's
  ``TransformerEnginePrecision`` where Transformer Engine is installed. At 768 wide FP8 does not pay: no FP8 row.
* **Llama 4096 wide** (4 layers, 11008 hidden, sequence 2048), each block compiled by inductor: FP8 speed.
  Lightning's ``bf16-mixed``; ours bf16, fp8 rowwise and fp8 tensorwise; and the FP8 a Lightning user has today:
  ``bf16-mixed`` + torchao's ``convert_to_float8_training`` + ``torch.compile``. Without torchao its rows say
  "skipped: no torchao".

Ratios are against the same model's ``bf16-mixed`` row. benchmarks/gpu_fit.py says what each column measures.

Nothing measured is lost. Each row runs in its own process (benchmarks/gpu_row.py) under its own time limit (a kill
of its process group: compile workers too); its result is appended to ``table_rows.jsonl`` and ``table.md`` is
rewritten as soon as it ends, so a row that raises, hangs or is killed leaves the rows before it, and the rows after
it still run. No row starts past ``--deadline`` (they say "not run"). The rows run in order of what a short run
most needs to show (the references and FP8 first); the table lists them by model. Exits 1 if a row failed or timed
out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REF = "Lightning bf16-mixed"
GPT, LLAMA = "GPT-2 small", "Llama 4096 wide"
_PIECES = {"torchao": "torchao", "transformer_engine": "Transformer Engine"}


def _cpu_compiles_fp8() -> bool:
    """A dry run on a CPU without bf16 arithmetic (AVX2): torchao's compiled FP8 Linear itself gives NaN or oneDNN's
    refusal there, with or without the plugin, so those rows are skipped, not failed."""
    import torch

    return torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def rows(dry: bool, timeout_probe: bool = False) -> list[dict]:
    """Every row, in the order they run; ``order`` is their place in the table."""
    gpt = [REF, "Lightning 32-true", "Lightning 16-mixed", "ours bf16", "ours fp16", "ours lean bf16",
           "Lightning TransformerEnginePrecision"]  # fmt: skip
    llama = [REF, "ours bf16", "ours fp8 rowwise", "ours fp8 tensorwise", "torchao fp8 tensorwise"]
    needs = {"Lightning TransformerEnginePrecision": "transformer_engine", "ours fp8 rowwise": "torchao",
             "ours fp8 tensorwise": "torchao", "torchao fp8 tensorwise": "torchao"}  # fmt: skip
    # GPT-2 small: 25 eager steps of ~0.1 s each (H100); Llama: 1 B parameters, compiled at its first step
    table = [dict(model="gpt", table=GPT, variant=v, compile=False, warmup=1 if dry else 5, steps=2 if dry else 20,
                  limit=300 if dry else 60) for v in gpt]  # fmt: skip
    table += [dict(model="llama", table=LLAMA, variant=v, compile=True, warmup=2 if dry else 3,
                   steps=2 if dry else 10, limit=400 if dry else 100) for v in llama]  # fmt: skip
    for order, row in enumerate(table):
        row.update(order=order, dry=dry, needs=needs.get(row["variant"]),
                   name=row["variant"] + (" compiled" if row["compile"] else ""))  # fmt: skip
    if timeout_probe:  # the dry run's check that a row killed at its limit keeps the rows before it
        table.insert(len(gpt), dict(model="probe", table=GPT, variant="hang", name="timeout probe (dry run)",
                                    compile=False, limit=5, order=len(gpt) - 0.5, needs=None, dry=dry))  # fmt: skip
    first = [(GPT, REF), (LLAMA, REF), (LLAMA, "ours fp8 rowwise"), (LLAMA, "torchao fp8 tensorwise"),
             (GPT, "ours bf16"), (GPT, "ours fp16")]  # fmt: skip
    rank = {key: i for i, key in enumerate(first)}
    return sorted(table, key=lambda r: (rank.get((r["table"], r["variant"]), len(first)), r["order"]))


def run_row(spec: dict, limit: float, log=None) -> dict:
    """Run one row in its own process group; kill the group at ``limit`` seconds. The row's result, or why none."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "row.json"
        cmd = [sys.executable, str(HERE / "gpu_row.py"), "--spec", json.dumps(spec), "--result", str(result)]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=HERE.parent, stdout=log, stderr=subprocess.STDOUT if log else None,
                                start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the row and its compile workers
            proc.wait()
            rc = None
        seconds = time.monotonic() - start
        if result.exists():  # written before a hang at exit is still the row's result
            out = json.loads(result.read_text())
        elif rc is None:
            out = {"error": f"timed out after {limit:.0f} s (killed)"}
        else:
            out = {"error": f"the row's process exited with {rc} and no result"}
    return {**out, "seconds": round(seconds, 1)}


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(done: list[dict], suite: str | None) -> str:
    lines = ["| model | precision | tokens/s | vs bf16-mixed | peak MiB | vs bf16-mixed | host syncs/step "
             "| late-flag waits/step (reads) | skipped steps (measured) | graphs (breaks) | loss (after steps) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    if suite is not None:
        lines.append(f"| CUDA suite | {suite} | | | | | | | | | |")
    for row in sorted(done, key=lambda r: (r["table"] != GPT, r["order"])):
        ref = next((r for r in done if r["table"] == row["table"] and r["variant"] == REF and "error" not in r
                    and "status" not in r), None)  # fmt: skip
        said = row.get("status") or (f"FAILED: {row['error']}" if "error" in row else None)
        if said:
            lines.append(f"| {row['table']} | {row['name']} | {said} | | | | | | | | |")
            continue
        t, m = row["tokens_per_s"], row.get("peak_mib")
        rt = ref and t / ref["tokens_per_s"]
        rm = ref and m and ref.get("peak_mib") and m / ref["peak_mib"]
        late = "-" if "late_waits_per_step" not in row else \
            f"{row['late_waits_per_step']:.2f} ({row['late_reads_per_step']:.2f})"  # fmt: skip
        skipped = "-" if "skipped" not in row else f"{row['skipped']} ({row['skipped_measured']})"
        graphs = "-" if "graphs" not in row else f"{row['graphs']} ({row['breaks']})"
        lines.append(f"| {row['table']} | {row['name']} | {t:,.0f} | {_fmt(rt, '.3f')} | {_fmt(m, ',.0f')} "
                     f"| {_fmt(rm, '.3f')} | {_fmt(row.get('syncs_per_step'), '.2f')} | {late} | {skipped} "
                     f"| {graphs} | {_fmt(row.get('loss'), '.4f')} ({row.get('steps', '-')}) |")  # fmt: skip
    return "\n".join(lines)


def run_table(specs: list[dict], out: Path, deadline: float, suite: str | None = None, log=None) -> list[dict]:
    """Run ``specs`` in order; after each, append its line to ``out/table_rows.jsonl`` and rewrite ``out/table.md``."""
    out.mkdir(parents=True, exist_ok=True)
    rows_file, done = out / "table_rows.jsonl", []
    rows_file.write_text("")
    for spec in specs:
        left = deadline - time.time()
        if spec["needs"] and importlib.util.find_spec(spec["needs"]) is None:
            result = {"status": f"skipped: no {_PIECES.get(spec['needs'], spec['needs'])}"}
        elif spec["dry"] and "fp8" in spec["variant"] and spec["compile"] and not _cpu_compiles_fp8():
            result = {"status": "skipped: inductor's FP8 GEMMs on this CPU need bf16 arithmetic"}
        elif left < 10:
            result = {"status": "not run: the table's deadline had passed"}
        else:
            print(f"--- {spec['table']} | {spec['name']} (limit {min(spec['limit'], left):.0f} s)", flush=True)
            result = run_row(spec, min(spec["limit"], left), log)
        row = {**{k: spec[k] for k in ("table", "name", "variant", "order")}, **result}
        done.append(row)
        with open(rows_file, "a") as f:  # one line per row, on disk before the next row starts
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        (out / "table.md").write_text(markdown(done, suite) + "\n")
        mine = f"| {row['table']} | {row['name']} |"
        print(next(line for line in markdown(done, None).splitlines() if line.startswith(mine)), flush=True)
    return done


def _check_probe(done: list[dict]) -> str | None:
    """The dry run's check of the timed-out probe: what is wrong, or None."""
    at = next(i for i, r in enumerate(done) if r["variant"] == "hang")
    if "timed out" not in done[at].get("error", ""):
        return f"the timeout probe did not time out: {done[at]}"
    if not any("tokens_per_s" in r for r in done[:at]) or not any("tokens_per_s" in r for r in done[at + 1:]):
        return "no row ran before the timed-out probe, or none after it: the check checked nothing"
    if any("error" in r for r in done[:at] + done[at + 1:]):
        return "a row before or after the timed-out probe failed"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="every row at tiny sizes, on whatever device is here")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds since the epoch: no row starts after it, and a row's limit ends at it")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")) / "gpu_check",
                        help="where table_rows.jsonl and table.md go (default: $OUT/gpu_check)")
    parser.add_argument("--suite", default=None, help="the CUDA suite's pytest counts, for the table's first row")
    parser.add_argument("--timeout-probe", action="store_true",
                        help="add a row that hangs past its 5 s limit, and check the rows around it were kept")
    args = parser.parse_args(argv)
    import torch  # after the arguments: --help answers without it

    if not torch.cuda.is_available() and not args.dry_run:
        parser.error("no CUDA device here: this table is for a GPU. HINT: --dry-run runs every row on a CPU")
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        f"CPU ({torch.backends.cpu.get_cpu_capability()})"  # fmt: skip
    print(f"device: {name} | torch {torch.__version__}"
          + (" | DRY RUN: tiny sizes, the numbers mean nothing" if args.dry_run else ""), flush=True)  # fmt: skip
    deadline = args.deadline if args.deadline is not None else float("inf")
    done = run_table(rows(args.dry_run, args.timeout_probe), args.out, deadline, args.suite)
    print(f"\nthe table ({args.out / 'table.md'}):")
    print(markdown(done, args.suite))
    failed = [r["name"] for r in done if "error" in r and r["variant"] != "hang"]
    problem = _check_probe(done) if args.timeout_probe else None
    if problem:
        print(f"dry run: {problem}")
    elif args.timeout_probe:
        print("dry run: the probe was killed at its limit; the rows before and after it are in the table's files")
    if failed:
        print(f"rows that failed or timed out: {', '.join(failed)}")
    return 1 if failed or problem else 0


if __name__ == "__main__":
    raise SystemExit(main())
