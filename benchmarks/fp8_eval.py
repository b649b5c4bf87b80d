"""What does evaluating an FP8-trained model compute? One fp8 fit of the demo GPT per recipe, then the same
weights validated five ways: inside the fit (``no_grad``, the FP8 Linears), ``trainer.validate`` with
``inference_mode=True`` (Lightning's default) and ``False``, and with the Linears in bf16 (the plugin's ``"bf16"``)
and in FP32 (no plugin).

    python benchmarks/fp8_eval.py                        # rowwise and rowwise_with_gw_hp, 150 steps, ~3 min
    python benchmarks/fp8_eval.py --recipes tensorwise rowwise mxfp8 --max-steps 300

Prints, as Markdown, per recipe the validation loss of each way and the differences of bf16's and FP32's to the FP8
one; the FP8 rows must be equal (evaluation computes the training step's FP8 forward, docs/fp8.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lightning_mp

from lightning_mp import MixedPrecisionPlugin  # noqa: E402
from lightning_mp.demos.gpt import GPT, RECIPE  # noqa: E402
from lightning_mp.demos.text import StdlibTextDataModule  # noqa: E402
from lightning_mp.gemm.support import cpu_capability  # noqa: E402

WAYS = ("in the fit (FP8)", "validate, inference_mode (FP8)", "validate, no_grad (FP8)", "bf16 Linears", "FP32")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["rowwise", "rowwise_with_gw_hp"], metavar="RECIPE")
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--max-bytes", type=int, default=1 << 20, help="text read (default 1 MiB)")
    parser.add_argument("--max-val-batches", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def trainer(plugin: Any, **kwargs: Any) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, plugins=[plugin] if plugin else None, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, **kwargs)


def losses(args: argparse.Namespace, recipe: str) -> dict[str, float]:
    L.seed_everything(args.seed, verbose=False)
    data = StdlibTextDataModule(block_size=64, batch_size=16, max_bytes=args.max_bytes,
                                max_val_batches=args.max_val_batches, seed=args.seed)

    def gpt() -> GPT:
        return GPT(vocab_size=data.vocab_size, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd,
                   **RECIPE)

    model = gpt()
    fp8 = dict(precision="fp8", fp8_recipe=recipe, fp8_modules=[nn.Linear])
    fitting = trainer(MixedPrecisionPlugin(**fp8), max_steps=args.max_steps, val_check_interval=args.max_steps,
                      check_val_every_n_epoch=None, gradient_clip_val=1.0)
    fitting.fit(model, datamodule=data)
    out = {WAYS[0]: float(fitting.callback_metrics["val_loss"])}
    for way, plugin, kwargs in ((WAYS[1], MixedPrecisionPlugin(**fp8), {}),
                                (WAYS[2], MixedPrecisionPlugin(**fp8), {"inference_mode": False}),
                                (WAYS[3], MixedPrecisionPlugin("bf16"), {}), (WAYS[4], None, {})):
        fresh = gpt()  # the trained weights; fresh metrics (made under inference_mode, they update under no other)
        fresh.load_state_dict(model.state_dict())
        out[way] = trainer(plugin, **kwargs).validate(fresh, datamodule=data, verbose=False)[0]["val_loss"]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"demo GPT {args.n_layer} layers x {args.n_embd}, batch 16 x 64, {args.max_steps} steps, seed {args.seed}, "
          f"every Linear in FP8; torch {torch.__version__}, CPU capability {cpu_capability()}", flush=True)
    print("\n| recipe | " + " | ".join(WAYS) + " | bf16 - FP8 | FP32 - FP8 |\n|---|" + "---:|" * (len(WAYS) + 2))
    for recipe in args.recipes:
        r = losses(args, recipe)
        fp8 = r[WAYS[0]]
        cells = " | ".join(f"{r[w]:.5f}" for w in WAYS)
        print(f"| {recipe} | {cells} | {r[WAYS[3]] - fp8:+.5f} | {r[WAYS[4]] - fp8:+.5f} |", flush=True)
        if not r[WAYS[0]] == r[WAYS[1]] == r[WAYS[2]]:
            print(f"{recipe}: the FP8 evaluations differ", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
