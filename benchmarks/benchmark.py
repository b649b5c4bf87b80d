"""Step time and model-state memory: lightning_mp against Lightning's own mixed precision, interleaved.

    python benchmarks/benchmark.py                 # the small GPT, CPU or CUDA, whichever is present
    python benchmarks/benchmark.py --rounds 6 --steps 10
    python benchmarks/benchmark.py --model resnet --only fp16 bf16   # the seed's convnet: ResNet-14, BatchNorm

Every variant trains the same GPT (4 layers, 256 wide, batch 16 x 128 bytes of stdlib text) for ``--steps``
steps per round; the variants take turns within each round (reversed every other round), so a noisy machine slows
them alike. Each step is
timed from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, unscale/check, optimizer
step); the first ``--warmup`` steps of every round are dropped. ``--model resnet`` trains ``demos.ResNet`` on the
digits (batch 512 of 16x16 images) instead. The table reports median step time, the ratio
to fp32 and to the variant it is compared with (both measured in this run), and model-state bytes per parameter (parameters,
gradients, FP32 masters and optimizer state, counted once per storage at the end of a step).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_mp import GradientRangeMonitor, LossScaleMonitor, MixedPrecisionPlugin
from lightning_mp.monitors.activation_range import ActivationRangeMonitor
from lightning_mp.demos import GPT, DigitsDataModule, ResNet, StdlibTextDataModule
from lightning_mp.policy.policy import NORM_MODULES, RECURRENT_MODULES
from lightning_mp.gemm.emulation import cpu_capability, gemm_support


class StepTimer(Callback):
    """Wall time of each training step; synchronizes CUDA so queued kernels are counted in their step.

    ``clock=time.process_time`` counts this process's CPU time instead: on a CPU shared with other jobs, wall time
    measures the neighbours as much as the step, CPU time (with ``--threads 1``, so no thread spins waiting for
    another) only the step's own work."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.times: list[float] = []
        self.state_bytes = 0
        self.num_params = 0
        self._t0 = 0.0

    def _sync(self, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync(pl_module)
        self._t0 = self.clock()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._sync(pl_module)
        self.times.append(self.clock() - self._t0)
        self.state_bytes, self.num_params = model_state_bytes(pl_module, trainer.optimizers)


def model_state_bytes(module: torch.nn.Module, optimizers) -> tuple[int, int]:
    """Bytes of every distinct storage behind parameters, gradients, optimizer params and optimizer state."""
    seen: dict[int, int] = {}

    def add(t):
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for p in module.parameters():
        add(p)
        add(p.grad)
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                add(p)
                add(p.grad)
        for state in opt.state.values():
            for v in state.values():
                add(v)
    num_params = sum(p.numel() for p in module.parameters())
    return sum(seen.values()), num_params


@dataclass
class Variant:
    name: str
    plugin: Callable[[], object] | None
    callbacks: Callable[[], list] = list
    timer_times: list[float] = field(default_factory=list)
    bytes_per_param: float = 0.0


def variants(device: str, model: str = "gpt") -> list[Variant]:
    # a BatchNorm with 16-bit weights needs batch_norm in FP32 beside its FP32 statistics (the plugin refuses it
    # otherwise): the ResNet's "empty" policy keeps that one op
    empty_ops = ("batch_norm",) if model == "resnet" else ()
    return [
        Variant("plain fp32 (no plugin)", None),
        Variant("native bf16-mixed", lambda: MixedPrecision("bf16-mixed", device)),
        Variant("lightning_mp bf16", lambda: MixedPrecisionPlugin("bf16")),
        Variant("native 16-mixed", lambda: MixedPrecision("16-mixed", device)),
        Variant("lightning_mp fp16", lambda: MixedPrecisionPlugin("fp16")),
        # both GEMM paths of each format, whatever gemm="auto" picks on this machine (printed in the header)
        Variant("lightning_mp fp16, native GEMMs", lambda: MixedPrecisionPlugin("fp16", gemm="native")),
        Variant("lightning_mp fp16, emulated GEMMs", lambda: MixedPrecisionPlugin("fp16", gemm="emulated")),
        Variant("lightning_mp bf16, native GEMMs", lambda: MixedPrecisionPlugin("bf16", gemm="native")),
        Variant("lightning_mp bf16, emulated GEMMs", lambda: MixedPrecisionPlugin("bf16", gemm="emulated")),
        Variant("lightning_mp bf16, check_finite=False", lambda: MixedPrecisionPlugin("bf16", check_finite=False)),
        Variant("lightning_mp bf16, empty FP32 policy",
                lambda: MixedPrecisionPlugin("bf16", fp32_ops=empty_ops, fp32_modules=())),
        Variant(
            "lightning_mp bf16, 16-bit embeddings",
            lambda: MixedPrecisionPlugin("bf16", fp32_modules=NORM_MODULES + RECURRENT_MODULES),
        ),
        # monitor costs, against the plain fp16 plugin (the scale moves there): logging every step is the worst
        # case for LossScaleMonitor; GradientRangeMonitor at every_n_steps=1 costs its sampled-step price on
        # every step, so its cost at the default interval of 50 is that excess divided by 50
        Variant("lightning_mp fp16 + LossScaleMonitor", lambda: MixedPrecisionPlugin("fp16"),
                callbacks=lambda: [LossScaleMonitor(logging_interval=1)]),
        Variant("lightning_mp fp16 + GradientRangeMonitor(1)", lambda: MixedPrecisionPlugin("fp16"),
                callbacks=lambda: [GradientRangeMonitor(every_n_steps=1)]),
        # the overflow locator is on by default: the plain rows above include it, these rows turn it off
        Variant("lightning_mp bf16, no overflow locator", lambda: MixedPrecisionPlugin("bf16", locate_overflows=False)),
        Variant("lightning_mp fp16, no overflow locator", lambda: MixedPrecisionPlugin("fp16", locate_overflows=False)),
        # ActivationRangeMonitor at every_n_steps=1 pays its sampled-step price (hooks, counting, one sync, the
        # picture) on every step; at the default interval of 50 that excess is divided by 50
        Variant("lightning_mp fp16 + ActivationRangeMonitor(1)", lambda: MixedPrecisionPlugin("fp16"),
                callbacks=lambda: [ActivationRangeMonitor(every_n_steps=1)]),
        Variant("lightning_mp fp16 + ActivationRangeMonitor(1), no image", lambda: MixedPrecisionPlugin("fp16"),
                callbacks=lambda: [ActivationRangeMonitor(every_n_steps=1, log_image=False)]),
    ]


# (what, numerator, denominator): every ratio is two medians measured in this run
COMPARISONS = [
    ("ours / native, bf16 (target <= 1.00)", "lightning_mp bf16", "native bf16-mixed"),
    ("ours / native, fp16 (target <= 1.00)", "lightning_mp fp16", "native 16-mixed"),
    ("lightning_mp fp16 / plain fp32 (target <= 1.30 where fp16 is not native)", "lightning_mp fp16",
     "plain fp32 (no plugin)"),
    ("lightning_mp bf16 / plain fp32 (target <= 1.30 where bf16 is not native)", "lightning_mp bf16",
     "plain fp32 (no plugin)"),
    ("emulated / native GEMMs, fp16", "lightning_mp fp16, emulated GEMMs", "lightning_mp fp16, native GEMMs"),
    ("emulated / native GEMMs, bf16", "lightning_mp bf16, emulated GEMMs", "lightning_mp bf16, native GEMMs"),
    ("guard on (default) / check_finite=False, bf16", "lightning_mp bf16", "lightning_mp bf16, check_finite=False"),
    ("default FP32 policy / empty policy, bf16 (target <= 1.03)", "lightning_mp bf16",
     "lightning_mp bf16, empty FP32 policy"),
    ("FP32 embeddings (default) / 16-bit embeddings, bf16", "lightning_mp bf16", "lightning_mp bf16, 16-bit embeddings"),
    ("LossScaleMonitor every step / none, fp16 (target <= 1.01)", "lightning_mp fp16 + LossScaleMonitor",
     "lightning_mp fp16"),
    ("GradientRangeMonitor every step / none, fp16", "lightning_mp fp16 + GradientRangeMonitor(1)", "lightning_mp fp16"),
    ("overflow locator on (default) / off, bf16 (target <= 1.02)", "lightning_mp bf16",
     "lightning_mp bf16, no overflow locator"),
    ("overflow locator on (default) / off, fp16 (target <= 1.02)", "lightning_mp fp16",
     "lightning_mp fp16, no overflow locator"),
    ("ActivationRangeMonitor every step / none, fp16", "lightning_mp fp16 + ActivationRangeMonitor(1)",
     "lightning_mp fp16"),
    ("ActivationRangeMonitor every step, no image / none, fp16",
     "lightning_mp fp16 + ActivationRangeMonitor(1), no image", "lightning_mp fp16"),
]


def run_round(variant: Variant, datamodule, args, accelerator: str) -> None:
    L.seed_everything(0, verbose=False)
    if args.model == "resnet":
        model = ResNet()
    else:
        model = GPT(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size)
    timer = StepTimer(time.process_time if args.clock == "cpu" else time.perf_counter)
    plugins = [variant.plugin()] if variant.plugin else []
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=args.steps,
        plugins=plugins,
        callbacks=[*variant.callbacks(), timer],  # timer last: its batch end sees the monitors' work
        # every variant logs to TensorBoard (the monitors need a logger), so logging costs the same for all
        logger=TensorBoardLogger(args.log_dir, name="benchmark"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule)
    variant.timer_times.extend(timer.times[args.warmup :])
    variant.bytes_per_param = timer.state_bytes / max(timer.num_params, 1)


def main(argv=None) -> list[Variant]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of interleaved runs")
    parser.add_argument("--steps", type=int, default=8, help="training steps per variant per round")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of every round")
    parser.add_argument("--model", choices=("gpt", "resnet"), default="gpt", help="what to train (default gpt)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 16 sequences (gpt), 512 images (resnet)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--only", nargs="*", help="run only variants whose name contains one of these words")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time steps by wall clock (default) or by this process's CPU time (a shared machine)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    args.log_dir = tempfile.mkdtemp(prefix="lightning_mp_bench_")
    if args.batch_size is None:
        args.batch_size = 512 if args.model == "resnet" else 16
    for name in ("rounds", "steps", "batch_size", "block_size", "n_layer", "n_embd", "n_head"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)!r} must be >= 1")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup={args.warmup!r} must be in [0, --steps)")

    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads={args.threads!r} must be >= 1")
        torch.set_num_threads(args.threads)
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    device = accelerator
    chosen = variants(device, args.model)
    if args.only:
        matched = {v.name for v in chosen if any(w in v.name for w in args.only)}
        # both sides of every comparison a matched variant is in (e.g. "no overflow locator" -> its default)
        wanted = matched | {"plain fp32 (no plugin)"}
        for _, num, den in COMPARISONS:
            if num in matched or den in matched:
                wanted |= {num, den}
        chosen = [v for v in chosen if v.name in wanted]
    if args.model == "resnet":
        datamodule = DigitsDataModule(batch_size=args.batch_size)
    else:
        datamodule = StdlibTextDataModule(block_size=args.block_size, batch_size=args.batch_size, max_bytes=2**21)
    print(f"device: {device} ({torch.cuda.get_device_name() if device == 'cuda' else f'{torch.get_num_threads()} threads'})"
          f", torch {torch.__version__}, lightning {L.__version__}")
    # 16-bit speed on a CPU depends on its vector unit: every table says which one it was measured on
    print(f"CPU capability: {cpu_capability()}; gemm='auto' on {device}: "
          + "; ".join(f"{n}: {'native' if s.native else 'emulated'} ({s.reason})"
                      for n, s in (("bf16", gemm_support(device, torch.bfloat16)),
                                   ("fp16", gemm_support(device, torch.float16)))))
    what = (f"ResNet-14 on 16x16 digits, batch {args.batch_size}" if args.model == "resnet"
            else f"GPT {args.n_layer}x{args.n_embd}, batch {args.batch_size}x{args.block_size}")  # fmt: skip
    print(f"{what}; "
          f"{args.rounds} rounds x {args.steps} steps, {args.warmup} warm-up steps dropped per round, "
          f"{'CPU' if args.clock == 'cpu' else 'wall'} time\n")
    for r in range(args.rounds):
        # odd rounds run the variants in reverse: a variant's place in the round (what ran before it, the heap it
        # inherits) moved one ResNet ratio by 5-10% when the order was fixed
        for v in chosen if r % 2 == 0 else chosen[::-1]:
            run_round(v, datamodule, args, accelerator)
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    median = {v.name: statistics.median(v.timer_times) for v in chosen}
    fp32 = median.get("plain fp32 (no plugin)")
    print()
    print(f"CPU capability {cpu_capability()}, {device}\n")
    print(f"| {'variant':44s} | median step (ms) | speed-up vs fp32 | model-state bytes/param |")
    print(f"|{'-' * 46}|-----------------:|-----------------:|------------------------:|")
    for v in chosen:
        speedup = f"{fp32 / median[v.name]:.2f}x" if fp32 else ""
        print(f"| {v.name:44s} | {median[v.name] * 1e3:16.1f} | {speedup:>16s} | {v.bytes_per_param:23.1f} |")
    print()
    for what, num, den in COMPARISONS:
        if num in median and den in median:
            ratio = median[num] / median[den]
            print(f"RATIO {what}: {ratio:.3f}")
            for monitor in ("GradientRangeMonitor", "ActivationRangeMonitor"):
                if monitor in num:
                    print(f"  -> {monitor} at its default every_n_steps=50: {(ratio - 1) / 50:+.2%} per step")
    return chosen


if __name__ == "__main__":
    main()
