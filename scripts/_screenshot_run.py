"""Helper for ``scripts/tensorboard_screenshots.sh``: the training run behind the README's TensorBoard screenshots,
and the screenshots themselves.

    python scripts/_screenshot_run.py train OUT_DIR [--steps 350] [--precisions fp16 bf16] [--n-layer 4]
    python scripts/_screenshot_run.py summary OUT_DIR
    python scripts/_screenshot_run.py shoot http://127.0.0.1:PORT IMAGE_DIR [--chromium chromium]

``train`` fits the demo GPT on stdlib text with ``MixedPrecisionPlugin`` once per precision, logging to
``OUT_DIR/gpt/<precision>`` through ``LossScaleMonitor`` and ``GradientRangeMonitor``. The FP16 run uses
``growth_interval=50`` (default 2000) so the scale visibly moves within a few hundred steps: it starts at 2^16,
doubles after every 50 clean steps and halves on every overflow.

``summary`` reads the event files back and prints what the screenshots show: where the loss scale changed, the
skipped steps, and where the logged log2|g| histogram mass sits against FP16's subnormal floor (2^-24) and normal
floor (2^-14).

``shoot`` captures two PNGs of the running TensorBoard's Time Series dashboard with headless Chromium:
``tensorboard_loss_scale.png`` (``precision/loss_scale`` and ``precision/skipped_steps`` of the fp16 run) and
``tensorboard_grad_histogram.png`` (``precision/grad_log2_magnitude``, one card per run). It drives Chromium over
the DevTools protocol on a pipe (``--remote-debugging-pipe``, Python standard library only) rather than with
``--screenshot``: the dashboard fetches its data and draws its charts asynchronously, and a fixed
``--virtual-time-budget`` gave blank cards or charts without their lines depending on machine load. Here the page
is polled in real time until every expected card has drawn its data, then captured.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

TAG_SCALE = "precision/loss_scale"
TAG_SKIPPED = "precision/skipped_steps"
TAG_HIST = "precision/grad_log2_magnitude"
MAX_PNG_BYTES = 400 * 1024


# ----------------------------------------------------------------------------------------------------- training


def train(out: Path, precision: str, steps: int, n_layer: int, seed: int) -> None:
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_mp import GradientRangeMonitor, LossScaleMonitor, MixedPrecisionPlugin
    from lightning_mp.demos import GPT, StdlibTextDataModule

    L.seed_everything(seed)
    dm = StdlibTextDataModule(block_size=128, batch_size=16, seed=seed)
    model = GPT(vocab_size=dm.vocab_size, block_size=128, n_layer=n_layer)
    plugin = MixedPrecisionPlugin(precision, **({"growth_interval": 50} if precision == "fp16" else {}))
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=steps,
        plugins=[plugin],
        callbacks=[LossScaleMonitor(), GradientRangeMonitor(every_n_steps=20)],
        logger=TensorBoardLogger(save_dir=str(out), name="gpt", version=precision),
        log_every_n_steps=5,
        limit_val_batches=0,  # an epoch is ~1800 steps: validation would never run in this short fit anyway
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t0 = time.perf_counter()
    trainer.fit(model, dm)
    seconds = time.perf_counter() - t0
    print(
        f"[{precision}] {trainer.global_step} steps in {seconds:.0f} s ({trainer.global_step / seconds:.2f} steps/s) "
        f"on {trainer.strategy.root_device}, final loss scale {plugin.loss_scale:g}, skipped steps "
        f"{plugin.skipped_steps}, last train_loss {float(trainer.callback_metrics['train_loss']):.3f}",
        flush=True,
    )


def summarize(run_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    name = run_dir.name

    def series(tag: str) -> list:
        return acc.Scalars(tag) if tag in tags["scalars"] else []

    scale = series(TAG_SCALE)
    if scale:
        changes = [(e.step, e.value) for i, e in enumerate(scale) if i == 0 or e.value != scale[i - 1].value]
        print(f"[{name}] {TAG_SCALE}, (step, value) where it changed: "
              + ", ".join(f"({s}, 2^{math.log2(v):g})" if v > 0 else f"({s}, {v:g})" for s, v in changes))
    skipped = series(TAG_SKIPPED)
    if skipped:
        print(f"[{name}] {TAG_SKIPPED} at step {skipped[-1].step}: {skipped[-1].value:g}")
    for tag in ("precision/grad_underflow_fraction", "precision/grad_zero_fraction", "precision/grad_overflow_fraction"):
        s = series(tag)
        if s:
            print(f"[{name}] {tag}: step {s[0].step} {s[0].value:.3g}, step {s[-1].step} {s[-1].value:.3g}, "
                  f"max {max(e.value for e in s):.3g}")
    if TAG_HIST in tags["histograms"]:
        events = acc.Histograms(TAG_HIST)
        for ev in (events[0], events[-1]):
            h = ev.histogram_value
            lows = [lim - 1 for lim in h.bucket_limit]  # bucket i holds log2|g| in [limit - 1, limit)
            total = sum(h.bucket) or 1
            below24 = sum(c for lo, c in zip(lows, h.bucket) if lo < -24) / total
            below14 = sum(c for lo, c in zip(lows, h.bucket) if lo < -14) / total
            mode = lows[max(range(len(h.bucket)), key=lambda i: h.bucket[i])]
            run, median = 0, lows[0]
            for lo, c in zip(lows, h.bucket):
                run += c
                if run >= total / 2:
                    median = lo
                    break
            print(f"[{name}] {TAG_HIST} step {ev.step}: log2|g| spans [{h.min:g}, {h.max:g}), mode bucket "
                  f"[{mode:g}, {mode + 1:g}), median bucket [{median:g}, {median + 1:g}); |g| < 2^-24: {below24:.2%}, "
                  f"|g| < 2^-14: {below14:.2%} of {int(total)} nonzero elements")


# -------------------------------------------------------------------------------------------------- screenshots


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (fd 3: commands in, fd 4: replies out)."""

    def __init__(self, exe: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="tb-shot-profile-")
        to_chrome_r, to_chrome_w = os.pipe()
        from_chrome_r, from_chrome_w = os.pipe()

        def child_fds() -> None:
            # copy first, so neither dup2 maps a descriptor onto itself (which would keep close-on-exec set)
            a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", f"--user-data-dir={self.profile}", "--remote-debugging-pipe", "about:blank"],
            preexec_fn=child_fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._w = os.fdopen(to_chrome_w, "wb", buffering=0)
        self._r = os.fdopen(from_chrome_r, "rb", buffering=0)
        self._buf = b""
        self._id = 0
        self.session: str | None = None

    def _message(self) -> dict:
        while b"\0" not in self._buf:
            chunk = self._r.read(1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params: dict | None = None, browser: bool = False) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if self.session and not browser:
            msg["sessionId"] = self.session
        self._w.write(json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._message()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def eval(self, js: str):
        r = self.send("Runtime.evaluate", {"expression": js, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def open_page(self, width: int, height: int, scale: float, local_storage: dict[str, str]) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, browser=True)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, browser=True)[
            "sessionId"
        ]
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": scale, "mobile": False})
        self.send("Page.enable")
        # TensorBoard reads its Time Series settings from localStorage at start-up: seed them before any script runs
        seed = "".join(f"localStorage.setItem({json.dumps(k)}, {json.dumps(v)});" for k, v in local_storage.items())
        self.send("Page.addScriptToEvaluateOnNewDocument", {"source": f"try {{ {seed} }} catch (e) {{}}"})

    def wait_for(self, js: str, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not self.eval(js):
            if time.monotonic() > deadline:
                raise TimeoutError(f"TensorBoard did not render {what} within {timeout:.0f} s")
            time.sleep(0.5)

    def screenshot(self, clip: dict) -> bytes:
        data = self.send("Page.captureScreenshot", {"format": "png", "clip": {**clip, "scale": 1},
                                                    "captureBeyondViewport": True})["data"]
        return base64.b64decode(data)

    def close(self) -> None:
        try:
            self.send("Browser.close", browser=True)
            self.proc.wait(15)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


# Cards whose chart has been drawn: a path with at least one line segment in the scalar card's series view, or in
# the histogram card's chart (axes are drawn with H/V commands, data with L).
_JS_CARDS_DRAWN = """
(() => {
  const cards = Array.from(document.querySelectorAll('%(card)s'));
  const drawn = cards.filter(c => Array.from(c.querySelectorAll('%(paths)s'))
                                     .some(p => /L/.test(p.getAttribute('d') || '')));
  const busy = document.querySelector('%(card)s mat-progress-bar, %(card)s .loading');
  return cards.length === %(n)d && drawn.length === %(n)d && !busy;
})()
"""

# Bounding box, in CSS pixels, of the page from its top-left corner to the bottom-right of the last card.
_JS_CLIP = """
(() => {
  const cards = Array.from(document.querySelectorAll('%s')).map(c => c.getBoundingClientRect());
  return {x: 0, y: 0, width: Math.ceil(Math.max(...cards.map(r => r.right)) + 16),
          height: Math.ceil(Math.max(...cards.map(r => r.bottom)) + 16)};
})()
"""


def _url(base: str, tag_filter: str, run_filter: str | None = None) -> str:
    # forceSVG: draw charts as SVG in the page (the default draws WebGL in a worker, which headless captures
    # unreliably). smoothing=0: show the logged values themselves.
    params = {"darkMode": "false", "forceSVG": "true", "smoothing": "0", "tagFilter": tag_filter}
    if run_filter:
        params["runFilter"] = run_filter
    return f"{base}/?{urllib.parse.urlencode(params, quote_via=urllib.parse.quote)}#timeseries"


def _json(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def wait_for_tensorboard(base: str, timeout: float) -> tuple[list[str], list[str]]:
    """Poll until TensorBoard answers and has loaded the precision tags; return (runs with the scale scalar, runs
    with the histogram)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            scalars = _json(f"{base}/data/plugin/scalars/tags")
            hists = _json(f"{base}/data/plugin/histograms/tags")
            scale_runs = sorted(r for r, tags in scalars.items() if TAG_SCALE in tags)
            hist_runs = sorted(r for r, tags in hists.items() if TAG_HIST in tags)
            if scale_runs and hist_runs:
                return scale_runs, hist_runs
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"TensorBoard at {base} did not serve {TAG_SCALE} and {TAG_HIST} within {timeout:.0f} s")
        time.sleep(1)


def _save(png: bytes, path: Path) -> None:
    if len(png) > MAX_PNG_BYTES:
        try:  # screenshots of a flat UI lose nothing visible in a 256-colour palette
            from PIL import Image

            buf = io.BytesIO()
            Image.open(io.BytesIO(png)).convert("RGB").quantize(256).save(buf, format="PNG", optimize=True)
            png = buf.getvalue()
        except ImportError:
            pass
    path.write_bytes(png)
    print(f"wrote {path} ({len(png) // 1024} KB)", flush=True)


def shoot(base: str, images: Path, chromium: str, scale: float, timeout: float) -> None:
    scale_runs, hist_runs = wait_for_tensorboard(base, timeout)
    fp16_runs = [r for r in scale_runs if r.endswith("fp16")] or scale_runs[:1]
    settings = {"_tb_global_settings.timeseries": json.dumps({"timeSeriesSettingsPaneOpened": False,
                                                                "timeSeriesCardMinWidth": 480})}
    images.mkdir(parents=True, exist_ok=True)
    shots = [
        # (file, url, card selector, paths that show a drawn chart, expected cards)
        ("tensorboard_loss_scale.png",
         _url(base, f"^precision/({TAG_SCALE.split('/')[1]}|{TAG_SKIPPED.split('/')[1]})$", "|".join(fp16_runs)),
         "scalar-card", ".series-view path", 2),
        ("tensorboard_grad_histogram.png", _url(base, f"^{TAG_HIST}$"), "histogram-card", "tb-histogram svg path",
         len(hist_runs)),
    ]
    for name, url, card, paths, n in shots:
        browser = Chromium(chromium)
        try:
            browser.open_page(1300, 1000, scale, settings)
            browser.send("Page.navigate", {"url": url})
            try:
                browser.wait_for(_JS_CARDS_DRAWN % {"card": card, "paths": paths, "n": n}, timeout, f"{n} {card}(s)")
            except TimeoutError:
                debug = Path(tempfile.mkdtemp(prefix="tb-shot-")) / name
                debug.write_bytes(base64.b64decode(browser.send("Page.captureScreenshot", {"format": "png"})["data"]))
                print(f"timed out; the page as it was: {debug}", file=sys.stderr)
                raise
            time.sleep(1.0)  # let the last layout/transition settle
            _save(browser.screenshot(browser.eval(_JS_CLIP % card)), images / name)
        finally:
            browser.close()


# --------------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train and log (then print the summary)")
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=350)
    p.add_argument("--precisions", nargs="+", default=["fp16", "bf16"], choices=["fp16", "bf16", "fp32"])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("summary", help="print what the event files under OUT/gpt hold")
    p.add_argument("out", type=Path)
    p = sub.add_parser("shoot", help="screenshot a running TensorBoard")
    p.add_argument("base", help="TensorBoard's address, e.g. http://127.0.0.1:6006")
    p.add_argument("images", type=Path, help="folder to write the PNGs to")
    p.add_argument("--chromium", default=os.environ.get("CHROMIUM", "chromium"))
    p.add_argument("--scale", type=float, default=2.0, help="device pixel ratio of the screenshots")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for TensorBoard to load and draw")
    args = parser.parse_args()

    if args.command == "train":
        for precision in args.precisions:
            train(args.out, precision, args.steps, args.n_layer, args.seed)
    if args.command in ("train", "summary"):
        runs = sorted(d for d in (args.out / "gpt").glob("*") if d.is_dir())
        if not runs:
            sys.exit(f"no runs under {args.out / 'gpt'}")
        for run_dir in runs:
            summarize(run_dir)
    if args.command == "shoot":
        shoot(args.base.rstrip("/"), args.images, args.chromium, args.scale, args.timeout)


if __name__ == "__main__":
    main()
