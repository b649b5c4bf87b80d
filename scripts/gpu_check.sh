#!/usr/bin/env bash
# The GPU check: one call on one CUDA machine as its image is (python3, torch, Lightning, pytest; no network), at
# most 8 minutes with start-up, one Markdown table. docs/benchmarks.md ("The GPU check") has the commands.
#
#   bash scripts/gpu_check.sh             # repository root, on the CUDA machine, gpu_wheels/ carried along
#   bash scripts/gpu_check.sh --dry-run   # every step at tiny sizes on a CPU (CI runs it: it must not rot)
#
# Steps:
#   1. the wheels: every wheel in gpu_wheels/ (or $GPU_WHEELS), filled beforehand on a machine with the package index
#      (torchao; docs/benchmarks.md), installed with no network into a temporary folder put on PYTHONPATH;
#   2. the machine, and one line per optional piece (torch against our floor, torchao, Transformer Engine,
#      jsonargparse): present or absent, and what that means here;
#   3. the CUDA suite: tests marked on_device or cuda and not slow, core files first, on the GPU; no test starts
#      after its deadline (tests/conftest.py's --deadline: they skip, and pytest ends with its counts and
#      cuda_suite.xml, a JUnit file);
#   4. benchmarks/gpu_table.py: each row in its own process under its own limit, appended to table_rows.jsonl and
#      table.md as it ends; no row starts after the table's deadline.
# A signal would lose what a step measured (Lightning ignores SIGINT once its fit catches one, and exits): the
# deadlines end each step; the `timeout` around a step is a backstop only. Everything goes to $OUT/gpu_check (else
# ./gpu_check_out/gpu_check); the table is printed last.
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
PY="${PYTHON:-python3}"
# the checkout is imported from where it is: nothing is installed into the image's own site-packages
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
# budgets on the GPU (seconds): suite + table + start-up and wheels stay inside 8 minutes
SUITE_S=170
TABLE_S=260

step() {  # step NAME SECONDS COMMAND...: run under a backstop limit, tee its output, remember a failure
    local name="$1" limit="$2"
    shift 2
    echo
    echo "=== $name (backstop ${limit} s) ==="
    local start=$SECONDS
    timeout -s TERM --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s ==="
    [ "$rc" -eq 0 ] || status=1
    return "$rc"
}

echo "=== wheels ==="
WHEELS="${GPU_WHEELS:-gpu_wheels}"
if [ "$DRY" -eq 1 ]; then
    # a wheel made here from nothing (no network, no build backend), installed below the way gpu_wheels/ is
    WHEELS="$SCRATCH/wheels"
    "$PY" benchmarks/gpu_env.py --probe-wheel "$WHEELS"
fi
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    TARGET="$SCRATCH/gpu_check_wheels"
    # --no-index: the GPU machine has no network; --no-deps: what the wheels need is on the image (or carried too)
    if "$PY" -m pip install --quiet --no-index --no-deps --target "$TARGET" "$WHEELS"/*.whl; then
        export PYTHONPATH="$PYTHONPATH:$TARGET"
        echo "installed into a temporary folder on PYTHONPATH: $(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')"
    else
        echo "gpu_check: installing the wheels of $WHEELS/ failed (above); going on without them"
        status=1
    fi
    if [ "$DRY" -eq 1 ]; then
        "$PY" -c "import gpu_check_probe as p; print('dry run: the probe wheel imports from', p.__file__)" || status=1
    fi
else
    echo "no wheels in $WHEELS/: torchao only if the image has it. HINT: fill it first (docs/benchmarks.md) and" \
        "carry it (the device tool's run: carry [\"gpu_wheels\"])"
fi

echo
echo "=== machine ==="
if [ "$DRY" -eq 1 ]; then
    echo "DRY RUN: tiny sizes on this machine's CPU; the CUDA suite collects and skips"
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PY" benchmarks/gpu_env.py || status=1

# The CUDA suite: the files of the clean step and the plugin first (a deadline cuts the tail), then the rest in
# name order; the slow files and the 2700-step autopilot test (9 fits of 300 steps) left out.
CORE=(tests/test_deferred.py tests/test_step.py tests/test_gemm_emulation.py tests/test_overflow_locator.py
      tests/test_log2_histogram.py tests/test_plugin_integration.py tests/test_faults.py tests/test_fabric.py
      tests/test_lean_integration.py tests/test_dropin_integration.py tests/test_fp32_policy_integration.py)
FILES=("${CORE[@]}")
for f in tests/test_*.py; do
    [[ " ${CORE[*]} " == *" $f "* ]] || FILES+=("$f")
done
AUTOPILOT_2700=tests/test_autopilot_integration.py
AUTOPILOT_2700+=::test_an_outlier_feature_in_the_demo_gpt_trains_in_fp16_within_2_percent_of_fp32
PER_TEST=()
"$PY" -c "import pytest_timeout" 2> /dev/null && PER_TEST=(--timeout 90)  # one hung test is one failure
suite_limit=$([ "$DRY" -eq 1 ] && echo 900 || echo "$SUITE_S")
step cuda_suite $((suite_limit + 40)) "$PY" -m pytest "${FILES[@]}" --device cuda \
    -m "(on_device or cuda) and not slow" \
    --deselect "$AUTOPILOT_2700" \
    --deadline $(($(date +%s) + suite_limit)) --junitxml "$RESULTS/cuda_suite.xml" --continue-on-collection-errors \
    -q -rfE -p no:cacheprovider "${PER_TEST[@]}"
# the counts of pytest's last line: "12 passed, 3 failed, 40 skipped"
suite=$(grep -E "[0-9]+ (passed|failed|skipped|errors?|deselected)" "$RESULTS/cuda_suite.log" | tail -1 |
    grep -oE "[0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed)" | paste -sd, - | sed 's/,/, /g')
late=$(grep -o "deadline passed" "$RESULTS/cuda_suite.xml" 2> /dev/null | wc -l)
[ "$late" -gt 0 ] && suite="$suite ($late skipped at the deadline)"
echo "suite: ${suite:-no summary}"

if [ "$DRY" -eq 1 ]; then
    # on a CPU every test of the CUDA suite skips: one that ran would not be marked as the suite says
    echo "$suite" | grep -qE "passed|failed|error" && { echo "dry run: some CUDA-suite tests did not skip"; status=1; }
    # the deadline path: a deadline already past skips every test, and pytest still ends with its counts and XML
    step deadline_probe 600 "$PY" -m pytest tests/test_deferred.py -q -p no:cacheprovider \
        --deadline $(($(date +%s) - 1)) --junitxml "$RESULTS/deadline_probe.xml"
    if tail -1 "$RESULTS/deadline_probe.log" | grep -qE "^[0-9]+ skipped in" &&
        grep -q "deadline passed" "$RESULTS/deadline_probe.xml"; then
        echo "dry run: past the deadline every test skipped, and the counts and the JUnit file came out"
    else
        echo "dry run: the deadline probe did not end with only skips, its counts and its JUnit file"
        status=1
    fi
    step table 3000 "$PY" benchmarks/gpu_table.py --dry-run --timeout-probe --out "$RESULTS" \
        --suite "${suite:-no summary}"
else
    step table $((TABLE_S + 30)) "$PY" benchmarks/gpu_table.py --deadline $(($(date +%s) + TABLE_S)) --out "$RESULTS" \
        --suite "${suite:-no summary}"
fi

echo
echo "=== the table ($RESULTS/table.md; each row's numbers in table_rows.jsonl, the suite's in cuda_suite.xml) ==="
cat "$RESULTS/table.md" 2> /dev/null || echo "(no table: see the table step above)"
echo "gpu_check: $([ $status -eq 0 ] && echo all steps passed || echo SOME STEPS FAILED, see above)"
exit $status
