"""Regenerate the README's TensorBoard screenshots from real runs of the demo GPT.

    python docs/screenshots.py all OUT_DIR [--steps 300] [--images docs/images] [--chromium PATH]
    python docs/screenshots.py train OUT_DIR [--steps 300] [--precisions fp16 bf16]
    python docs/screenshots.py summary OUT_DIR
    python docs/screenshots.py shoot OUT_DIR [--images docs/images] [--chromium PATH]

``train`` fits the GPT (4 x 256, batch 16 x 128 bytes of stdlib text) with ``MixedPrecisionPlugin`` (defaults) per
precision, logging every step (so a one-step spike of the scale shows) to an empty ``OUT_DIR/gpt/<precision>`` with
``LossScaleMonitor`` and ``GradientRangeMonitor``; fp16 uses ``growth_interval=50`` (default 2000) so the scale
moves: it starts at 2^16, doubles after 50 clean steps, halves on an overflow. ``summary`` reads the event files
under OUT_DIR back (:func:`read_run`, no browser): where the loss scale changed, skipped steps, gradient fractions,
and the log2|g| histogram mass against FP16's subnormal (2^-24) and normal (2^-14) floors. ``shoot`` serves OUT_DIR
with TensorBoard on a free local port, captures the Time Series dashboard with Playwright once every expected card
has drawn, and stops TensorBoard: ``tensorboard_loss_scale.png`` (loss scale, skipped steps; fp16 run) and
``tensorboard_grad_histogram.png`` (``precision/grad_log2_magnitude``, a card per run). ``all``: train, summary,
shoot.

Needs the project's environment; ``shoot`` also needs ``pip install -e .[docs]`` (Playwright; skip ``playwright
install``, the system browser is used) and Chromium (Debian: ``apt-get install chromium``; else ``--chromium``).
On 2 CPU cores ``all`` takes 4 to 5 minutes (fp16 about 3, bf16 1 to 1.5, the screenshots about 10 s).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

SCALE, SKIPPED, HIST = "precision/loss_scale", "precision/skipped_steps", "precision/grad_log2_magnitude"
FRACTIONS = ("precision/grad_underflow_fraction", "precision/grad_zero_fraction", "precision/grad_overflow_fraction")


def train(out: Path, precision: str, steps: int) -> None:
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_mp import GradientRangeMonitor, LossScaleMonitor, MixedPrecisionPlugin
    from lightning_mp.demos import GPT, StdlibTextDataModule

    L.seed_everything(0, verbose=False)
    dm = StdlibTextDataModule(block_size=128, batch_size=16, seed=0)
    plugin = MixedPrecisionPlugin(precision, **({"growth_interval": 50} if precision == "fp16" else {}))
    trainer = L.Trainer(max_steps=steps, plugins=[plugin], logger=TensorBoardLogger(out, name="gpt", version=precision),
                        callbacks=[LossScaleMonitor(), GradientRangeMonitor(every_n_steps=20)], devices=1,
                        log_every_n_steps=1, limit_val_batches=0, num_sanity_val_steps=0,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    t0 = time.perf_counter()
    trainer.fit(GPT(vocab_size=dm.vocab_size, block_size=128, n_layer=4, n_embd=256, n_head=4), dm)
    print(f"[{precision}] {trainer.global_step} steps in {time.perf_counter() - t0:.0f} s; final loss scale "
          f"{plugin.loss_scale:g}, skipped steps {plugin.skipped_steps}, last train_loss "
          f"{float(trainer.callback_metrics['train_loss']):.3f}", flush=True)


def read_run(run_dir: Path) -> dict:
    """One run's event files: ``scale_changes`` [(step, value)] at the first point and wherever the loss scale
    changed, ``skipped`` (step, count) of the last point, ``fractions`` {tag: ((step, v), (step, v), max)} at the
    first and last point, and ``histograms``: for the first and last log2|g| histogram its step, span, mode and
    median buckets (by their lower edge: a bucket with limit b holds log2|g| in [b - 1, b), as GradientRangeMonitor
    logs it), the fractions of its nonzero elements below 2^-24 and 2^-14, and their total."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}
    scale = scalars.get(SCALE, [])
    info = {"scale_changes": [p for i, p in enumerate(scale) if i == 0 or p[1] != scale[i - 1][1]],
            "skipped": scalars[SKIPPED][-1] if scalars.get(SKIPPED) else None,
            "fractions": {t: (s[0], s[-1], max(v for _, v in s)) for t, s in scalars.items() if t in FRACTIONS and s},
            "histograms": []}
    events = acc.Histograms(HIST) if HIST in tags["histograms"] else []
    for ev in events[:1] + events[1:][-1:]:
        h = ev.histogram_value
        lows, counts = [b - 1 for b in h.bucket_limit], list(h.bucket)
        total = sum(counts)
        cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
        info["histograms"].append({
            "step": ev.step, "min": h.min, "max": h.max, "total": int(total),
            "mode": lows[counts.index(max(counts))] if counts else None,
            "median": next((lo for lo, c in zip(lows, cumulative) if c >= total / 2), None),
            "below_2^-24": sum(c for lo, c in zip(lows, counts) if lo < -24) / (total or 1),
            "below_2^-14": sum(c for lo, c in zip(lows, counts) if lo < -14) / (total or 1)})
    return info


def summary(out: Path) -> list[str]:
    """Printable lines of :func:`read_run` for every folder holding event files under ``out``; exits if none."""
    runs = sorted({p.parent for p in out.rglob("events.out.tfevents.*")}) if out.is_dir() else []
    if not runs:
        sys.exit(f"no TensorBoard event files under {out}")
    lines, pow2 = [], lambda v: f"2^{math.log2(v):g}" if v > 0 else f"{v:g}"
    for run in runs:
        name, info = run.relative_to(out).as_posix(), read_run(run)
        if info["scale_changes"]:
            lines.append(f"[{name}] {SCALE}, (step, value) where it changed: "
                         + ", ".join(f"({s}, {pow2(v)})" for s, v in info["scale_changes"]))
        if info["skipped"]:
            lines.append(f"[{name}] {SKIPPED} at step {info['skipped'][0]}: {info['skipped'][1]:g}")
        for tag, ((s0, v0), (s1, v1), top) in info["fractions"].items():
            lines.append(f"[{name}] {tag}: step {s0} {v0:.3g}, step {s1} {v1:.3g}, max {top:.3g}")
        for h in (h for h in info["histograms"] if h["total"]):
            lines.append(f"[{name}] {HIST} step {h['step']}: log2|g| in [{h['min']:g}, {h['max']:g}), mode bucket "
                         f"{h['mode']:g}, median bucket {h['median']:g}; |g| < 2^-24: {h['below_2^-24']:.2%}, "
                         f"|g| < 2^-14: {h['below_2^-14']:.2%} of {h['total']} nonzero elements")
    return lines


# A card has drawn once one of its chart paths has a line segment (axes are drawn with H/V commands, data with L).
_JS_DRAWN = """([card, paths, n]) => { const cards = [...document.querySelectorAll(card)];
  return cards.length === n && !document.querySelector(card + ' mat-progress-bar') && cards.every(
    c => [...c.querySelectorAll(paths)].some(p => /L/.test(p.getAttribute('d') || ''))); }"""
_JS_CLIP = """card => { const r = [...document.querySelectorAll(card)].map(c => c.getBoundingClientRect());
  return {x: 0, y: 0, width: Math.ceil(Math.max(...r.map(b => b.right)) + 16),
          height: Math.ceil(Math.max(...r.map(b => b.bottom)) + 16)}; }"""
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def _runs_with(base: str, plugin: str, tag: str) -> list[str]:
    with urllib.request.urlopen(f"{base}/data/plugin/{plugin}/tags", timeout=10) as r:
        return sorted(run for run, tags in json.load(r).items() if tag in tags)


def shoot(out: Path, images: Path, chromium: str | None = None, timeout: float = 180.0) -> None:
    exe = shutil.which(chromium) if chromium else next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                                                        "google-chrome"))), None)
    if not exe:
        sys.exit(f"no Chromium {'at ' + chromium if chromium else 'on PATH'} (Debian: apt-get install chromium)")
    summary(out)  # exits when there is nothing to serve
    from playwright.sync_api import sync_playwright  # the docs extra: pip install -e .[docs]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile()
    tb = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(out), "--host", "127.0.0.1",
                           "--port", str(port), "--load_fast=false"], stdout=log, stderr=subprocess.STDOUT)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    try:
        while True:  # until TensorBoard answers and has loaded both tags
            try:
                scale_runs, hist_runs = _runs_with(base, "scalars", SCALE), _runs_with(base, "histograms", HIST)
                if scale_runs and hist_runs:
                    break
            except OSError:
                pass
            if tb.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                sys.exit(f"TensorBoard did not serve {SCALE} and {HIST} from {out}; its log:\n{log.read().decode()}")
            time.sleep(1)
        fp16 = "|".join([r for r in scale_runs if r.endswith("fp16")] or scale_runs[:1])
        shots = [("tensorboard_loss_scale.png", "^precision/(loss_scale|skipped_steps)$", fp16, "scalar-card",
                  ".series-view path", 2),
                 ("tensorboard_grad_histogram.png", f"^{HIST}$", "", "histogram-card", "tb-histogram svg path",
                  len(hist_runs))]
        # ignoreOutliers off: the y-range takes in one-step spikes of the scale (it clips them by default)
        settings = json.dumps({"timeSeriesSettingsPaneOpened": False, "timeSeriesCardMinWidth": 480,
                               "ignoreOutliers": False})
        images.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, headless=True, args=BROWSER_ARGS)
            for name, tag_filter, run_filter, card, paths, n in shots:
                page = browser.new_page(viewport={"width": 1300, "height": 1000}, device_scale_factor=2)
                # TensorBoard reads its Time Series settings from localStorage at start-up
                page.add_init_script(f"localStorage.setItem('_tb_global_settings.timeseries', {json.dumps(settings)})")
                # forceSVG: charts as SVG in the page, not WebGL in a worker; smoothing 0: the logged values themselves
                query = {"darkMode": "false", "forceSVG": "true", "smoothing": "0", "tagFilter": tag_filter,
                         **({"runFilter": run_filter} if run_filter else {})}
                page.goto(f"{base}/?{urllib.parse.urlencode(query, quote_via=urllib.parse.quote)}#timeseries")
                page.wait_for_function(_JS_DRAWN, arg=[card, paths, n], timeout=timeout * 1000, polling=250)
                page.wait_for_load_state("networkidle")
                page.screenshot(path=images / name, clip=page.evaluate(_JS_CLIP, card), animations="disabled")
                print(f"wrote {images / name} ({(images / name).stat().st_size // 1024} KB)", flush=True)
                page.close()
            browser.close()
    finally:
        tb.terminate()
        tb.wait(30)
        log.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("all", "train", "summary", "shoot"):
        p = sub.add_parser(name)
        p.add_argument("out", type=Path, help="folder of the runs' TensorBoard logs")
        if name in ("all", "train"):
            p.add_argument("--steps", type=int, default=300)
        if name in ("all", "shoot"):
            p.add_argument("--images", type=Path, default=Path(__file__).resolve().parent / "images",
                           help="where to write the PNGs (default: docs/images)")
            p.add_argument("--chromium", help="browser executable (default: chromium on PATH)")
        if name == "train":
            p.add_argument("--precisions", nargs="+", default=["fp16", "bf16"], choices=["fp16", "bf16"])
    args = parser.parse_args(argv)
    if getattr(args, "steps", 1) < 1:
        parser.error(f"--steps must be a positive integer, got {args.steps}")

    if args.command in ("all", "train"):
        precisions = getattr(args, "precisions", ["fp16", "bf16"])
        if existing := [p for p in precisions if (args.out / "gpt" / p).exists()]:  # TensorBoardLogger would append
            sys.exit(f"{args.out / 'gpt'} already holds runs of {' and '.join(existing)}: give an empty OUT_DIR")
        for precision in precisions:
            train(args.out, precision, args.steps)
    if args.command in ("all", "train", "summary"):
        print("\n".join(summary(args.out)))
    if args.command in ("all", "shoot"):
        shoot(args.out, args.images, args.chromium)


if __name__ == "__main__":
    main()
