"""The demo GPT on 2 processes with FSDP2 in a Fabric loop, sharded as litgpt shards, with lightning_mp's plugin.

    python examples/fabric_fsdp_gpt.py                                  # 2 CPU processes (gloo)
    python examples/fabric_fsdp_gpt.py --accelerator cuda               # 2 GPUs
    python examples/fabric_fsdp_gpt.py --resume checkpoints/fabric_fsdp_gpt/step-000030.pt --max-steps 60
    tensorboard --logdir logs/fabric_fsdp_gpt
"""

import argparse
from pathlib import Path

import lightning as L
from lightning.fabric.loggers import TensorBoardLogger
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from lightning_mp.demos import GPT, StdlibTextDataModule
from lightning_mp.fabric import MixedPrecisionPlugin, PrecisionMonitor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16", help="fp16, bf16 or fp32 (or an alias such as 16-mixed)")
    parser.add_argument("--accelerator", default="cpu", help="cpu or cuda")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=30, help="the step to stop at (a resumed run goes on to it)")
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping (true FP32 gradients)")
    parser.add_argument("--grad-range-every", type=int, default=10, help="gradient histogram every N steps")
    parser.add_argument("--log-dir", default="logs/fabric_fsdp_gpt")
    parser.add_argument("--out-dir", default="checkpoints/fabric_fsdp_gpt", help="step-NNNNNN.pt saved at the end")
    parser.add_argument("--resume", default=None, metavar="PATH", help="a checkpoint this script saved")
    args = parser.parse_args()

    plugin = MixedPrecisionPlugin(args.precision)

    def parallelize(model: GPT, mesh) -> GPT:  # as litgpt: each transformer block, then the root
        for block in model.blocks:
            fully_shard(block, mesh=mesh["data_parallel"], mp_policy=plugin.fsdp_mp_policy())
        fully_shard(model, mesh=mesh["data_parallel"], mp_policy=plugin.fsdp_mp_policy())
        return model

    # save_distributed_checkpoint=False: one file with the full FP32 state, which any number of processes loads
    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=args.devices,
                                     tensor_parallel_size=1, save_distributed_checkpoint=False)
    logger = TensorBoardLogger(args.log_dir, name=plugin.format.name)
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy, plugins=[plugin],
                      loggers=logger)
    fabric.launch()
    fabric.seed_everything(0)
    PrecisionMonitor(fabric, grad_range_every_n_steps=args.grad_range_every)  # precision/... tags at every step

    model = fabric.setup_module(GPT(block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd))
    optimizer = fabric.setup_optimizers(model.configure_optimizers())  # over the FP32 shards: they are the masters
    state = {"model": model, "optimizer": optimizer, "precision": plugin, "step": 0}  # the plugin: scale, skips
    if args.resume:
        fabric.load(args.resume, state)
    start = state["step"]
    data = StdlibTextDataModule(block_size=args.block_size, batch_size=args.batch_size, max_bytes=2**20,
                                seed=state["step"])  # a resumed run draws other batches
    train_loader = fabric.setup_dataloaders(data.train_dataloader())  # each process its own part

    while state["step"] < args.max_steps:
        for x, y in train_loader:
            loss = GPT.loss_fn(model(x), y)  # the logits come back FP32: an FP32 loss
            fabric.backward(loss)  # scaled in fp16; FSDP2 reduce-scatters the gradients in FP32
            fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)  # unscales first
            optimizer.step()  # skips on inf/NaN on any process, on every process alike
            optimizer.zero_grad(set_to_none=True)
            fabric.log("train_loss", loss.item(), step=state["step"])  # .item(): a host sync, one per step
            if state["step"] % 10 == 0:
                fabric.print(f"step {state['step']}: loss {loss.item():.4f}, scale {plugin.loss_scale:g}")
            state["step"] += 1
            if state["step"] >= args.max_steps:
                break

    # a new file per save: fabric.load maps the file it reads into memory, and writing over it would change what the
    # loaded optimizer state still reads
    path = Path(args.out_dir) / f"step-{state['step']:06d}.pt"
    if state["step"] > start:
        path.parent.mkdir(parents=True, exist_ok=True)
        fabric.save(path, state)  # FP32 masters, optimizer state and the plugin's state, one file
    saved = f"saved {path}" if state["step"] > start else f"nothing saved (the run resumed at step {start})"
    fabric.print(f"step {state['step']}: {plugin.skipped_steps} of {plugin.training_steps} steps skipped; {saved}")
    logger.finalize("success")


if __name__ == "__main__":
    main()
