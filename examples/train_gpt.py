"""Train lightning_mp's demo GPT on the Python standard library's own source, with the precision monitors.

    python examples/train_gpt.py                                           # bf16, 800 steps, ~3-4 min on 2 cores
    python examples/train_gpt.py --precision fp16                          # one string swaps the precision
    python examples/train_gpt.py --config examples/configs/gpt_fp16.yaml   # every plugin knob, from YAML
    python examples/train_gpt.py --help                                    # every model, data and trainer option

TensorBoard logs go to ``runs/gpt/<precision>/version_N``; ``tensorboard --logdir runs/gpt``, tag filter
``precision/``. A plugin given in ``trainer.plugins`` (a config file) wins over ``--precision``. Lightning's own
plugin as a reference, run summaries and the one-table comparison: ``benchmarks/gpt_run.py`` and
``benchmarks/compare_precisions.py``.
"""

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_mp import GradientRangeMonitor, LossScaleMonitor, MixedPrecisionPlugin
from lightning_mp.demos import GPT, StdlibTextDataModule
from lightning_mp.demos.progress import progress_bar_callbacks


class TrainGPT(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.add_argument("--precision", default="bf16", help="fp32, fp16, bf16 or fp8 (MixedPrecisionPlugin).")
        # the monitors are callbacks with their own YAML sections (loss_scale_monitor:, grad_range_monitor:)
        parser.add_lightning_class_args(LossScaleMonitor, "loss_scale_monitor")
        parser.add_lightning_class_args(GradientRangeMonitor, "grad_range_monitor")
        parser.link_arguments("data.block_size", "model.block_size")
        # sized for a 2-core CPU: 800 steps of 16 x 128 bytes and 4 validations take ~3-4 minutes in bf16;
        # lr warmed up over 40 steps, then a cosine decay (lightning_mp.demos.gpt.RECIPE): no early loss spikes
        parser.set_defaults({"trainer.max_steps": 800, "trainer.val_check_interval": 200,
                             "trainer.log_every_n_steps": 10, "trainer.gradient_clip_val": 1.0,
                             "trainer.devices": 1, "model.lr": 1e-3, "model.warmup_steps": 40,
                             "model.lr_schedule": "cosine", "model.min_lr_ratio": 0.1, "data.seed": 0})

    def instantiate_trainer(self, **kwargs):
        plugins = list(self.config_init.trainer.get("plugins") or [])
        plugin = next((p for p in plugins if isinstance(p, MixedPrecisionPlugin)), None)
        if plugin is None:
            plugin = MixedPrecisionPlugin(self.config.precision)  # a bad name raises, listing the allowed ones
            plugins.append(plugin)
        logger = self.config_init.trainer.get("logger")
        if logger is None or logger is True:
            logger = TensorBoardLogger("runs/gpt", name=plugin.format.name)
        # a bar that counts the 800 steps (Lightning's default one reads "Epoch 0/-2" in a max_steps run)
        callbacks = progress_bar_callbacks(self.config_init.trainer.get("callbacks") or [],
                                           self.config_init.trainer.get("enable_progress_bar"))
        return super().instantiate_trainer(plugins=plugins, logger=logger, callbacks=callbacks, **kwargs)


def main(args=None):
    cli = TrainGPT(GPT, StdlibTextDataModule, seed_everything_default=0, auto_configure_optimizers=False,
                   args=args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli


if __name__ == "__main__":
    main()
