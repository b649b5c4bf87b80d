"""The GPU check's table: throughput, peak memory, host syncs and loss of each precision, in one Markdown table.

    python benchmarks/gpu_table.py                      # on a CUDA machine (scripts/gpu_check.sh runs it)
    python benchmarks/gpu_table.py --dry-run            # the same steps at tiny sizes, on whatever device is here
    python benchmarks/gpu_table.py --suite "12 passed, 3 skipped"   # put the CUDA suite's counts in the table

Two models, each trained by the Trainer with a fused optimizer (the optimizers that skip an overflowed step on the
device, without a host sync): a GPT-2-small-shaped language model (12 layers x 768, 12 heads, sequence 1024, the
stdlib-text bytes) with fused AdamW, and a ResNet-50-shaped convnet (bottleneck blocks 3-4-6-3, 224x224 images,
1000 classes) with fused SGD and momentum. Each precision trains the same seed and data: Lightning's ``32-true``,
``bf16-mixed`` and ``16-mixed``, ours bf16, fp16 and lean bf16 (``master_weights="compensated"``), ours fp8 when
torchao is installed, and Lightning's ``TransformerEnginePrecision`` (bf16 weights) when Transformer Engine is.

Per row: throughput (tokens/s, images/s) and peak memory (``torch.cuda.max_memory_allocated`` over the fit) with
their ratios to ``bf16-mixed`` in this run; host syncs per step (``torch.cuda.set_sync_debug_mode("warn")``
warnings over the measured steps: the moments the CPU waits for the GPU, whoever causes them, so ``bf16-mixed``'s
row is the floor Lightning itself sets); the training loss at the last step. The variants take turns within each
round (reversed every other round) and the reported figures are medians over rounds, so a GPU's clock changes or a
neighbour slow them alike. ``--dry-run`` (CPU, tiny sizes, one round) checks that every row is produced; its
numbers mean nothing. Exits 1 if a row failed.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.demos import GPT, StdlibTextDataModule


class FusedGPT(GPT):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, fused=True)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand x4, each with BatchNorm; the shortcut projects where shapes change."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True), nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )  # fmt: skip
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return F.relu(self.body(x) + self.shortcut(x))


class ResNet50(L.LightningModule):
    """ResNet-50's layout (He et al., 2016) at ``base`` channels in the stem (64 in the paper)."""

    def __init__(self, base: int = 64, classes: int = 1000) -> None:
        super().__init__()
        layers = [nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU(inplace=True),
                  nn.MaxPool2d(3, 2, 1)]  # fmt: skip
        cin = base
        for i, blocks in enumerate((3, 4, 6, 3)):
            width = base * 2**i
            for b in range(blocks):
                layers.append(Bottleneck(cin, width, 2 if b == 0 and i > 0 else 1))
                cin = 4 * width
        self.net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, fused=True)


def image_data(n: int, batch: int, size: int, classes: int) -> torch.utils.data.DataLoader:
    """Random images whose class is where the brightest of ``classes`` horizontal bands lies: learnable."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, size, size, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    band = max(size // classes, 1)
    for i in range(n):
        start = min(int(y[i]) * band, size - band)
        x[i, :, start:start + band] += 1.0
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


class Measure(Callback):
    """Throughput, host syncs and peak memory over the steps after ``warmup``; the last step's loss."""

    def __init__(self, warmup: int, items_per_step: int) -> None:
        self.warmup, self.items = warmup, items_per_step
        self.loss = None
        self._t0 = 0.0
        self._syncs: warnings.catch_warnings | None = None
        self._caught: list = []

    def _cuda(self, pl_module) -> bool:
        return pl_module.device.type == "cuda"

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.warmup and self._syncs is None:
            if self._cuda(pl_module):
                torch.cuda.synchronize()
                self._syncs = warnings.catch_warnings(record=True)
                self._caught = self._syncs.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.loss = outputs["loss"].detach()  # read after the fit: no sync inside the measured steps

    def on_train_end(self, trainer, pl_module):
        if self._cuda(pl_module):
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self._t0
        if self._syncs is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._syncs.__exit__(None, None, None)
        steps = trainer.global_step - self.warmup
        self.throughput = self.items * steps / self.seconds
        self.syncs = sum("synchroniz" in str(w.message) for w in self._caught) / steps if self._syncs else None


@dataclass
class Row:
    name: str
    trainer_kwargs: Callable[[], dict]
    throughput: list[float] = field(default_factory=list)
    peak: list[float] = field(default_factory=list)
    syncs: float | None = None
    loss: float | None = None
    error: str | None = None


def variants(device: str) -> list[Row]:
    rows = [
        Row("Lightning 32-true", lambda: dict(precision="32-true")),
        Row("Lightning bf16-mixed", lambda: dict(plugins=[MixedPrecision("bf16-mixed", device)])),
        # on a CPU Lightning turns precision="16-mixed" into bf16; the plugin object keeps fp16 (dry run only)
        Row("Lightning 16-mixed", lambda: dict(plugins=[MixedPrecision("16-mixed", device)])),
        Row("ours bf16", lambda: dict(plugins=[MixedPrecisionPlugin("bf16")])),
        Row("ours fp16", lambda: dict(plugins=[MixedPrecisionPlugin("fp16")])),
        Row("ours lean bf16", lambda: dict(plugins=[MixedPrecisionPlugin("bf16", master_weights="compensated")])),
    ]
    if device == "cuda" and importlib.util.find_spec("transformer_engine") is not None:
        from lightning.pytorch.plugins import TransformerEnginePrecision  # Lightning's FP8: TE's layers, bf16 weights

        rows.append(Row("Lightning TransformerEnginePrecision",
                        lambda: dict(plugins=[TransformerEnginePrecision(weights_dtype=torch.bfloat16)])))
    try:
        MixedPrecisionPlugin("fp8")
    except (ValueError, ImportError):  # not in this lightning_mp, or torchao missing: no row
        return rows
    # every Linear: torchao's shape rule (fp8_modules="default") keeps all of GPT-2 small's GEMMs in bf16
    return rows + [Row("ours fp8 rowwise, every Linear",
                       lambda: dict(plugins=[MixedPrecisionPlugin("fp8", fp8_modules=[nn.Linear])]))]


def run_model(what: str, args, device: str, deadline: float) -> list[Row]:
    dry = args.dry_run
    if what == "gpt":
        shape = dict(n_layer=2, n_head=2, n_embd=64, block_size=32) if dry else \
            dict(n_layer=12, n_head=12, n_embd=768, block_size=1024)  # fmt: skip
        batch = 2 if dry else 8
        make = lambda: FusedGPT(lr=3e-4, **shape)  # noqa: E731
        data = StdlibTextDataModule(block_size=shape["block_size"], batch_size=batch)
        items, unit = batch * shape["block_size"], "tokens/s"
    else:
        base, size, batch = (8, 32, 4) if dry else (64, 224, 64)
        make = lambda: ResNet50(base=base)  # noqa: E731
        data = image_data(batch * (args.warmup + args.steps), batch, size, classes=10)
        items, unit = batch, "images/s"
    rows = variants(device)
    for r in range(args.rounds):
        for row in rows if r % 2 == 0 else rows[::-1]:
            if row.error:
                continue
            if time.monotonic() > deadline and (r > 0 or row.throughput):
                continue  # out of time: the rounds run so far stand
            if time.monotonic() > deadline:
                row.error = "not run: --budget spent"
                continue
            try:
                L.seed_everything(0, verbose=False)
                measure = Measure(args.warmup, items)
                trainer = L.Trainer(
                    accelerator=device, devices=1, max_steps=args.warmup + args.steps, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, limit_val_batches=0, callbacks=[measure], **row.trainer_kwargs(),
                )  # fmt: skip
                if device == "cuda":
                    gc.collect(), torch.cuda.empty_cache(), torch.cuda.reset_peak_memory_stats()
                trainer.fit(make(), data)
                row.throughput.append(measure.throughput)
                if device == "cuda":
                    row.peak.append(torch.cuda.max_memory_allocated() / 2**20)
                if r == 0:
                    row.syncs, row.loss = measure.syncs, float(measure.loss)
            except Exception as err:  # noqa: BLE001 (the row says it failed; the others go on)
                row.error = f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
                traceback.print_exc()
    for row in rows:
        row.unit = unit
    return rows


def table(results: dict[str, list[Row]], suite: str | None, steps: int) -> str:
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    lines = [f"| model | precision | throughput | vs bf16-mixed | peak MiB | vs bf16-mixed | host syncs/step "
             f"| loss after {steps} steps |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    if suite is not None:
        lines.append(f"| CUDA suite | {suite} | | | | | | |")
    for model, rows in results.items():
        ref = next(r for r in rows if r.name == "Lightning bf16-mixed")
        ref_t = statistics.median(ref.throughput) if ref.throughput else None
        ref_m = statistics.median(ref.peak) if ref.peak else None
        for row in rows:
            if row.error:
                said = row.error if row.error.startswith("not run") else f"FAILED: {row.error}"
                lines.append(f"| {model} | {row.name} | {said} | | | | | |")
                continue
            t = statistics.median(row.throughput)
            m = statistics.median(row.peak) if row.peak else None
            lines.append(
                f"| {model} | {row.name} | {t:,.0f} {row.unit} | {fmt(ref_t and t / ref_t, '.3f')} | {fmt(m, ',.0f')} "
                f"| {fmt(ref_m and m and m / ref_m, '.3f')} | {fmt(row.syncs, '.1f')} | {fmt(row.loss, '.4f')} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, one round, on any device")
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet"], choices=["gpt", "resnet"])
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default 20; dry run 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before measuring (default 5; dry run 1)")
    parser.add_argument("--rounds", type=int, default=None, help="runs per precision (default 2; dry run 1)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds: no fit starts after this; rows not run say so (default: no limit)")
    parser.add_argument("--suite", default=None, help="the CUDA suite's pytest summary, for the table's first row")
    args = parser.parse_args(argv)
    for name, full, dry in (("steps", 20, 2), ("warmup", 5, 1), ("rounds", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, dry if args.dry_run else full)
        elif getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} is not allowed: use an integer >= 1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.dry_run:
        parser.error("no CUDA device here: this table is for a GPU. HINT: --dry-run checks the steps on a CPU")
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({torch.backends.cpu.get_cpu_capability()})"
    print(f"device: {name} | torch {torch.__version__} | lightning {L.__version__}"
          + (" | DRY RUN: tiny sizes, the numbers mean nothing" if args.dry_run else ""))  # fmt: skip
    start, budget = time.monotonic(), args.budget if args.budget is not None else float("inf")
    # each model gets its share of the budget: a slow first one cannot starve the second
    results = {what: run_model(what, args, device, start + budget * (i + 1) / len(args.models))
               for i, what in enumerate(args.models)}  # fmt: skip
    print(table({"GPT-2 small" if m == "gpt" else "ResNet-50": r for m, r in results.items()}, args.suite,
                args.warmup + args.steps))  # fmt: skip
    return 1 if any(row.error for rows in results.values() for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
