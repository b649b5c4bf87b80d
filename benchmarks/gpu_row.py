"""One row of the GPU table, in a process of its own (benchmarks/gpu_table.py starts it).

    python3 benchmarks/gpu_row.py --spec '{"model": "gpt", "variant": "ours bf16", ...}' --result row.json

Builds the row's model and precision, trains it with the Trainer on batches already on the device, and writes one
JSON object to ``--result``: tokens/s over the measured steps, peak memory net of what was allocated before the fit,
host syncs and late-flag waits per measured step, skipped steps, compiled graphs, the last loss; or the error. A
process per row: a row that raises or hangs cannot leave sync-debug mode, a warnings catcher, compiled code or
allocator state to the rows after it, and its time limit is a kill.

``model: "probe"`` rows exercise that isolation without torch: ``variant`` ``"ok"``, ``"raise"`` or ``"hang"``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path


def _probe(variant: str) -> dict:
    if variant == "hang":
        time.sleep(3600)
    if variant == "raise":
        raise RuntimeError("the probe row raised, as asked")
    return {"tokens_per_s": 1.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, help="the row, as JSON (benchmarks/gpu_table.py's ROWS)")
    parser.add_argument("--result", required=True, type=Path, help="where the row's JSON result is written")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec)
    try:
        if spec["model"] == "probe":
            result = _probe(spec["variant"])
        else:
            from gpu_fit import fit_row  # torch, Lightning and the model only in a real row

            result = fit_row(spec)
        status = 0
    except Exception as err:  # noqa: BLE001 (the row says it failed; the table goes on)
        traceback.print_exc()
        first = str(err).splitlines()[0][:160] if str(err) else ""
        result, status = {"error": f"{type(err).__name__}: {first}"}, 1
    args.result.write_text(json.dumps(result))
    sys.stdout.flush()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
