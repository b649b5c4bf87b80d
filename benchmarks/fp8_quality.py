"""Does FP8 train the demo GPT as well as bf16? The final validation loss of ``precision="fp8"`` (each recipe)
against the plugin's bf16 and FP32, over several seeds, with the demo's warmup.

    python benchmarks/fp8_quality.py                                   # 3 seeds x 5 precisions, ~10 min on 2 CPU cores
    python benchmarks/fp8_quality.py --max-steps 300 --n-embd 256      # longer, wider
    python benchmarks/fp8_quality.py --recipes rowwise mxfp8 --seeds 0 7

Every run trains the demo GPT (``lightning_mp.demos.gpt.GPT``) on the standard library's source
(``StdlibTextDataModule``) with the demo's optimizer recipe (``RECIPE``: AdamW, a 40-step linear warmup, a cosine to
0.1 x peak at ``--max-steps``), and validates once after the last step, inside the fit (so the FP8 runs validate
through their FP8 Linears). A seed sets the initialisation and the batch order; every precision of a seed starts
from the same weights and sees the same batches. The FP8 runs put every Linear in FP8
(``fp8_modules=[nn.Linear]``): the default shape rule keeps a model this small in bf16.

Printed at the end, as Markdown: per precision the mean and the min-max over seeds of the final validation loss and
the ratio of the means to bf16's; per FP8 recipe whether its mean is within ``--tolerance`` (2%) of bf16's, and
whether its difference to bf16 is beyond the seed spread (the two min-max ranges do not overlap: every seed of one
ended better than every seed of the other; otherwise no difference is claimed). On a machine without FP8 GEMMs the
FP8 runs are emulated by torchao (docs/fp8.md): the numerics are the recipe's, the speed is not.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lightning_mp

from lightning_mp import MixedPrecisionPlugin  # noqa: E402
from lightning_mp.demos.gpt import GPT, RECIPE  # noqa: E402
from lightning_mp.demos.seeds import SeedSpread, compare, seed_list  # noqa: E402
from lightning_mp.demos.text import StdlibTextDataModule  # noqa: E402
from lightning_mp.gemm.support import cpu_capability  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # mxfp8 on request (--recipes): rows a multiple of 32


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=150, help="training steps per run (default 150)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[3], metavar="S",
                        help="one number N: seeds 0..N-1 (default 3); two or more: exactly those seeds")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), metavar="RECIPE",
                        help=f"FP8 recipes (default: {' '.join(RECIPES)}; mxfp8 also)")
    parser.add_argument("--no-fp32", action="store_true", help="leave out the FP32 row")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-val-batches", type=int, default=16)
    parser.add_argument("--max-bytes", type=int, default=1 << 20, help="text read (default 1 MiB)")
    parser.add_argument("--tolerance", type=float, default=0.02, help="FP8 within this fraction of bf16 (0.02)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady on shared cores)")
    parser.add_argument("--output", type=Path, default=None, help="also write the table to OUTPUT/results.md")
    args = parser.parse_args(argv)
    try:
        args.seeds = seed_list(args.seeds)
    except ValueError as err:
        parser.error(str(err))
    bad = [r for r in args.recipes if r not in (*RECIPES, "mxfp8")]
    if bad:
        parser.error(f"--recipes: {bad[0]!r} is not an FP8 recipe: use {', '.join((*RECIPES, 'mxfp8'))}")
    if args.max_steps < 1:
        parser.error(f"--max-steps={args.max_steps!r} must be >= 1")
    return args


def runs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Run name -> the plugin's arguments."""
    out: dict[str, dict[str, Any]] = {} if args.no_fp32 else {"fp32": {"precision": "fp32"}}
    out["bf16"] = {"precision": "bf16"}
    for recipe in args.recipes:
        out[f"fp8 {recipe}"] = {"precision": "fp8", "fp8_recipe": recipe, "fp8_modules": [nn.Linear]}
    return out


def train(args: argparse.Namespace, seed: int, plugin_args: dict[str, Any]) -> float:
    """One fit; the validation loss after its last step."""
    L.seed_everything(seed, verbose=False)
    model = GPT(vocab_size=StdlibTextDataModule.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                n_head=args.n_head, n_embd=args.n_embd, **RECIPE)
    data = StdlibTextDataModule(block_size=args.block_size, batch_size=args.batch_size, max_bytes=args.max_bytes,
                                max_val_batches=args.max_val_batches, seed=seed)
    trainer = L.Trainer(
        accelerator="cpu" if not torch.cuda.is_available() else "auto",
        devices=1,
        plugins=[MixedPrecisionPlugin(**plugin_args)],
        max_steps=args.max_steps,
        val_check_interval=args.max_steps,  # one validation, after the last step, inside the fit
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    return float(trainer.callback_metrics["val_loss"])


def table(results: dict[str, SeedSpread], tolerance: float) -> str:
    bf16 = results["bf16"]
    lines = ["| precision | val loss mean | min-max over seeds | mean / bf16 | within "
             f"{tolerance:.0%} of bf16 | difference to bf16 |", "|---|---:|---:|---:|---|---|"]
    for name, spread in results.items():
        ratio = spread.mean / bf16.mean
        within, verdict = "", ""
        if name != "bf16":
            within = "yes" if abs(ratio - 1) <= tolerance else "**no**"
            c = compare("val loss", name, spread, "bf16", bf16)
            verdict = {"beyond": f"{c.delta:+.4f}, beyond the seed spread",
                       "within": f"{c.delta:+.4f}, within the seed spread: none claimed",
                       "one seed": f"{c.delta:+.4f}, one seed: none claimed"}.get(c.verdict, "-")
        lines.append(f"| {name} | {spread.mean:.4f} | {spread.range_text('.4f')} | {ratio:.4f} | {within} | "
                     f"{verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    plan = runs(args)
    config = (f"demo GPT {args.n_layer} layers x {args.n_embd} ({args.n_head} heads), batch {args.batch_size} x "
              f"{args.block_size}, {args.max_steps} steps (warmup {RECIPE['warmup_steps']}, cosine), seeds "
              f"{', '.join(map(str, args.seeds))}; torch {torch.__version__}, CPU capability {cpu_capability()}, "
              f"{args.threads} thread(s)")
    print(f"{len(plan)} precisions x {len(args.seeds)} seeds: {config}", flush=True)
    values: dict[str, dict[int, float]] = {name: {} for name in plan}
    start = time.perf_counter()
    for i, seed in enumerate(args.seeds):
        for name in (list(plan)[::-1] if i % 2 else plan):  # every other seed in reverse: no fixed neighbour
            t0 = time.perf_counter()
            values[name][seed] = train(args, seed, plan[name])
            print(f"seed {seed}, {name}: val loss {values[name][seed]:.4f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    report = table({name: SeedSpread(v) for name, v in values.items()}, args.tolerance)
    report += f"\n{config}; {time.perf_counter() - start:.0f} s in all.\n"
    print("\n" + report, end="")
    if args.output is not None:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "results.md").write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
