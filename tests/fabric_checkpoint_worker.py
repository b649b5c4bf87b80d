"""Run by tests/test_fabric_checkpoints_ranks_integration.py, once per rank (the test sets the ranks' environment,
as torchrun does), on gloo.

``--mode save``: under ``ModelParallelStrategy`` (FSDP2, ``fully_shard`` per Linear and LayerNorm and at the root,
Fabric's default sharded checkpoint), per precision: 3 steps, ``fabric.save`` to ``OUT/<phase>-A``, one step more.
``--mode resume``: the same set-up, ``fabric.load`` of ``--load``/``<phase>-A`` (or ``-B``), then ``fabric.save`` to
``OUT/<phase>-B`` if ``--save``, then one step. ``--mode closures``: LBFGS and SAM under Fabric's ``"ddp"``.

Writes ``rank{r}.pt`` into ``--out``: per phase, the full FP32 weights and optimizer state, the plugin's counters.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.strategies import ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict  # noqa: E402

from benchmarks.harness import end_worker, start_worker, worker_arguments  # noqa: E402
from lightning_mp.fabric import MixedPrecisionPlugin, load  # noqa: E402
from tests.fabric_ddp_worker import data, full, micro_batch, mlp  # noqa: E402
from tests.test_fabric_closures import SAM  # noqa: E402

STEPS = 3  # before the save; fp16: rank (world - 1) overflows at step 1, so the scale is 2**7, not the initial 2**8
PHASES = {  # name: the plugin's arguments
    "bf16": dict(precision="bf16"),
    "fp16": dict(precision="fp16", init_scale=2.0**8),
    "compensated": dict(precision="bf16", master_weights="compensated"),
}


def sharded_fabric(plugin, devices):
    from torch.distributed.fsdp import fully_shard

    def parallelize(module, mesh):
        for layer in module.modules():
            if isinstance(layer, (nn.Linear, nn.LayerNorm)):
                fully_shard(layer, mesh=mesh["data_parallel"], mp_policy=plugin.fsdp_mp_policy())
        fully_shard(module, mesh=mesh["data_parallel"], mp_policy=plugin.fsdp_mp_policy())
        return module

    # save_distributed_checkpoint=True is the default: fabric.save writes a directory of DCP shards
    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=devices, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy, plugins=[plugin])
    fabric.launch()
    return fabric


def full_optimizer_state(model, optimizer):
    """The optimizer's state keyed by parameter name, whole tensors: comparable across world sizes."""
    state = get_optimizer_state_dict(model.module, optimizer.optimizer, options=StateDictOptions(full_state_dict=True))
    return {f"{name}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for name, s in state["state"].items() for k, v in s.items() if torch.is_tensor(v)}


def snapshot(model, optimizer, plugin):
    return {"state": full(model.state_dict()), "opt": full_optimizer_state(model, optimizer),
            "scale": plugin.loss_scale, "skipped": plugin.skipped_steps, "steps": plugin.training_steps,
            "param_dtypes": {p.dtype for p in model.parameters()}}


def train_step(fabric, model, optimizer, step, poison=False):
    """One optimizer step of 2 micro-batches; the global batch of a step is the same 32 rows on any world size."""
    x, y = data()
    rank, world = fabric.global_rank, fabric.world_size
    for micro in range(2):
        xb, yb = micro_batch(x, y, step, micro, rank, world, 16 // world)
        with fabric.no_backward_sync(model, enabled=micro == 0):
            loss = nn.functional.mse_loss(model(xb), yb) / 2
            if poison and rank == world - 1 and micro == 0:
                loss = loss * float("inf")
            fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def checkpoint_phase(args, phase):
    phase, _, how = phase.partition("+")  # "fp16+plain": resumed with Fabric's own fabric.load
    plugin = MixedPrecisionPlugin(**PHASES[phase])
    fabric = sharded_fabric(plugin, args.devices)
    model = fabric.setup_module(mlp())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    plugin.setup_optimizers(optimizer)  # lean bf16: Adam's moments stay FP32 through fabric.load
    result = {}
    state = {"model": model, "optimizer": optimizer, "precision": plugin, "step": 0}
    if args.mode == "save":
        for step in range(STEPS):
            train_step(fabric, model, optimizer, step, poison=phase == "fp16" and step == 1)
        state["step"] = STEPS
        fabric.save(os.path.join(args.out, f"{phase}-A"), state)
        result["saved"] = snapshot(model, optimizer, plugin)
    else:
        path = os.path.join(args.load, f"{phase}-{args.suffix}")
        if how == "plain":  # Fabric's own load: the plugin's entry comes back as the saved dict, not loaded
            fabric.load(path, state)
            result["precision_entry"] = type(state["precision"]).__name__
            state["precision"] = plugin
        else:
            load(fabric, path, state)
        result["loaded"] = snapshot(model, optimizer, plugin)
        if args.save and not how:
            fabric.save(os.path.join(args.out, f"{phase}-B"), state)
    train_step(fabric, model, optimizer, state["step"])  # the run goes on
    result["next"] = snapshot(model, optimizer, plugin)
    return result


def closure_phase(args, phase):
    """LBFGS or SAM under Fabric's "ddp": each rank's 16 of the 32 rows; DDP's average is the full batch's gradient."""
    optimizer_name, precision = phase.split("-", 1)
    plugin = None  # Fabric's own precision ("bf16-mixed", "32-true")
    if precision in ("bf16", "fp16"):  # fp16: a static scale (LBFGS with a dynamic one is refused)
        plugin = MixedPrecisionPlugin(precision, **({"loss_scale": 2.0**8} if precision == "fp16" else {}))
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy="ddp", plugins=[plugin] if plugin else None,
                      precision=None if plugin else precision)
    fabric.launch()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    if optimizer_name == "lbfgs":
        opt = torch.optim.LBFGS(module.parameters(), lr=0.5, max_iter=5)
    else:
        opt = SAM(module.parameters(), lr=0.1, rho=0.05)
    model, opt = fabric.setup(module, opt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    y = x.sum(dim=1, keepdim=True) * 0.3
    rows = slice(fabric.global_rank * 16, (fabric.global_rank + 1) * 16)
    seen = {"calls": [], "weight_dtypes": set(), "losses": []}
    module[0].register_forward_hook(lambda m, a, o: seen["weight_dtypes"].add(o.dtype))
    for _ in range(4):
        calls = [0]

        def closure():
            calls[0] += 1
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x[rows]), y[rows])
            fabric.backward(loss)
            return loss

        loss = opt.step(closure)
        seen["calls"].append(calls[0])
        seen["losses"].append(float(loss.detach()))
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"weights": weights, "dtypes": {p.dtype for p in model.parameters()}, **seen,
            "skipped": plugin.skipped_steps if plugin else None}


def main():
    parser = worker_arguments(__doc__)
    parser.add_argument("--mode", choices=["save", "resume", "closures"], required=True)
    parser.add_argument("--phases", default="bf16,fp16,compensated")
    parser.add_argument("--load", default="", help="the folder holding <phase>-A or <phase>-B")
    parser.add_argument("--suffix", default="A", help="A: the 2-rank save; B: the 1-process save")
    parser.add_argument("--save", action="store_true", help="resume: save <phase>-B right after the load")
    args = start_worker(parser)
    results = {}
    for phase in args.phases.split(","):
        run = closure_phase if args.mode == "closures" else checkpoint_phase
        try:
            results[phase] = run(args, phase)
        except Exception as error:  # noqa: BLE001 (reported to the test, which names the phase)
            results[phase] = {"error": f"{type(error).__name__}: {error}"}
    torch.distributed.barrier()  # no rank leaves while another is in a collective (DDP's gloo: a hang at exit)
    end_worker(args.out, torch.distributed.get_rank(), results)


if __name__ == "__main__":
    main()
