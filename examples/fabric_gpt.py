"""The demo GPT in a plain Lightning Fabric loop, with lightning_mp's precision plugin and its TensorBoard tags.

    python examples/fabric_gpt.py --precision fp16 --max-steps 200
    tensorboard --logdir logs/fabric_gpt
"""

import argparse

import lightning as L
import torch
from lightning.fabric.loggers import TensorBoardLogger

from lightning_mp.demos import GPT, StdlibTextDataModule
from lightning_mp.fabric import MixedPrecisionPlugin, PrecisionMonitor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16", help="fp16, bf16 or fp32 (or an alias such as 16-mixed)")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping (true FP32 gradients)")
    parser.add_argument("--log-dir", default="logs/fabric_gpt")
    parser.add_argument("--checkpoint", default=None, help="save model, optimizer and plugin state here at the end")
    args = parser.parse_args()

    plugin = MixedPrecisionPlugin(args.precision)
    logger = TensorBoardLogger(args.log_dir, name=plugin.format.name)
    fabric = L.Fabric(devices=1, plugins=[plugin], loggers=logger)
    fabric.seed_everything(0)
    PrecisionMonitor(fabric, grad_range_every_n_steps=25)  # precision/... tags at every optimizer.step()

    data = StdlibTextDataModule(block_size=args.block_size, batch_size=args.batch_size, max_bytes=2**21, seed=0)
    with fabric.init_module():  # FP32 parameters: they become the masters
        model = GPT(block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd)
    model, optimizer = fabric.setup(model, model.configure_optimizers())
    train_loader, val_loader = fabric.setup_dataloaders(data.train_dataloader(), data.val_dataloader())

    step, micro = 0, 0
    while step < args.max_steps:
        for x, y in train_loader:
            micro += 1
            stepping = micro % args.accumulate == 0
            with fabric.no_backward_sync(model, enabled=not stepping):
                loss = GPT.loss_fn(model(x), y)  # the logits come back FP32: an FP32 loss
                fabric.backward(loss / args.accumulate)  # scales the loss in fp16
            if not stepping:
                continue
            fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)  # unscales first
            optimizer.step()  # skips the step on inf/NaN and moves the loss scale
            optimizer.zero_grad(set_to_none=True)
            fabric.log("train_loss", loss.item(), step=step)  # .item(): a host sync, one per step
            if step % 20 == 0:
                fabric.print(f"step {step}: loss {loss.item():.4f}, scale {plugin.loss_scale:g}, "
                             f"skipped {plugin.skipped_steps}")  # fmt: skip
            step += 1
            if step >= args.max_steps:
                break

    model.eval()
    with torch.no_grad():  # a forward without autograd: the FP32 weights are back when it ends
        val = torch.stack([GPT.loss_fn(model(x), y) for x, y in val_loader]).mean()
    fabric.log("val_loss", val.item(), step=step)
    fabric.print(f"val loss {val.item():.4f}; {plugin.skipped_steps} of {plugin.optimizer_steps} steps skipped")
    if args.checkpoint:  # FP32 masters; the plugin's scale and trackers only because it is in the dict
        fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "precision": plugin, "step": step})
    logger.finalize("success")


if __name__ == "__main__":
    main()
