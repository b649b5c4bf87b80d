"""Run by tests/test_ladder_distributed_integration.py, once per rank (the test sets the ranks' environment, as
torchrun does, so neither Fabric nor the Trainer launches anything): the precision ``schedule`` on gloo CPU ranks,
each phase with a Fabric or a Trainer of its own in the same two processes.

Phases (``--phases``, comma-separated), ``<front end>-<strategy>-<from>-<to>``:

* ``fabric-ddp-fp16-bf16``, ``trainer-ddp-fp16-bf16``: the switch at step 3, a forced overflow on rank 1 only at
  step 1 (skipped on both: the step counts stay equal, so the switch stays aligned); a Fabric phase
  with ``-resume2`` (``-resume4``): saved after step 2 (4), loaded by a new Fabric and plugin, run on to the end;
* ``fabric-fsdp2-fp8-bf16``, ``trainer-fsdp2-fp8-bf16``, ``trainer-fsdp2-lean-masters`` (the Trainer's switch at
  0.5 of ``max_steps``: step 3): ``fully_shard`` per Linear and at the root, ``mp_policy=plugin.fsdp_mp_policy()``
  (lean bf16 under Fabric's ModelParallelStrategy is refused at the first forward, schedule or not);
* ``<front end>-ddp-bf16-fp32``, ``-fp32-bf16``, ``-bf16-lean``, ``-lean-masters``: into and out of master weights
  under DDP (``lean``: ``master_weights='compensated'``; ``masters``: ``master_weights=True``);
  ``trainer-ddp-bf16-fp32-accumulate2``: 2 micro-batches a step (the switch falls inside Lightning's ``no_sync``);
* ``fabric-fsdp2-bf16-fp16``, ``trainer-fsdp2-bf16-fp16``: refused (FSDP2 gathers in one dtype for the fit); the
  message is recorded.

Writes ``rank{r}.pt`` into ``--out``: per phase, per step the format the plugin computed it in (``plugin.format``),
the first Linear's output dtype, whether its forward was torchao's FP8 one, the masters' kind and the scale; the
full FP32 weights at the end, the plugin's counters, or the error's message.
"""

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

SWITCH, STEPS, BATCH = 3, 6, 8


def plugin_for(module, first, then, when=SWITCH):
    """``module``: lightning_mp or lightning_mp.fabric; ``first``/``then``: a precision, or ``lean``/``masters``."""
    kwargs = {"init_scale": 2.0**8}
    if first == "lean":
        first, kwargs["master_weights"] = "bf16", "compensated"
    if first == "fp8":
        kwargs["fp8_modules"] = [nn.Linear]  # both Linears (the default keeps the output head in bf16)
    entry = {"masters": {"master_weights": True}, "lean": {"master_weights": "compensated"}}.get(then, then)
    return module.MixedPrecisionPlugin(first, schedule={when: entry}, **kwargs)


def mlp():
    torch.manual_seed(0)  # every rank builds the same weights; 16-wide Linears: torchao's FP8 matmul takes them
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * STEPS * BATCH, 16, generator=g)
    return x, torch.tanh(x @ torch.randn(16, 16, generator=g))


def shard(module, mesh, mp):
    from torch.distributed.fsdp import fully_shard

    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(module, mesh=mesh, mp_policy=mp)
    return module


def full(state):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


class Steps:
    """Per step: the plugin's format, the first Linear's output dtype (its forward hook), FP8 forward or not, the
    masters' kind, the loss scale."""

    def __init__(self, plugin, linear):
        self.plugin, self.linear, self.rows, self._dtype = plugin, linear, [], None
        linear.register_forward_hook(lambda m, args, out: setattr(self, "_dtype", out.dtype))

    def record(self, step):
        from lightning_mp.fp8.linears import Fp8Forward

        # after the forward: the FP8 forward is the Linear's own ``forward`` attribute for the fit
        fp8 = isinstance(self.linear.__dict__.get("forward"), Fp8Forward)
        p = self.plugin
        self.rows.append((step, p.format.name, str(self._dtype), fp8, _masters(p), p.loss_scale))

    def result(self, model):
        p = self.plugin
        return {"rows": self.rows, "state": full(model.state_dict()), "skipped": p.skipped_steps,
                "scale": p.loss_scale, "scaler": p.scaler is not None, "rung": p.ladder.current,
                "starts": p.ladder.starts, "lean": p.core.lean is not None, "masters_kind": _masters(p)}


def _masters(plugin):
    return "lean" if plugin.core.lean is not None else "fp32" if plugin.core.master_weights else "none"


# ---------------------------------------------------------------------------------------------------- Fabric
def fabric_phase(strategy, first, then, poison, resume_at=None, out=None):
    """``resume_at``: the loop stops after that many steps and saves (model, optimizer, plugin); a new Fabric with a
    new plugin of the same schedule loads the checkpoint and goes on."""
    import lightning_mp.fabric as front

    model, opt, fabric, plugin, record = _fabric_loop(strategy, first, then)
    _fabric_steps(fabric, model, opt, record, range(STEPS if resume_at is None else resume_at), poison)
    if resume_at is not None:
        path = os.path.join(out, f"{strategy}-{first}-{then}-{resume_at}.ckpt")  # FSDP2: a sharded folder
        fabric.save(path, {"model": model, "optimizer": opt, "precision": plugin})
        rows = record.rows
        model, opt, fabric, plugin, record = _fabric_loop(strategy, first, then)
        plugin.setup_optimizers(opt)  # lean bf16's documented resume order: its FP32 state stays FP32
        front.load(fabric, path, {"model": model, "optimizer": opt, "precision": plugin})  # also from a folder
        record.rows = rows
        _fabric_steps(fabric, model, opt, record, range(resume_at, STEPS), poison)
    return record.result(model)


def _fabric_loop(strategy, first, then):
    import lightning_mp.fabric as front
    from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

    plugin = plugin_for(front, first, then)
    if strategy == "fsdp2":
        mp = plugin.fsdp_mp_policy()
        strategy = ModelParallelStrategy(parallelize_fn=lambda m, mesh: shard(m, mesh["data_parallel"], mp),
                                         data_parallel_size=2, tensor_parallel_size=1)
    else:
        strategy = DDPStrategy()
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    net = mlp()
    record = Steps(plugin, net[0])
    model = fabric.setup_module(net)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, opt, fabric, plugin, record


def _fabric_steps(fabric, model, opt, record, steps, poison):
    x, y = data()
    rank = fabric.global_rank
    for step in steps:
        rows = slice((2 * step + rank) * BATCH, (2 * step + rank + 1) * BATCH)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        record.record(step)
        if poison and rank == 1 and step == 1:
            loss = loss * float("inf")  # an overflow on this rank only
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()


# ---------------------------------------------------------------------------------------------------- Trainer
class Model(L.LightningModule):
    def __init__(self, plugin, sharded, poison):
        super().__init__()
        self.net = mlp()
        self.plugin, self.sharded, self.poison = plugin, sharded, poison
        self.steps = Steps(plugin, self.net[0])
        self.accumulate = 1

    def configure_model(self):
        if self.sharded:
            shard(self, self.device_mesh["data_parallel"], self.plugin.fsdp_mp_policy())

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        if batch_idx % self.accumulate == 0:  # the step's first micro-batch (the switch comes before it)
            self.steps.record(self.trainer.global_step)
        return loss

    def on_after_backward(self):
        # a NaN on rank 1 only, after the gradients' all-reduce would have run
        if self.poison and self.global_rank == 1 and self.trainer.global_step == 1:
            grad = self.net[0].weight.grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")

    def train_dataloader(self):
        x, y = data()
        r = self.trainer.global_rank  # rank r's rows of step s: the Fabric loop's
        rows = torch.cat([torch.arange((2 * s + r) * BATCH, (2 * s + r + 1) * BATCH) for s in range(STEPS)])
        return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=BATCH // self.accumulate, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def trainer_phase(strategy, first, then, poison, accumulate=1):
    import lightning_mp as front
    from lightning.pytorch.strategies import ModelParallelStrategy

    # under the Trainer a fraction of max_steps: 0.5 of 6 steps is step 3, the Fabric phases' switch
    plugin = plugin_for(front, first, then, when=SWITCH / STEPS)
    sharded = strategy == "fsdp2"
    model = Model(plugin, sharded, poison)
    model.accumulate = accumulate  # micro-batches of BATCH // accumulate rows: the same rows per step
    trainer = L.Trainer(
        accelerator="cpu", devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if sharded else "ddp",
        plugins=[plugin], max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, accumulate_grad_batches=accumulate,
    )
    trainer.fit(model)
    return {**model.steps.result(model.net), "global_step": trainer.global_step}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--phases", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for phase in args.phases.split(","):
        front, strategy, first, then, *resumed = phase.split("-")
        try:
            if front == "fabric":
                resume_at = int(resumed[0].removeprefix("resume")) if resumed else None
                results[phase] = fabric_phase(strategy, first, then, first == "fp16", resume_at, args.out)
            else:
                accumulate = int(resumed[0].removeprefix("accumulate")) if resumed else 1
                results[phase] = trainer_phase(strategy, first, then, first == "fp16", accumulate)
        except ValueError as error:  # a refused schedule: every rank refuses it at the same point
            raised_in = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
            results[phase] = {"error": str(error), "raised_in": raised_in}
    torch.save(results, os.path.join(args.out, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()  # gloo's threads stop before the interpreter does


if __name__ == "__main__":
    main()
