"""Fabric loop CPU time: lightning_mp.fabric.MixedPrecisionPlugin against Fabric's own mixed precision.

The same loop for every row (forward, FP32 loss, fabric.backward, fabric.clip_gradients, optimizer.step, zero_grad),
in three settings (``--settings``):

* ``one``: one process. The demo GPT under Fabric's 32-true, bf16-mixed and 16-mixed and the plugin in bf16 and fp16
  (emulated and native GEMMs); a tiny MLP (32 -> 64 -> 8 with LayerNorm, batch 64) under bf16-mixed and the plugin.
* ``ddp``: 2 gloo ranks, ``strategy="ddp"``: the plugin in bf16 against bf16-mixed, both models.
* ``fsdp2``: 2 gloo ranks, ``ModelParallelStrategy`` with ``fully_shard`` per block and at the root (as litgpt does):
  the plugin in bf16 (``mp_policy=plugin.fsdp_mp_policy()``) against Fabric's 32-true with FSDP2's own
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, both models.

Measured: the CPU time of the training thread (``time.thread_time``), so other jobs on a shared machine and gloo's
own threads are not counted; 1 torch thread per process. The rows of a setting live in the same processes and are
interleaved: each round runs a few steps of every row in turn, in alternating order, each row's after one untimed step
and with the other rows' plugins' kernels released (:func:`alone`: held, they would slow Fabric's own rows down).
Reported: medians (on 2 ranks, over both ranks' steps) and the bars: ours bf16 / Fabric's bf16 <= 1.05 on the demo
GPT, <= 1.10 on the tiny MLP.

    python benchmarks/fabric_benchmark.py --rounds 8 --steps 4
    python benchmarks/fabric_benchmark.py --settings one --models mlp --ablation --rounds 20 --steps 20
"""

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import harness
import lightning as L
import torch
from lightning.fabric.plugins.precision import MixedPrecision
from torch import nn

from lightning_mp.demos import GPT, StdlibTextDataModule
from lightning_mp.fabric import MixedPrecisionPlugin
from lightning_mp.gemm.emulation import cpu_capability

OURS, THEIRS = "lightning_mp bf16", "Fabric bf16"  # the rows the bars compare
BARS = {"gpt": 1.05, "mlp": 1.10}
ONE_PROCESS_GPT = {
    "fp32 (Fabric 32-true)": lambda: None,
    OURS: lambda: MixedPrecisionPlugin("bf16"),
    THEIRS: lambda: MixedPrecision("bf16-mixed", "cpu"),
    "lightning_mp fp16": lambda: MixedPrecisionPlugin("fp16"),  # gemm="auto": emulated where fp16 is not native
    "lightning_mp fp16, gemm=native": lambda: MixedPrecisionPlugin("fp16", gemm="native"),
    # passed as a plugin: Fabric(precision="16-mixed") on a CPU silently becomes bf16-mixed
    "Fabric 16-mixed": lambda: MixedPrecision("16-mixed", "cpu"),
}
PAIR = {OURS: lambda: MixedPrecisionPlugin("bf16"), THEIRS: lambda: MixedPrecision("bf16-mixed", "cpu")}
# --ablation (one process, tiny MLP): what each default feature costs, each switched off alone, then all of them
_OFF = {"fp32_ops": [], "check_finite": False, "master_weights": False}
ABLATION = {
    **{f"{OURS}, {k}={v!r}": partial(MixedPrecisionPlugin, "bf16", **{k: v}) for k, v in _OFF.items()},
    f"{OURS}, all three off, no FP32 modules, no locator": partial(
        MixedPrecisionPlugin, "bf16", fp32_modules=[], locate_overflows=False, **_OFF),
}


def make_model(which, args):
    torch.manual_seed(0)  # every rank builds the same weights
    if which == "gpt":
        return GPT(block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8))


def make_batches(which, args, n, rank=0):
    if which == "gpt":
        data = StdlibTextDataModule(block_size=args.block_size, batch_size=args.batch_size, max_bytes=2**20, seed=rank)
        loader = iter(data.train_dataloader())
        return [next(loader) for _ in range(n)]
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g)) for _ in range(n)]


def parallelize(model, mesh, mp_policy):
    """FSDP2 as litgpt shards: each transformer block, then the root (the MLP: the root only)."""
    from torch.distributed.fsdp import fully_shard

    for block in getattr(model, "blocks", ()):
        fully_shard(block, mesh=mesh["data_parallel"], mp_policy=mp_policy)
    return fully_shard(model, mesh=mesh["data_parallel"], mp_policy=mp_policy)


def build(which, row, setting, args):
    """A Fabric, the model set up under it, and its optimizer, for one row of one setting."""
    plugin = {**PAIR, **ABLATION, **(ONE_PROCESS_GPT if setting == "one" else {})}[row]()
    strategy, devices = "auto", 1
    if setting == "ddp":
        strategy, devices = "ddp", 2
    elif setting == "fsdp2":
        from lightning.fabric.strategies import ModelParallelStrategy
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if row == OURS:
            mp = plugin.fsdp_mp_policy()
        else:  # Fabric's FSDP2 with its own bf16 compute (32-true: no autocast), gradients reduced in FP32
            plugin, mp = None, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        strategy = ModelParallelStrategy(parallelize_fn=partial(parallelize, mp_policy=mp), data_parallel_size=2,
                                         tensor_parallel_size=1)
        devices = 2
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy,
                      plugins=[plugin] if plugin is not None else None)
    fabric.launch()  # on 2 ranks: the second Fabric of a process joins the process group the first one started
    model = fabric.setup_module(make_model(which, args))  # FSDP2: the optimizer is made over the shards
    params = model.configure_optimizers() if which == "gpt" else torch.optim.AdamW(model.parameters(), lr=1e-3)
    return fabric, model, fabric.setup_optimizers(params)


def run_steps(fabric, model, optimizer, batches, which):
    times = []
    for x, y in batches:
        start = time.thread_time()
        out = model(x)
        loss = GPT.loss_fn(out, y) if which == "gpt" else nn.functional.mse_loss(out.float(), y)
        fabric.backward(loss)
        # error_if_nonfinite=False: Fabric's own 16-mixed would raise on its first (overflowing) steps
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.thread_time() - start)  # CPU kernels are synchronous: no device sync needed
    return times


def measure(setting, args):
    """{model: {row: [seconds per step]}}, the rows of each model interleaved in this process."""
    models = ("gpt", "mlp") if args.models == "both" else (args.models,)
    result = {}
    for which in models:
        rows = ONE_PROCESS_GPT if setting == "one" and which == "gpt" else PAIR
        if setting == "one" and which == "mlp" and args.ablation:
            rows = {**PAIR, **ABLATION}
        runs = {row: build(which, row, setting, args) for row in rows}
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0  # each rank its own data
        batches = make_batches(which, args, args.warmup + args.steps, rank)
        for run in runs.values():
            run_steps(*run, batches[: args.warmup], which)
        times = {row: [] for row in rows}
        for round_ in range(args.rounds):
            for row in list(rows) if round_ % 2 == 0 else list(rows)[::-1]:
                alone(runs, row)
                run_steps(*runs[row], batches[:1], which)  # untimed: registers the row's kernels again
                times[row] += run_steps(*runs[row], batches[args.warmup :], which)
        result[which] = times
    return result


def alone(runs, row):
    """The other rows' plugins release the FP32 policy's kernels: registered (even switched off) they put a Python
    call in the path of every listed op under autocast in the process, Fabric's own rows' included (a tiny MLP's
    step under ``bf16-mixed`` measured 6% slower beside a plugin that held them)."""
    for other, (fabric, _, _) in runs.items():
        if other != row and isinstance(fabric.strategy.precision, MixedPrecisionPlugin):
            fabric.strategy.precision.release_kernels()


def report(setting, times):
    label = {"one": "one process", "ddp": "2 DDP ranks", "fsdp2": "2 FSDP2 ranks"}[setting]
    for which, rows in times.items():
        print(f"\n{label}, {'demo GPT' if which == 'gpt' else 'tiny MLP'}: CPU ms per step of the training thread")
        print("| row | median | min |\n|---|---:|---:|")
        for row, ts in rows.items():
            print(f"| {row} | {statistics.median(ts) * 1e3:.2f} | {min(ts) * 1e3:.2f} |")
        base = statistics.median(rows[THEIRS])
        for row in (r for r in rows if r in ABLATION):
            print(f"{row} / {THEIRS}: {statistics.median(rows[row]) / base:.3f}")
        ratio = statistics.median(rows[OURS]) / base
        verdict = "holds" if ratio <= BARS[which] else "MISSED"
        print(f"{OURS} / {THEIRS}: {ratio:.3f} (bar <= {BARS[which]:.2f}: {verdict})")


def add_arguments(parser):
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per row per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per row before the first round")
    parser.add_argument("--models", choices=("gpt", "mlp", "both"), default="both")
    parser.add_argument("--ablation", action="store_true",
                        help="one process, tiny MLP: also the plugin with each default feature switched off")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=256)


def worker() -> None:
    """One rank of the ``ddp`` or ``fsdp2`` setting (harness.launch_ranks starts rank 0, Lightning the other)."""
    parser = harness.worker_arguments(__doc__)
    parser.add_argument("--worker", choices=("ddp", "fsdp2"), required=True)
    add_arguments(parser)
    args = harness.start_worker(parser)
    times = measure(args.worker, args)
    harness.end_worker(args.out, torch.distributed.get_rank(), times)


def main() -> None:
    if "--worker" in sys.argv:
        return worker()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="one,ddp,fsdp2", help="comma-separated: one, ddp, fsdp2")
    add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"CPU capability: {cpu_capability()}; torch {torch.__version__}; 1 thread per process; demo GPT "
          f"n_layer={args.n_layer} n_embd={args.n_embd} block={args.block_size} batch={args.batch_size}; tiny MLP "
          f"32-64-8, batch 64; {args.rounds} rounds x {args.steps} steps per row, interleaved")  # fmt: skip
    for setting in args.settings.split(","):
        if setting == "one":
            times = measure("one", args)
        else:
            passed = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in vars(args).items()
                      if k != "settings" and v is not False]  # a flag: named when set
            with tempfile.TemporaryDirectory() as out:
                ranks = harness.launch_ranks(Path(__file__), Path(out), "--worker", setting, *passed, timeout=1800)
            times = {which: {row: ranks[0][which][row] + ranks[1][which][row] for row in ranks[0][which]}
                     for which in ranks[0]}  # fmt: skip
        report(setting, times)


if __name__ == "__main__":
    main()
