#!/usr/bin/env bash
# Everything the README's GPU table needs, on one CUDA machine, in under 5 minutes.
#
#   bash scripts/gpu_check.sh            # from the repository root of a fresh copy
#
# Assumes torch, lightning, torchmetrics, tensorboard and pytest are installed; installs this package without its
# dependencies. benchmarks/compare_precisions.py also needs jsonargparse[signatures] (LightningCLI): if it is missing
# and there is no network, put its wheels (jsonargparse, docstring-parser, typeshed-client) in a directory and
# point WHEELS at it. Every step has its own time limit; a step that fails or runs out is reported and the script
# goes on. Results go to $OUT/gpu_check (or ./gpu_check_out) and are printed.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-gpu_check_out}/gpu_check"
mkdir -p "$RESULTS"
status=0
PY="${PYTHON:-$(command -v python || command -v python3)}"
# the checkout itself is importable even if the editable install below fails
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, tee its output, remember a failure
    local name="$1" limit="$2"
    shift 2
    echo
    echo "=== $name (limit ${limit} s) ==="
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s ==="
    [ "$rc" -eq 0 ] || status=1
}

echo "=== machine ==="
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" - <<'PYEOF'
import torch, lightning
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| lightning", lightning.__version__)
print("cuda available:", torch.cuda.is_available(), "| bf16:", torch.cuda.is_available() and torch.cuda.is_bf16_supported())
PYEOF
# no build isolation: that would fetch setuptools from the network
"$PY" -m pip install -q -e . --no-deps --no-build-isolation || echo "(editable install failed; using PYTHONPATH)"

if ! "$PY" -c "import jsonargparse" 2>/dev/null && [ -n "${WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "jsonargparse[signatures]" || true
fi

step pytest_cuda 60 "$PY" -m pytest -m cuda -q -p no:cacheprovider
step benchmark 60 "$PY" benchmarks/benchmark.py --rounds 2 --steps 20 --warmup 5
# the seed's convnet (ResNet-14 + BatchNorm, batch 512): ours against Lightning's 16-mixed / bf16-mixed on the GPU
step benchmark_resnet 60 "$PY" benchmarks/benchmark.py --model resnet --only bf16-mixed 16-mixed "no overflow" \
    --rounds 2 --steps 12 --warmup 4

if "$PY" -c "import jsonargparse" 2>/dev/null; then
    # the same GPT and batch as the CPU table, long enough for the loss to move; 30 s per run at most
    step compare_precisions 160 "$PY" benchmarks/compare_precisions.py --max-steps 200 --timeout 30 \
        --output "$RESULTS/compare"
    [ -f "$RESULTS/compare/results.csv" ] && { echo; echo "--- results.csv ---"; cat "$RESULTS/compare/results.csv"; }
else
    echo
    echo "=== compare_precisions: SKIPPED, jsonargparse is not installed (set WHEELS, see the header) ==="
    status=1
fi

echo
echo "gpu_check: $([ $status -eq 0 ] && echo all steps passed || echo SOME STEPS FAILED, see above); logs in $RESULTS"
exit $status
