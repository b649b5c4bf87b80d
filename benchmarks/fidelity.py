"""Fidelity over seeds: how far each precision (and precision schedule) ends from FP32, on the demo GPT and a stock
``transformers`` Llama, over 3 seeds.

    python benchmarks/fidelity.py --out runs/fidelity.md   # 2 models x 3 seeds x 8 rows: 48 fits, 6-10 min, 2 cores
    python benchmarks/fidelity.py --quick              # a smoke run: 1 layer, 10 steps, 2 seeds (~20 s)
    python benchmarks/fidelity.py --models gpt --seeds 0 7 --max-steps 300

Rows (every one a ``lightning.Trainer`` fit; every row of a seed starts from the same weights and sees the same
batches in the same order):

* ``fp32``: no plugin, ``32-true``, torch's AdamW: the reference;
* ``bf16``: ``MixedPrecisionPlugin("bf16")`` (FP32 masters);
* ``fp8``: ``MixedPrecisionPlugin("fp8", fp8_modules=[nn.Linear])`` throughout (the default shape rule would keep
  Linears this small in bf16; the script checks that some Linears do compute in FP8);
* ``fp8 -> bf16 at 90%``: the same, with ``schedule={0.9: "bf16"}``;
* ``fp16``: ``MixedPrecisionPlugin("fp16")`` (dynamic loss scale) throughout;
* ``fp16 -> bf16 at 90%``: the same, with ``schedule={0.9: "bf16"}`` (the loss scale retires there);
* ``masters + AdamW8bit``: ``MixedPrecisionPlugin("bf16")`` (FP32 masters) with torchao's ``AdamW8bit``;
* ``lean + AdamW8bit``: ``MixedPrecisionPlugin("bf16", master_weights="compensated")`` with ``AdamW8bit``: exact
  masters at 8 B/param.

Every run has the demo's optimizer recipe (``lightning_mp.demos.gpt.RECIPE``: AdamW or AdamW8bit with nanoGPT's
weight-decay groups, peak lr 1e-3 after a 40-step warmup, a cosine to 0.1 x peak at the last step), gradients
clipped at 1.0, and reports three numbers: the training loss (mean of the last 10 steps); the validation loss on
held-out text, once, after the last step, inside the fit (so in the format of the last rung: FP8 Linears for
``fp8``, bf16 after a switch); and the same validation of the final weights computed in FP32 outside any plugin
(``FP32-eval``: where the weights ended, apart from the format they are evaluated in). Per row the table shows the
mean over seeds, the min-max over seeds, and the relative difference to FP32 of the same seed
(``(x - fp32) / fp32``): its mean over seeds and the largest in size.

The statements of issue 47 follow as PASS/FAIL lines (nothing is asserted): fp8 -> bf16 ends at least as close to
FP32 as fp8 throughout; fp16 -> bf16 trains; lean + AdamW8bit ends within the seed spread of masters + AdamW8bit
(and whether the two are bit-identical). A scheduled run also checks that its steps ran in the scheduled format.

On a CPU, FP8 is emulated by torchao (FP8 operands, FP32 GEMMs: the numerics of the recipe, not its speed).
torchao compiles AdamW8bit's step once per parameter shape (about 20 s a shape on one core, then cached on disk);
``--quick`` uses the full run's widths so the two share that cache.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lightning_mp

from lightning_mp import MixedPrecisionPlugin  # noqa: E402
from lightning_mp.core.ladder import label  # noqa: E402
from lightning_mp.demos.gpt import GPT, RECIPE, lr_factor  # noqa: E402
from lightning_mp.demos.seeds import seed_list  # noqa: E402
from lightning_mp.demos.text import StdlibTextDataModule  # noqa: E402

try:
    import transformers
except ImportError:  # the bench extra is not installed: the Llama rows are skipped with one line
    transformers = None

TRAIN_LOSS_WINDOW = 10
SWITCH_AT = 0.9

# row -> (the plugin's arguments, or None for a plain 32-true Trainer; the optimizer)
ROWS: dict[str, tuple[Optional[dict[str, Any]], str]] = {
    "fp32": (None, "AdamW"),
    "bf16": ({"precision": "bf16"}, "AdamW"),
    "fp8": ({"precision": "fp8", "fp8_modules": [nn.Linear]}, "AdamW"),
    "fp8 -> bf16 at 90%": ({"precision": "fp8", "fp8_modules": [nn.Linear], "schedule": {SWITCH_AT: "bf16"}}, "AdamW"),
    "fp16": ({"precision": "fp16"}, "AdamW"),
    "fp16 -> bf16 at 90%": ({"precision": "fp16", "schedule": {SWITCH_AT: "bf16"}}, "AdamW"),
    "masters + AdamW8bit": ({"precision": "bf16"}, "AdamW8bit"),
    "lean + AdamW8bit": ({"precision": "bf16", "master_weights": "compensated"}, "AdamW8bit"),
}
MODELS = ("gpt", "llama")


# ------------------------------------------------------------------------------------------------------ the models
def configure(module: L.LightningModule, optimizer_name: str, betas=(0.9, 0.95), weight_decay=0.1) -> dict:
    """The demo's recipe with ``optimizer_name`` (torch's AdamW or torchao's AdamW8bit): nanoGPT's weight-decay
    groups, a linear warmup, a cosine to ``min_lr_ratio`` x peak at the last step, stepped every optimizer step."""
    if optimizer_name == "AdamW8bit":
        from torchao.optim import AdamW8bit as optimizer_class  # 8-bit moments for tensors of >= 4096 elements
    else:
        optimizer_class = torch.optim.AdamW
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = optimizer_class(groups, lr=RECIPE["lr"], betas=betas)
    factor = functools.partial(lr_factor, warmup_steps=RECIPE["warmup_steps"],
                               decay_steps=int(module.trainer.estimated_stepping_batches),
                               min_lr_ratio=RECIPE["min_lr_ratio"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class DemoGPT(GPT):
    """``lightning_mp.demos.GPT`` with the optimizer named (its own recipe otherwise)."""

    def __init__(self, optimizer_name: str = "AdamW", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_name = optimizer_name

    def configure_optimizers(self):
        return configure(self, self.optimizer_name, tuple(self.hparams.betas), self.hparams.weight_decay)

    def _loss(self, batch):
        x, y = batch
        return self.loss_fn(self(x), y)


class LlamaLM(L.LightningModule):
    """A stock ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (no download), byte-level."""

    def __init__(self, optimizer_name: str, n_layer: int, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=StdlibTextDataModule.vocab_size, hidden_size=n_embd, intermediate_size=4 * n_embd,
            num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head,
            max_position_embeddings=block_size, bos_token_id=0, eos_token_id=0)
        self.net = transformers.LlamaForCausalLM(config)
        self.optimizer_name = optimizer_name

    def _loss(self, batch):
        x, y = batch
        logits = self.net(x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), batch_size=batch[0].shape[0])

    def configure_optimizers(self):
        return configure(self, self.optimizer_name)


@torch.no_grad()
def fp32_val_loss(model: L.LightningModule, data: StdlibTextDataModule) -> float:
    """The validation loss of the final weights computed in FP32, outside any plugin: after ``fit`` every row's
    Parameters hold its FP32 masters (lean bf16's rebuilt, FP8's forwards gone), so this measures where the weights
    ended, apart from the format the last rung evaluates in."""
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise RuntimeError(f"after fit, parameter {name!r} is {p.dtype}, not the FP32 master")
    model.eval()
    total, count = 0.0, 0
    for x, y in data.val_dataloader():
        total += float(model._loss((x, y))) * x.shape[0]
        count += x.shape[0]
    return total / count


def build(model: str, optimizer_name: str, args: argparse.Namespace) -> L.LightningModule:
    sizes = dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size)
    if model == "gpt":
        return DemoGPT(optimizer_name, vocab_size=StdlibTextDataModule.vocab_size, **sizes, **RECIPE)
    return LlamaLM(optimizer_name, **sizes)


# ------------------------------------------------------------------------------------------------------- one run
class Recorder(Callback):
    """Per optimizer step: the training loss, and for lightning_mp's plugin the format that computed it (the
    schedule's rung) and how many Linears computed in FP8."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.formats: list[str] = []
        self.fp8_linears: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))  # the unscaled loss; a host sync, cheap on a CPU
        plugin = trainer.precision_plugin
        core = getattr(plugin, "core", None)
        if core is not None:
            self.formats.append(label(core))
            self.fp8_linears.append(len(core.fp8.chosen) if core.fp8.enabled else 0)


class LogLines(logging.Handler):
    """The FP8 set-up line the plugin logs at the start of a fit (which Linears compute in FP8, emulated or not)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += [line for line in record.getMessage().splitlines() if line.startswith("fp8:")]


def train(model_name: str, row: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    plugin_args, optimizer_name = ROWS[row]
    L.seed_everything(seed, verbose=False)
    model = build(model_name, optimizer_name, args)
    data = StdlibTextDataModule(block_size=args.block_size, batch_size=args.batch_size, max_bytes=args.max_bytes,
                                max_val_batches=args.max_val_batches, seed=seed)
    recorder, lines = Recorder(), LogLines()
    # the plugin's set-up line (which Linears compute in FP8) goes through Lightning's rank_zero_info; this run keeps
    # it and drops the rest of Lightning's per-fit lines ("GPU available: False", ...), which 48 fits would repeat
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    saved = rank_zero.level, rank_zero.propagate
    rank_zero.setLevel(logging.INFO)
    rank_zero.propagate = False
    rank_zero.addHandler(lines)
    try:
        trainer = L.Trainer(
            accelerator="cpu", devices=1,
            plugins=[MixedPrecisionPlugin(**plugin_args)] if plugin_args is not None else [],
            precision="32-true" if plugin_args is None else None,
            max_steps=args.max_steps, val_check_interval=args.max_steps, check_val_every_n_epoch=None,
            num_sanity_val_steps=0, gradient_clip_val=1.0, callbacks=[recorder], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(model, datamodule=data)
    finally:
        rank_zero.removeHandler(lines)
        rank_zero.setLevel(saved[0])
        rank_zero.propagate = saved[1]
    window = recorder.losses[-TRAIN_LOSS_WINDOW:]
    return {
        "train_loss": statistics.fmean(window) if window else math.nan,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "fp32_val_loss": fp32_val_loss(model, data),
        "formats": recorder.formats,
        "fp8_linears": max(recorder.fp8_linears, default=0),
        "log": lines.lines,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def schedule_check(row: str, result: dict[str, Any], max_steps: int) -> Optional[tuple[str, bool]]:
    """For a scheduled row: a line saying in which format its steps ran, and whether that is the schedule's (the
    plugin's precision up to step ``round(0.9 * max_steps) - 1``, bf16 from there on)."""
    plugin_args, _ = ROWS[row]
    if plugin_args is None or "schedule" not in plugin_args:
        return None
    start = round(SWITCH_AT * max_steps)
    formats = result["formats"]
    before, after = set(formats[:start]), set(formats[start:])
    first = plugin_args["precision"]
    ok = (len(formats) == max_steps and len(before) == 1 and next(iter(before)).split(",")[0] == first
          and after == {"bf16"})
    return (f"steps 0-{start - 1} in {sorted(before)}, steps {start}-{max_steps - 1} in {sorted(after)}"
            + ("" if ok else f" (expected {first!r} then 'bf16' from step {start})")), ok


# ------------------------------------------------------------------------------------------------------- the table
def relative(values: dict[int, float], reference: dict[int, float]) -> dict[int, float]:
    return {s: (v - reference[s]) / reference[s] for s, v in values.items() if s in reference}


def row_cells(values: dict[int, float], reference: dict[int, float], is_reference: bool) -> list[str]:
    if not values:
        return ["-", "-", "-", "-"]
    mean, low, high = statistics.fmean(values.values()), min(values.values()), max(values.values())
    cells = [f"{mean:.4f}", f"{low:.4f}-{high:.4f}"]
    rel = relative(values, reference)
    if is_reference or not rel:
        return cells + ["-", "-"]
    largest = max(rel.values(), key=abs)
    return cells + [f"{statistics.fmean(rel.values()):+.2%}", f"{largest:+.2%}"]


TABLE_HEADER = ["model", "row", "val loss mean", "val loss min-max", "val vs fp32 (mean)", "val vs fp32 (max)",
                "FP32-eval val vs fp32 (mean)", "FP32-eval val vs fp32 (max)", "train loss mean",
                "train loss min-max", "train vs fp32 (mean)", "train vs fp32 (max)"]


def table(results: dict[tuple[str, str], dict[int, dict[str, Any]]], models: list[str]) -> str:
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|---|---|" + "---:|" * (len(TABLE_HEADER) - 2)]
    for model in models:
        for row in ROWS:
            runs = results.get((model, row), {})
            cells = [model, row]
            for key in ("val_loss", "fp32_val_loss", "train_loss"):
                values = {s: r[key] for s, r in runs.items()}
                reference = {s: r[key] for s, r in results.get((model, "fp32"), {}).items()}
                shown = row_cells(values, reference, row == "fp32")
                cells += shown[2:] if key == "fp32_val_loss" else shown  # the differences only: the loss is ~val's
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _mean_abs_rel(results, model: str, row: str, key: str = "val_loss") -> float:
    values = {s: r[key] for s, r in results[model, row].items()}
    reference = {s: r[key] for s, r in results[model, "fp32"].items()}
    return statistics.fmean(abs(v) for v in relative(values, reference).values())


def verdicts(results: dict[tuple[str, str], dict[int, dict[str, Any]]], models: list[str],
             tolerance: float) -> list[str]:
    """Issue 47's statements, one PASS/FAIL line each per model (``tolerance``: 'close to FP32' for fp16 -> bf16)."""
    out = []
    for model in models:
        fp8, sched = _mean_abs_rel(results, model, "fp8"), _mean_abs_rel(results, model, "fp8 -> bf16 at 90%")
        weights = [_mean_abs_rel(results, model, row, "fp32_val_loss") for row in ("fp8 -> bf16 at 90%", "fp8")]
        out.append(f"{'PASS' if sched <= fp8 else 'FAIL'} {model}: fp8 -> bf16 at 90% ends at least as close to "
                   f"FP32 as fp8 throughout (mean |val loss - fp32| / fp32: {sched:.3%} vs {fp8:.3%}; the final "
                   f"weights evaluated in FP32: {weights[0]:.3%} vs {weights[1]:.3%})")

        fp32 = [r["val_loss"] for r in results[model, "fp32"].values()]
        low, high = min(fp32), max(fp32)
        mean = statistics.fmean(r["val_loss"] for r in results[model, "fp16 -> bf16 at 90%"].values())
        rel = _mean_abs_rel(results, model, "fp16 -> bf16 at 90%")
        inside = low <= mean <= high
        out.append(f"{'PASS' if inside or rel <= tolerance else 'FAIL'} {model}: fp16 -> bf16 at 90% trains: mean val "
                   f"loss {mean:.4f} {'inside' if inside else 'outside'} the FP32 seed range {low:.4f}-{high:.4f}, "
                   f"mean |difference| to FP32 of the same seed {rel:.3%} (close: <= {tolerance:.0%})")

        masters, lean = results[model, "masters + AdamW8bit"], results[model, "lean + AdamW8bit"]
        spread = max(r["val_loss"] for r in masters.values()) - min(r["val_loss"] for r in masters.values())
        gaps = {s: abs(lean[s]["val_loss"] - masters[s]["val_loss"]) for s in lean if s in masters}
        identical = all(lean[s]["params"].keys() == masters[s]["params"].keys() and all(
            torch.equal(lean[s]["params"][k], masters[s]["params"][k]) for k in masters[s]["params"]) for s in gaps)
        out.append(f"{'PASS' if all(g <= spread for g in gaps.values()) else 'FAIL'} {model}: lean + AdamW8bit ends "
                   f"within the seed spread of masters + AdamW8bit (largest per-seed |val loss difference| "
                   f"{max(gaps.values()):.2e}, seed spread {spread:.4f}); final FP32 weights "
                   + ("bit-identical on every seed" if identical else "NOT bit-identical"))
    return out


# -------------------------------------------------------------------------------------------------------- the run
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 layer, 10 steps, 2 seeds, batch 4")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=None, metavar="S",
                        help="one number N: seeds 0..N-1 (default 3; 2 with --quick); two or more: those seeds")
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps per run (default 150)")
    parser.add_argument("--n-layer", type=int, default=None, help="layers (default 2)")
    parser.add_argument("--n-embd", type=int, default=64, help="width (default 64; AdamW8bit quantizes tensors "
                        "of >= 4096 elements, so every weight matrix from 64 on)")
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=None, help="default 8")
    parser.add_argument("--max-val-batches", type=int, default=None, help="default 16")
    parser.add_argument("--max-bytes", type=int, default=1 << 20, help="text read (default 1 MiB)")
    parser.add_argument("--tolerance", type=float, default=0.01,
                        help="'close to FP32' for the fp16 -> bf16 statement: mean relative difference (0.01)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady on shared cores)")
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown table to this file")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"seeds": [2] if quick else [3], "max_steps": 10 if quick else 150, "n_layer": 1 if quick else 2,
                "batch_size": 4 if quick else 8, "max_val_batches": 1 if quick else 16}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.seeds = seed_list(args.seeds)
    except ValueError as err:
        parser.error(str(err))
    if args.max_steps < TRAIN_LOSS_WINDOW:
        parser.error(f"--max-steps={args.max_steps!r} is not allowed: use >= {TRAIN_LOSS_WINDOW} (the training "
                     "loss is the mean of the last 10 steps)")
    if round(SWITCH_AT * args.max_steps) >= args.max_steps:
        parser.error(f"--max-steps={args.max_steps!r} leaves no step after the switch at {SWITCH_AT:.0%}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning_mp").setLevel(logging.INFO)  # the schedule's switches (kept by train())
    # once per fit otherwise: Lightning's pytree deprecation, torchao's note on its compiled step's cache key
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching")
    models = [m for m in args.models if m != "llama" or transformers is not None]
    if len(models) < len(args.models):
        print("llama left out: transformers is not installed (pip install -e '.[bench]')")
    config = (f"{args.n_layer} layers x {args.n_embd} ({args.n_head} heads), batch {args.batch_size} x "
              f"{args.block_size} bytes, {args.max_steps} steps (warmup {RECIPE['warmup_steps']}, cosine to "
              f"{RECIPE['min_lr_ratio']} x peak lr {RECIPE['lr']}), switch at step "
              f"{round(SWITCH_AT * args.max_steps)}, seeds {', '.join(map(str, args.seeds))}, validation on "
              f"{args.max_val_batches} held-out batches")
    env = (f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} "
           f"thread(s)" + (f", transformers {transformers.__version__}" if transformers is not None else ""))
    print(f"fidelity: {len(models)} model(s) x {len(args.seeds)} seeds x {len(ROWS)} rows; {config}; {env}",
          flush=True)
    plan = [(m, s, r) for m in models for s in args.seeds for r in ROWS]
    results: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    checks: list[str] = []
    start = time.perf_counter()
    for i, (model, seed, row) in enumerate(plan, 1):
        t0 = time.perf_counter()
        result = train(model, row, seed, args)
        results.setdefault((model, row), {})[seed] = result
        note = ""
        if ROWS[row][0] is not None and ROWS[row][0]["precision"] == "fp8":
            note += f", {result['fp8_linears']} Linears in FP8"
            if result["fp8_linears"] == 0:
                checks.append(f"FAIL {model} seed {seed} {row}: no Linear computed in FP8")
        switch = schedule_check(row, result, args.max_steps)
        if switch is not None:
            line, ok = switch
            note += f"; {line}"
            if not ok:
                checks.append(f"FAIL {model} seed {seed} {row}: {line}")
        elapsed = time.perf_counter() - start
        print(f"[{i}/{len(plan)}] {model} seed {seed} {row}: train loss {result['train_loss']:.4f}, val loss "
              f"{result['val_loss']:.4f} ({time.perf_counter() - t0:.0f} s, ~{elapsed / i * (len(plan) - i):.0f} s "
              f"left){note}", flush=True)
        if seed == args.seeds[0]:
            for line in result["log"]:
                print(f"    {line}", flush=True)
    for (model, row), runs in results.items():  # the weights were kept for the bitwise check only
        if row not in ("masters + AdamW8bit", "lean + AdamW8bit"):
            for r in runs.values():
                r.pop("params", None)
    report = (f"{table(results, models)}\n{config}; {env}; {time.perf_counter() - start:.0f} s in all.\n")
    lines = verdicts(results, models, args.tolerance) if len(args.seeds) > 1 else ["(one seed: no statements checked)"]
    lines += checks or ["PASS every fp8 run computed some Linears in FP8 and every scheduled run switched at its step"]
    print("\n" + report)
    print("\n".join(lines))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n" + "\n".join(f"- {line}" for line in lines) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
