"""Train the demo GPT on the Python standard library's own source, in the precision of your choice.

    python benchmarks/gpt_run.py                                  # bf16, lightning_mp; ~3-4 min on a 2-core CPU
    python benchmarks/gpt_run.py --precision fp16                 # fp16 + dynamic loss scaling
    python benchmarks/gpt_run.py --precision fp16 --native        # Lightning's own 16-mixed, as a reference
    python benchmarks/gpt_run.py --config examples/configs/gpt_fp16.yaml
    python benchmarks/gpt_run.py --trainer.max_steps 100 --summary runs/fp16.json --precision fp16
    python benchmarks/gpt_run.py --help                           # every model, data, trainer and monitor option

Where the precision comes from (exactly one of):

* ``trainer.plugins`` in a config file or on the command line: a ``lightning_mp.MixedPrecisionPlugin`` with any of
  its ``init_args`` (precision, loss-scale knobs, fp32_ops...), or Lightning's own
  ``lightning.pytorch.plugins.precision.MixedPrecision``;
* ``--precision NAME`` (fp32, fp16, bf16 or an alias from ``lightning_mp.PRECISION_ALIASES``; default bf16), which
  builds ``MixedPrecisionPlugin(NAME)`` with default knobs;
* ``--precision NAME --native``: Lightning's own mixed precision as a reference, built explicitly as
  ``MixedPrecision("16-mixed" | "bf16-mixed", device)`` (``Trainer(precision="16-mixed")`` on a CPU switches to bf16
  with a warning); ``--precision fp32 --native`` is a plain FP32 Trainer.

The optimizer recipe (``--model.lr``, ``--model.warmup_steps``, ``--model.lr_schedule``, ``--model.min_lr_ratio``)
defaults to ``lightning_mp.demos.gpt.RECIPE``: AdamW at a peak lr of 1e-3 after a 40-step linear warmup, then a
cosine decay to 1e-4 at ``max_steps``; gradients clipped at norm 1.0. ``--seed_everything S --data.seed S`` picks
the seed (initialisation and batch order); ``benchmarks/compare_precisions.py --seeds`` runs several.

Each run logs to TensorBoard under ``--log_dir`` (default ``runs/gpt``) in a version named after its precision:
``runs/gpt/bf16``, then ``bf16_1``..., ``native-16-mixed`` for the reference rows, so ``tensorboard --logdir runs/gpt``
shows the runs side by side. The model logs ``train_loss``, ``val_loss``, ``val_ppl`` and ``val_acc``; with
lightning_mp's plugin, :class:`lightning_mp.LossScaleMonitor` and :class:`lightning_mp.GradientRangeMonitor` add
the ``precision/*`` tags (their knobs: ``--loss_scale_monitor.*``, ``--grad_range_monitor.*``). Validation also
runs once after the last step, so the reported val_* always describe the final weights.

``--summary PATH`` writes a JSON summary at the end; the keys are listed in :data:`SUMMARY_KEYS`.

Put ``--config`` first: later arguments override it. To shorten validation use ``--data.max_val_batches N``:
``--trainer.limit_val_batches 1`` reaches Lightning as ``1.0``, i.e. all batches (the Trainer types it
``Union[float, int]``, so jsonargparse reads numbers as floats; values above 1 are turned back into batch counts).
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Any, Optional

try:
    import resource  # POSIX only: the process's peak RSS
except ImportError:  # e.g. Windows: the peak RSS columns stay empty
    resource = None

import lightning as L
import torch
from jsonargparse import ActionYesNo
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from typing_extensions import override

from lightning_mp import GradientRangeMonitor, LossScaleMonitor, MixedPrecisionPlugin, resolve_precision
from lightning_mp.demos import GPT, StdlibTextDataModule
from lightning_mp.demos.gpt import RECIPE

# Defaults sized for a 2-core CPU: the 4x256 GPT on 16x128-byte batches does ~4.4 steps/s in bf16 there, so 800
# steps plus 4 validations (16 batches each) take ~3.2 min (measured: 191 s with start-up). The optimizer recipe
# is lightning_mp.demos.gpt.RECIPE: peak lr 1e-3 (nanoGPT's for small character-level models, visibly further in
# 800 steps than the model's own 3e-4) reached after a linear warmup, then a cosine decay over max_steps. Without
# the warmup, FP32 itself spikes early by a seed-dependent amount, and one seed's spike decides a comparison.
TRAINER_DEFAULTS: dict[str, Any] = {
    "max_steps": 800,
    "val_check_interval": 200,
    "log_every_n_steps": 10,
    "gradient_clip_val": 1.0,
    "devices": 1,
}
MODEL_DEFAULTS: dict[str, Any] = {
    **{f"model.{key}": value for key, value in RECIPE.items()},
    "data.seed": 0,
    "grad_range_monitor.every_n_steps": 50,
}
DEFAULT_PRECISION = "bf16"
TRAIN_LOSS_WINDOW = 10

# The defaults of MixedPrecisionPlugin's fp32_ops/fp32_modules are a frozenset and a tuple, which jsonargparse
# writes as lists and may warn about each time it dumps the config (config.yaml beside the logs, --print_config).
# Lists are what the plugin accepts, so the warning only hides the output that matters.
warnings.filterwarnings("ignore", message=r"\s*Dump of a value that does not round-trip", module="jsonargparse")

#: Keys of the ``--summary`` JSON. Metric values are ``null`` when the run did not produce them (no validation,
#: no loss scaler).
SUMMARY_KEYS = (
    "precision",  # the run's name: fp32 | fp16 | bf16 (lightning_mp) or native-<Lightning precision>
    "train_loss",  # mean training loss over the last TRAIN_LOSS_WINDOW steps
    "val_loss",  # final validation cross-entropy (nats per byte), after the last step
    "val_ppl",
    "val_acc",
    "wall_time_s",  # the whole trainer.fit, validation and set-up included
    "train_time_s",  # training steps only (validation and sanity check excluded)
    "tokens_per_s",  # training tokens / train_time_s
    "peak_memory_bytes",
    "peak_memory_kind",  # "cuda_max_memory_allocated" or "process_peak_rss"
    "skipped_steps",  # optimizer steps skipped on inf/NaN gradients; null when nothing guards against them
    "loss_scale",  # final loss scale; 1.0 when scaling is off; null without a scaler
    "steps",
    "tokens",
    "device",
    "log_dir",
    "plugin",  # the precision plugin's settings
)


class RunRecorder(Callback):
    """What the summary needs that Lightning does not keep: training-only time, tokens, the last losses, the skip
    count of Lightning's own GradScaler. It also stops the fit after ``max_steps`` through ``trainer.should_stop``,
    which makes Lightning validate once more unless it just did, so the final val_* describe the final weights."""

    def __init__(self, loss_window: int = TRAIN_LOSS_WINDOW) -> None:
        self.train_time_s = 0.0
        self.tokens = 0
        self.losses: deque[torch.Tensor] = deque(maxlen=loss_window)
        self.native_skipped_steps = 0
        self._native_scale: Optional[float] = None
        self._started: Optional[float] = None

    @staticmethod
    def _now(pl_module: L.LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # count queued kernels in the span they belong to
        return time.perf_counter()

    def _pause(self, pl_module: L.LightningModule) -> None:
        if self._started is not None:
            self.train_time_s += self._now(pl_module) - self._started
            self._started = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        scaler = _native_scaler(trainer)
        self._native_scale = scaler.get_scale() if scaler is not None else None
        self._started = self._now(pl_module)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._started is None:  # resume after a validation (and any checkpoint written after it)
            self._started = self._now(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.tokens += batch[0].numel()
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(loss.detach())
        scaler = _native_scaler(trainer)
        if scaler is not None:
            # torch's GradScaler backs off exactly when it skips a step, so a smaller scale is a skipped step.
            # get_scale() is a host sync, but GradScaler.step() has already synced on its inf check.
            scale = scaler.get_scale()
            if self._native_scale is not None and scale < self._native_scale:
                self.native_skipped_steps += 1
            self._native_scale = scale
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._pause(pl_module)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause(pl_module)

    def mean_loss(self) -> Optional[float]:
        return torch.stack(list(self.losses)).float().mean().item() if self.losses else None


def _native_scaler(trainer: L.Trainer) -> Optional[torch.amp.GradScaler]:
    """Lightning's own GradScaler, when the run uses Lightning's ``16-mixed``."""
    plugin = trainer.precision_plugin
    if isinstance(plugin, MixedPrecisionPlugin):
        return None
    scaler = getattr(plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"{path!r} (use a full import path such as 'torch.nn.LayerNorm')")
    return getattr(importlib.import_module(module), name)


def _class_of(entry: Any) -> Any:
    """The class a parsed ``class_path`` entry names (None for anything else)."""
    path = entry.get("class_path") if hasattr(entry, "get") else entry if isinstance(entry, str) else None
    try:
        return _import(path) if isinstance(path, str) else None
    except (ImportError, AttributeError, ValueError):
        return None  # jsonargparse reports a bad class path itself, at instantiation


def run_name(plugin: Optional[Precision]) -> str:
    """The name a run is logged under: the plugin's format, or ``native-<Lightning precision>``."""
    if isinstance(plugin, MixedPrecisionPlugin):
        return plugin.format.name
    if isinstance(plugin, MixedPrecision):
        return f"native-{plugin.precision}"
    if plugin is not None:
        return type(plugin).__name__
    return "native-32-true"  # no precision plugin: Lightning's default FP32


def unique_version(root: Path, name: str) -> str:
    """``name`` if ``root/name`` is free, else the first free ``name_1``, ``name_2``..."""
    if not (root / name).exists():
        return name
    i = 1
    while (root / f"{name}_{i}").exists():
        i += 1
    return f"{name}_{i}"


def _device_type(accelerator: Any) -> str:
    if isinstance(accelerator, str) and accelerator.lower() == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def peak_memory(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    if resource is None:
        return None, "unavailable (no resource module)"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux, bytes on macOS
    return (rss if sys.platform == "darwin" else rss * 1024), "process_peak_rss"


def plugin_settings(plugin: Precision) -> dict[str, Any]:
    if isinstance(plugin, MixedPrecisionPlugin):
        s = plugin.core.scaler
        return {
            "class": "lightning_mp.MixedPrecisionPlugin",
            "precision": plugin.format.name,
            "master_weights": "compensated" if plugin.core.lean is not None else plugin.master_weights,
            "optimizer_state_dtype": str(plugin.core.lean.state_dtype) if plugin.core.lean is not None else None,
            "parity": plugin.parity,  # (drift, lost fraction) at the last step, with parity_guard
            "auto_fp32_modules": plugin.auto_fp32_modules,
            "loss_scale": s.mode,
            "init_scale": s.init_scale,
            "growth_interval": s.growth_interval,
            "hysteresis": s.hysteresis,
            "fp32_ops": sorted(plugin.policy.ops),
            "fp32_modules": [m.__name__ for m in plugin.policy.modules],
            "gemm": plugin.gemm.describe(),  # which 16-bit GEMMs ran (native or emulated) and why
        }
    return {"class": f"{type(plugin).__module__}.{type(plugin).__qualname__}", "precision": str(plugin.precision)}


class TrainGPTCLI(LightningCLI):
    """LightningCLI for the demo GPT, plus ``--precision``/``--native``, ``--log_dir`` and ``--summary``."""

    def __init__(self, args: Any = None) -> None:
        self.recorder = RunRecorder()
        self.name = ""
        super().__init__(
            GPT,
            StdlibTextDataModule,
            trainer_defaults=TRAINER_DEFAULTS,
            seed_everything_default=0,
            auto_configure_optimizers=False,  # keep GPT's own AdamW with nanoGPT's weight-decay groups
            parser_kwargs={"description": "Train lightning_mp's demo GPT; see benchmarks/gpt_run.py's docstring."},
            args=args,
            run=False,
        )

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--precision",
            type=Optional[str],
            default=None,
            help=f"fp32, fp16 or bf16 (or an alias); default {DEFAULT_PRECISION}. Not together with a precision "
            "plugin in trainer.plugins.",
        )
        parser.add_argument(
            "--native",
            action=ActionYesNo,
            default=False,
            help="use Lightning's own MixedPrecision('16-mixed'/'bf16-mixed', device) for --precision instead of "
            "lightning_mp (a reference run; no precision/* monitors).",
        )
        parser.add_argument("--log_dir", type=str, default="runs/gpt", help="TensorBoard root; one version per run.")
        parser.add_argument("--summary", type=Optional[str], default=None, help="write a JSON summary here.")
        parser.add_class_arguments(LossScaleMonitor, "loss_scale_monitor")
        parser.add_class_arguments(GradientRangeMonitor, "grad_range_monitor")
        parser.link_arguments("data.block_size", "model.block_size")
        parser.set_defaults(MODEL_DEFAULTS)

    @override
    def before_instantiate_classes(self) -> None:
        cfg = self.config
        if cfg.precision is not None:
            try:
                resolve_precision(cfg.precision)
            except ValueError as err:
                self.parser.error(f"--precision: {err}")
        for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
            # Trainer annotates these Union[float, int], so jsonargparse reads "--trainer.limit_val_batches 4" as
            # 4.0, which Lightning rejects (a float means a fraction). Above 1 an integral value can only mean a
            # batch count. (1 stays 1.0, i.e. all batches: cap validation with --data.max_val_batches instead.)
            value = cfg.trainer.get(key)
            if isinstance(value, float) and value > 1 and value.is_integer():
                cfg.trainer[key] = int(value)
        if cfg.trainer.precision is not None:
            self.parser.error(
                f"--trainer.precision={cfg.trainer.precision!r} is not used by this script. HINT: use "
                f"--precision {cfg.trainer.precision} for lightning_mp, or add --native for Lightning's own."
            )

        for i, entry in enumerate(_as_list(cfg.trainer.get("plugins"))):
            if _class_of(entry) is MixedPrecisionPlugin and entry.get("init_args") is not None:
                self._check_plugin_args(f"trainer.plugins[{i}].init_args", entry.init_args)

    def _check_plugin_args(self, where: str, init_args: Any) -> None:
        try:
            resolve_precision(init_args.get("precision", DEFAULT_PRECISION))
        except ValueError as err:
            self.parser.error(f"{where}.precision: {err}")
        modules = init_args.get("fp32_modules")
        if isinstance(modules, list) and any(isinstance(m, str) for m in modules):
            # Class paths that reach us as plain strings (a config.yaml saved by an older version of this
            # script, or a jsonargparse that does not resolve type[...] hints) are imported here, so a YAML
            # list such as [torch.nn.LayerNorm] and a re-run of a saved config.yaml both work.
            try:
                init_args["fp32_modules"] = [_import(m) if isinstance(m, str) else m for m in modules]
            except (ImportError, AttributeError, ValueError) as err:
                self.parser.error(f"{where}.fp32_modules: cannot import {err}")

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as err:  # bad init_args: one line naming the argument, not a traceback
            self.parser.error(f"{type(err).__name__}: {err}")

    @override
    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        cfg, init = self.config, self.config_init
        plugins = _as_list(init.trainer.get("plugins"))
        precision_plugins = [p for p in plugins if isinstance(p, Precision)]
        if precision_plugins and (cfg.precision is not None or cfg.native):
            self.parser.error(
                "trainer.plugins already sets the precision "
                f"({type(precision_plugins[0]).__name__}); --precision/--native would set it twice. "
                "HINT: drop one of them."
            )
        if not precision_plugins:
            precision = resolve_precision(cfg.precision or DEFAULT_PRECISION)
            if cfg.native:
                if precision.is_16bit:
                    device = _device_type(init.trainer.get("accelerator"))
                    plugins.append(MixedPrecision(precision.lightning_precision, device))
            else:
                plugins.append(MixedPrecisionPlugin(precision.name))
        plugin = next((p for p in plugins if isinstance(p, Precision)), None)
        self.name = run_name(plugin)

        logger = init.trainer.get("logger")
        if logger is None or logger is True:
            root = Path(cfg.log_dir)
            logger = TensorBoardLogger(save_dir=str(root), name="", version=unique_version(root, self.name))

        callbacks = _as_list(init.trainer.get("callbacks")) + [self.recorder]
        if isinstance(plugin, MixedPrecisionPlugin) and logger is not False:
            callbacks += [init.loss_scale_monitor, init.grad_range_monitor]  # they read lightning_mp's scaler
        return super().instantiate_trainer(plugins=plugins or None, callbacks=callbacks, logger=logger, **kwargs)

    def train(self) -> dict[str, Any]:
        """Fit, then print (and with --summary write) the summary; returns it."""
        start = time.perf_counter()
        self.trainer.fit(self.model, datamodule=self.datamodule)
        summary = self.summarize(time.perf_counter() - start)
        if self.trainer.is_global_zero:
            print(format_summary(summary), flush=True)
            if self.config.summary:
                path = Path(self.config.summary)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def summarize(self, wall_time_s: float) -> dict[str, Any]:
        trainer, rec = self.trainer, self.recorder
        metrics = trainer.callback_metrics

        def metric(key: str) -> Optional[float]:
            return float(metrics[key]) if key in metrics else None

        plugin = trainer.precision_plugin
        if isinstance(plugin, MixedPrecisionPlugin):
            skipped, scale = plugin.skipped_steps, plugin.loss_scale
        elif _native_scaler(trainer) is not None:
            skipped, scale = rec.native_skipped_steps, _native_scaler(trainer).get_scale()
        else:
            skipped, scale = None, None  # bf16-mixed / 32-true: no scaler, and no guard against inf/NaN either
        device = trainer.strategy.root_device
        peak, peak_kind = peak_memory(device)
        summary = {
            "precision": self.name,
            "train_loss": rec.mean_loss(),
            "val_loss": metric("val_loss"),
            "val_ppl": metric("val_ppl"),
            "val_acc": metric("val_acc"),
            "wall_time_s": wall_time_s,
            "train_time_s": rec.train_time_s,
            "tokens_per_s": rec.tokens / rec.train_time_s if rec.train_time_s > 0 else None,
            "peak_memory_bytes": peak,
            "peak_memory_kind": peak_kind,
            "skipped_steps": skipped,
            "loss_scale": scale,
            "steps": trainer.global_step,
            "tokens": rec.tokens,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "log_dir": trainer.logger.log_dir if trainer.logger is not None else None,
            "plugin": plugin_settings(plugin),
        }
        return summary


def format_summary(s: dict[str, Any]) -> str:
    def num(key: str, fmt: str) -> str:
        return "-" if s[key] is None else format(s[key], fmt)

    return (
        f"[{s['precision']}] {s['steps']} steps: train_loss {num('train_loss', '.4f')}  val_loss "
        f"{num('val_loss', '.4f')}  val_ppl {num('val_ppl', '.3f')}  val_acc {num('val_acc', '.4f')} | "
        f"{s['wall_time_s']:.1f} s, {num('tokens_per_s', '.0f')} tokens/s, peak memory "
        f"{s['peak_memory_bytes'] / 2**20:.0f} MiB | skipped {num('skipped_steps', 'd')}, loss scale "
        f"{num('loss_scale', 'g')} | {s['log_dir']}"
    )


def main(args: Any = None) -> dict[str, Any]:
    return TrainGPTCLI(args).train()


if __name__ == "__main__":
    main()
