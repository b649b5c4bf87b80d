"""The README's ``precision/ranges_vs_formats`` screenshot, taken from a real run's TensorBoard event file.

    python scripts/ranges_vs_formats_screenshot.py OUT_DIR [--precision fp16] [--steps 100] [--every 50]

Fits the demo GPT (4 layers x 256, batch 16 x 128 bytes of stdlib text) with ``MixedPrecisionPlugin`` and
``ActivationRangeMonitor`` logging to ``OUT_DIR``, then reads the last logged image back from the event file (what
TensorBoard's Images tab shows) and writes it as ``OUT_DIR/ranges_vs_formats.png``. It also prints the overflow
report of every skipped step and the modules the monitor found, so the picture can be read against them.
"""

from __future__ import annotations

import argparse
import glob
import os

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_mp import ActivationRangeMonitor, GradientRangeMonitor, LossScaleMonitor, MixedPrecisionPlugin
from lightning_mp.demos import GPT, StdlibTextDataModule


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--precision", default="fp16")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=50, help="ActivationRangeMonitor's every_n_steps")
    args = parser.parse_args(argv)
    L.seed_everything(0, verbose=False)
    dm = StdlibTextDataModule(block_size=128, batch_size=16, max_bytes=2**21)
    model = GPT(n_layer=4, n_embd=256, n_head=4, block_size=128)
    plugin = MixedPrecisionPlugin(args.precision)
    logger = TensorBoardLogger(args.out_dir, name="ranges", version=args.precision)
    monitor = ActivationRangeMonitor(every_n_steps=args.every)
    trainer = L.Trainer(
        max_steps=args.steps,
        plugins=[plugin],
        callbacks=[LossScaleMonitor(), GradientRangeMonitor(every_n_steps=args.every), monitor],
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, dm)
    print(f"skipped steps: {plugin.skipped_steps}; last overflow: {plugin.last_overflow}")
    print(f"modules FP16 would overflow in the forward: {monitor.fp16_overflow_modules}")
    acc = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    acc.Reload()
    image = acc.Images("precision/ranges_vs_formats")[-1]
    path = os.path.join(args.out_dir, "ranges_vs_formats.png")
    with open(path, "wb") as f:
        f.write(image.encoded_image_string)
    print(f"step {image.step}: {image.width}x{image.height} PNG from {glob.glob(logger.log_dir + '/events*')[0]}")
    print(f"written to {path}")
    return path


if __name__ == "__main__":
    main()
