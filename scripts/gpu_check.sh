#!/usr/bin/env bash
# The GPU check: one call on one CUDA machine, at most 8 minutes, one Markdown table.
#
#   bash scripts/gpu_check.sh             # from the repository root of a fresh copy, on a CUDA machine
#   bash scripts/gpu_check.sh --dry-run   # the same steps at tiny sizes on a CPU (CI runs this: it must not rot)
#
# Steps, each under its own time limit (a step that fails or runs out is reported and the script goes on):
#   1. the machine: GPU, driver, torch, CUDA, Lightning;
#   2. the CUDA suite: every test marked on_device (Trainer and Fabric level) or cuda, on the GPU
#      (pytest --device cuda -m "on_device or cuda"); on a CPU they all collect and skip, with the reason;
#   3. benchmarks/gpu_table.py: tokens/s and peak memory of a GPT-2-small-shaped model and a ResNet-50-shaped
#      convnet for Lightning's 32-true, bf16-mixed, 16-mixed and ours bf16, fp16, lean bf16 (and fp8 where this
#      lightning_mp has it), ratios against bf16-mixed, host syncs per step and the loss after the run; the
#      suite's counts go in the table's first row.
# Assumes only what the GPU machine has (torch, lightning, torchmetrics, tensorboard, pytest; no network) and
# installs this package without its dependencies. Logs go to $OUT/gpu_check (or ./gpu_check_out/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") ;;
    *) echo "gpu_check.sh: unknown argument '$1': use no argument (on a CUDA machine) or --dry-run" >&2; exit 2 ;;
esac
RESULTS="${OUT:-gpu_check_out}/gpu_check"
mkdir -p "$RESULTS"
status=0
PY="${PYTHON:-$(command -v python || command -v python3)}"
# the checkout itself is importable even if the editable install below fails
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME SECONDS COMMAND...: run under a time limit, tee its output, remember a failure
    local name="$1" limit="$2"
    shift 2
    echo
    echo "=== $name (limit ${limit} s) ==="
    local start=$SECONDS
    # SIGINT first: pytest then still prints its summary line, with the counts so far
    timeout -s INT --kill-after=15 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s ==="
    [ "$rc" -eq 0 ] || status=1
}

echo "=== machine ==="
if [ "$DRY" -eq 1 ]; then
    echo "DRY RUN: tiny sizes on this machine's CPU; the CUDA suite collects and skips"
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    # no build isolation: that would fetch setuptools from the network
    "$PY" -m pip install -q -e . --no-deps --no-build-isolation || echo "(editable install failed; using PYTHONPATH)"
fi
"$PY" -c "import torch, lightning; print('torch', torch.__version__, '| cuda', torch.version.cuda, '| lightning', \
lightning.__version__, '| cuda available:', torch.cuda.is_available())"

# 2 + 3 fit in 8 minutes on one H200 with the limits below (290 + 160 s, plus start-up)
step cuda_suite $([ "$DRY" -eq 1 ] && echo 240 || echo 290) \
    "$PY" -m pytest --device cuda -m "on_device or cuda" -q -rfE -p no:cacheprovider
# the counts of pytest's last line: "12 passed, 3 failed, 40 skipped"
suite=$(grep -E "[0-9]+ (passed|failed|skipped|errors?)" "$RESULTS/cuda_suite.log" | tail -1 \
    | grep -oE "[0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed)" | paste -sd, - | sed 's/,/, /g')
if [ "$DRY" -eq 1 ]; then
    # on a CPU every test of the CUDA suite must skip: one that ran would mean it is not marked as the suite says
    echo "$suite" | grep -qE "passed|failed|error" && { echo "dry run: some CUDA-suite tests did not skip"; status=1; }
    step table 240 "$PY" benchmarks/gpu_table.py --dry-run --suite "${suite:-no summary}"
else
    # --budget: no fit starts after 120 s, so the table comes out inside the step's limit with what ran
    step table 160 "$PY" benchmarks/gpu_table.py --budget 120 --suite "${suite:-no summary}"
fi

echo
grep -E "^\|" "$RESULTS/table.log" > "$RESULTS/table.md" || true
echo "gpu_check: $([ $status -eq 0 ] && echo all steps passed || echo SOME STEPS FAILED, see above); the table: $RESULTS/table.md"
exit $status
