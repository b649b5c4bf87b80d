"""Run by tests/test_faults.py: train (or resume) a small fp16 run with ModelCheckpoint every epoch."""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from lightning_mp import MixedPrecisionPlugin  # noqa: E402
from tests.conftest import TinyRegressor, regression_data  # noqa: E402


class Slow(Callback):
    """Gives the parent time to kill the run between checkpoints."""

    def __init__(self, seconds):
        self.seconds = seconds

    def on_train_batch_end(self, *args):
        time.sleep(self.seconds)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    model = TinyRegressor(fault_at={5, 13})  # two overflows: the scaler state has to survive the kill
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**7, growth_interval=5, hysteresis=2)
    ckpt = ModelCheckpoint(dirpath=os.path.join(args.dir, "ckpt"), filename="{epoch}", save_top_k=-1,
                           every_n_epochs=1, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=args.epochs, plugins=[plugin],
        callbacks=[ckpt, Slow(args.sleep)], logger=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True,
    )
    ckpt_path = os.path.join(args.dir, "ckpt", "last.ckpt") if args.resume else None
    if args.resume:
        model.seen_batches = torch.load(ckpt_path, weights_only=False)["global_step"]
    trainer.fit(model, regression_data(), ckpt_path=ckpt_path)
    torch.save(
        {"state": model.state_dict(), "global_step": trainer.global_step, "scaler": plugin.core.scaler.state_dict()},
        os.path.join(args.dir, "final.pt"),
    )


if __name__ == "__main__":
    main()
