"""Run by tests/test_fabric_distributed.py, once per rank (the test sets the ranks' environment, as torchrun does):
Fabric loops under ``"ddp"`` or ``ModelParallelStrategy`` (FSDP2, ``fully_shard`` per layer and at the root) on
gloo, each phase with a Fabric of its own in the same processes.

Writes ``rank{r}.pt`` into ``--out``: per phase, the full FP32 weights, the plugin's counters, the losses, and the
gradient collectives counted inside and outside ``fabric.no_backward_sync``.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402

from lightning_mp.fabric import MixedPrecisionPlugin  # noqa: E402

COUNTS = {"inside": 0, "outside": 0}
INSIDE = [False]


def counting(fn):
    def wrapper(*args, **kwargs):
        COUNTS["inside" if INSIDE[0] else "outside"] += 1
        return fn(*args, **kwargs)

    return wrapper




def mlp(exact=False):
    torch.manual_seed(0)  # every rank builds the same weights (fully_shard shards each rank's own)
    if exact:
        net = nn.Sequential(nn.Linear(4, 1, bias=False))
        with torch.no_grad():
            net[0].weight.copy_(torch.tensor([[1.0, 2.0, -1.0, 0.5]]))
        return net
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def data(exact=False):
    g = torch.Generator().manual_seed(1)
    if exact:  # small integers and dyadic weights: every 16-bit product and sum is exact
        return torch.randint(-2, 3, (64, 4), generator=g).float(), torch.randint(-4, 5, (64, 1), generator=g).float()
    x = torch.randn(512, 8, generator=g)
    return x, torch.tanh(x @ torch.randn(8, 4, generator=g))


def micro_batch(x, y, step, micro, rank, world, size):
    """Rank r's micro-batch ``micro`` of ``step``: consecutive slices, so that the concatenation over (micro, rank)
    of one step is rows [step * 2 * world * size, ...) in the order micro-major."""
    start = ((step * 2 + micro) * world + rank) * size
    return x[start : start + size], y[start : start + size]


def fabric_for(strategy, plugin=None, precision=None):
    if strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = plugin.fsdp_mp_policy() if plugin is not None and plugin.core.format.is_16bit else MixedPrecisionPolicy()

        def parallelize(module, mesh):
            for layer in module.modules():
                if isinstance(layer, (nn.Linear, nn.LayerNorm)):
                    fully_shard(layer, mesh=mesh["data_parallel"], mp_policy=mp)
            fully_shard(module, mesh=mesh["data_parallel"], mp_policy=mp)
            return module

        strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1,
                                         save_distributed_checkpoint=False)
    else:
        strategy = DDPStrategy()
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision,
                      plugins=[plugin] if plugin is not None else None)
    fabric.launch()
    return fabric


def full(state):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def ddp_comm_hook_counter(model):
    """A DDP communication hook that counts the buckets DDP's own reducer all-reduces (master weights: none)."""
    calls = [0]
    inner = getattr(model, "_forward_module", None)
    if isinstance(inner, nn.parallel.DistributedDataParallel):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):
            calls[0] += 1
            return allreduce_hook(state, bucket)

        inner.register_comm_hook(None, hook)
    return calls


def train(args, name, plugin=None, precision=None, poison=False, exact=False, steps=None, load=None, save=None,
          lr=1e-2, fabric=None):
    fabric = fabric or fabric_for(args.strategy, plugin, precision)
    rank, world = fabric.global_rank, fabric.world_size
    net = mlp(exact)
    if args.strategy == "fsdp2":
        model = fabric.setup_module(net)
        opt_cls = torch.optim.SGD if exact else torch.optim.AdamW
        optimizer = fabric.setup_optimizers(opt_cls(model.parameters(), lr=2.0**-6 if exact else lr))
    else:
        opt_cls = torch.optim.SGD if exact else torch.optim.AdamW
        model, optimizer = fabric.setup(net, opt_cls(net.parameters(), lr=2.0**-6 if exact else lr))
    ddp_calls = ddp_comm_hook_counter(model)
    loaded = {}
    start = 0
    if load:
        state = {"model": model, "optimizer": optimizer, "step": 0}
        if plugin is not None:
            state["precision"] = plugin
        fabric.load(load, state)
        start = state["step"]
        loaded = {"state": full(model.state_dict()), "scale": plugin.loss_scale if plugin else None,
                  "skipped": plugin.skipped_steps if plugin else None}
    x, y = data(exact)
    size = 4 if exact else 8
    losses = []
    COUNTS.update(inside=0, outside=0)
    for step in range(start, start + (steps or args.steps)):
        total = 0.0
        for micro in range(2):
            xb, yb = micro_batch(x, y, step, micro, rank, world, size)
            INSIDE[0] = micro == 0 and step > start  # after the first forward's one-time set-up (its GEMM verdict agreed)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = nn.functional.mse_loss(model(xb.to(fabric.device)).float(), yb) / 2
                if poison and rank == 1 and step == 2 and micro == 0:
                    loss = loss * float("inf")
                fabric.backward(loss)
            INSIDE[0] = False
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    if save:
        state = {"model": model, "optimizer": optimizer, "step": start + (steps or args.steps)}
        if plugin is not None:
            state["precision"] = plugin
        fabric.save(save, state)
    result = {
        "state": full(model.state_dict()),
        "dtypes": {k: v.dtype for k, v in model.state_dict().items()},
        "losses": losses,
        "counts": dict(COUNTS),
        "ddp_buckets": ddp_calls[0],
        "global_hooks": len(torch.nn.modules.module._global_forward_pre_hooks),  # the first-call hook, gone
        "loaded": loaded,
        "opt_state": full({f"{i}.{k}": v for i, s in enumerate(optimizer.state_dict()["state"].values())
                           for k, v in s.items() if torch.is_tensor(v)}),
    }
    if plugin is not None:
        result.update(scale=plugin.loss_scale, skipped=plugin.skipped_steps, steps=plugin.training_steps)
    return name, result


def spawned(fabric, args):
    """Run in each process that Fabric's "ddp_spawn" started: the plugin arrived pickled with the Fabric."""
    torch.set_num_threads(1)
    dist.all_reduce = counting(dist.all_reduce)
    _, result = train(args, "poison", fabric._precision, poison=True, fabric=fabric)
    torch.save({"poison": result}, os.path.join(args.out, f"rank{fabric.global_rank}.pt"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp2"])
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--phases", default="poison,clean,fp32,exact")
    parser.add_argument("--load", default="", help="a checkpoint one process saved: resumed on 2 ranks")
    parser.add_argument("--spawn", action="store_true", help="Fabric's ddp_spawn starts the ranks (run once)")
    args = parser.parse_args()
    if args.spawn:
        plugin = MixedPrecisionPlugin(args.precision, init_scale=2.0**8)
        L.Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn", plugins=[plugin]).launch(spawned, args)
        return
    torch.set_num_threads(1)
    # the gradient collectives (ours, and DDP's through the counting comm hook) are looked up on torch.distributed
    # at each call; FSDP2's reduce-scatter is not counted (its own no_sync is Fabric's and torch's)
    dist.all_reduce = counting(dist.all_reduce)
    results = {}
    plugin = lambda **kw: MixedPrecisionPlugin(args.precision, init_scale=2.0**8, **kw)  # noqa: E731
    for phase in args.phases.split(","):
        if phase == "poison":  # a forced overflow on rank 1 at step 2; the checkpoint that 1 process resumes
            k, v = train(args, phase, plugin(), poison=True, save=os.path.join(args.out, "ckpt.pt"))
        elif phase == "clean":
            k, v = train(args, phase, plugin())
        elif phase == "fp32":
            k, v = train(args, phase, precision="32-true")
        elif phase == "exact":
            k, v = train(args, phase, plugin(), exact=True, steps=1)
        elif phase == "autocast":
            k, v = train(args, phase, plugin(master_weights=False), poison=True)
        elif phase == "compensated":
            k, v = train(args, phase, plugin(master_weights="compensated"), poison=True)
        elif phase == "resume":
            k, v = train(args, phase, plugin(), load=args.load, steps=2)
        else:
            raise ValueError(f"--phases: unknown phase {phase!r}")
        results[k] = v
    torch.save(results, os.path.join(args.out, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()  # gloo's threads stop before the interpreter does


if __name__ == "__main__":
    main()
