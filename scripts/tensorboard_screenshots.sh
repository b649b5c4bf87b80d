#!/usr/bin/env bash
# Regenerate the README's TensorBoard screenshots from a real training run and the real TensorBoard page.
#
#   scripts/tensorboard_screenshots.sh OUT_DIR
#
# 1. trains the demo GPT (fp16 with growth_interval=50, then bf16) with LossScaleMonitor and GradientRangeMonitor,
#    logging to OUT_DIR/gpt/{fp16,bf16}, and prints what the event files hold (scripts/_screenshot_run.py);
# 2. serves OUT_DIR with TensorBoard on a free local port;
# 3. captures the Time Series dashboard with headless Chromium into
#      docs/images/tensorboard_loss_scale.png      precision/loss_scale and precision/skipped_steps (fp16 run)
#      docs/images/tensorboard_grad_histogram.png  precision/grad_log2_magnitude (one card per run)
# 4. stops TensorBoard.
#
# Needs: the project's Python environment (torch, lightning, tensorboard; Pillow optional) and Chromium
# (Debian: apt-get install chromium). About 25 minutes on 2 CPU cores; much less on a GPU.
#
# Environment:
#   PYTHON      interpreter (default: .venv/bin/python if present, else python3)
#   CHROMIUM    browser executable (default: first of chromium, chromium-browser, google-chrome on PATH)
#   STEPS       training steps per run (default 350)
#   PRECISIONS  runs to train (default "fp16 bf16")
#   IMAGES      where to write the PNGs (default docs/images)
#   SKIP_TRAIN  set to 1 to reuse the event files already in OUT_DIR
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
fi
OUT=$1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [[ -z ${CHROMIUM:-} ]]; then
    for c in chromium chromium-browser google-chrome; do
        if command -v "$c" >/dev/null; then CHROMIUM=$c; break; fi
    done
fi
if [[ -z ${CHROMIUM:-} ]]; then
    echo "no Chromium found: install it (Debian: apt-get install chromium) or set CHROMIUM" >&2
    exit 1
fi
IMAGES=${IMAGES:-docs/images}
HELPER=scripts/_screenshot_run.py
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

mkdir -p "$OUT"
if [[ ${SKIP_TRAIN:-0} != 1 ]]; then
    # shellcheck disable=SC2086  # PRECISIONS is a list of words
    "$PYTHON" "$HELPER" train "$OUT" --steps "${STEPS:-350}" --precisions ${PRECISIONS:-fp16 bf16}
else
    "$PYTHON" "$HELPER" summary "$OUT"
fi

PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
TB_LOG=$(mktemp)
"$PYTHON" -m tensorboard.main --logdir "$OUT" --host 127.0.0.1 --port "$PORT" --load_fast=false >"$TB_LOG" 2>&1 &
TB_PID=$!
cleanup() {
    kill "$TB_PID" 2>/dev/null || true
    wait "$TB_PID" 2>/dev/null || true
    rm -f "$TB_LOG"
}
trap cleanup EXIT

# The helper waits until TensorBoard answers and has loaded the precision tags, then until each chart is drawn.
if ! "$PYTHON" "$HELPER" shoot "http://127.0.0.1:$PORT" "$IMAGES" --chromium "$CHROMIUM"; then
    echo "--- TensorBoard log ---" >&2
    cat "$TB_LOG" >&2
    exit 1
fi
