"""The fit and the measurements of one GPU-table row (run inside benchmarks/gpu_row.py's process).

What each number is:

* **tokens/s**: tokens of the measured steps (after ``warmup``: compilation, the first allocations and the fp16
  scale's first moves stay out) over their wall time, the device synchronized at both ends.
* **peak MiB**: ``torch.cuda.max_memory_allocated`` over the fit minus ``memory_allocated`` just before it (the
  resident batches): the model, its gradients, optimizer state and activations of this row only.
* **host syncs/step**: ``torch.cuda.set_sync_debug_mode("warn")`` warnings over the measured steps, whoever caused
  them (``bf16-mixed``'s row is Lightning's own floor). It cannot see ``cudaEventSynchronize``, which is how the
  plugin's late flag is read, hence the next column.
* **late-flag waits/step**: the plugin reads a step's overflow flag one step late, through a CUDA event
  (``lightning_mp/numerics/deferred.py``, ``LateFlag.read``). The read is wrapped here (the module is not changed):
  when the event has not completed at the read, the host waits for the device: one wait. Shown with the reads.
* **skipped steps**: ours from ``plugin.skipped_steps``; Lightning's ``16-mixed`` from its ``GradScaler``, whose scale
  backs off on every skipped step (the scale is kept on the device each step and compared after the fit). After an
  fp16 row's first skip the overflow locator's forward checks are armed for the rest of its fit (9-13% of a step):
  a row with skips pays them in its measured steps.
* **graphs (breaks)**: Dynamo's unique graphs and graph breaks over the fit, for the compiled rows.
"""

from __future__ import annotations

import gc
import time
import warnings

import lightning as L
import torch
from gpu_models import GPT2_SMALL, GPT_TINY, LLAMA_TINY, LLAMA_WIDE, FusedGPT, Llama, LlamaBlock, resident_batches
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.numerics import deferred


class LateFlagWaits:
    """Counts the plugin's late-flag reads inside the measured steps, and those that found the copy not yet done."""

    def __init__(self) -> None:
        self.measuring, self.reads, self.waits = False, 0, 0
        self._read = deferred.LateFlag.read

    def __enter__(self) -> LateFlagWaits:
        read = self._read

        def counted(flag):
            if self.measuring and flag.event is not None:
                self.reads += 1
                self.waits += not flag.event.query()  # cudaEventQuery: asks, does not wait
            return read(flag)

        deferred.LateFlag.read = counted
        return self

    def __exit__(self, *exc) -> None:
        deferred.LateFlag.read = self._read


def _grad_scaler(trainer):
    plugin = trainer.precision_plugin
    return getattr(plugin, "scaler", None) if isinstance(plugin, MixedPrecision) else None


class Measure(Callback):
    def __init__(self, warmup: int, tokens_per_step: int, late: LateFlagWaits) -> None:
        self.warmup, self.tokens, self.late = warmup, tokens_per_step, late
        self.started, self.loss, self.scales = False, None, []
        self._catch, self._caught, self.skipped_before = None, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.warmup or self.started:
            return
        self.started = True
        self.skipped_before = getattr(trainer.precision_plugin, "skipped_steps", None)  # may read: before the clock
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
            self._catch = warnings.catch_warnings(record=True)
            self._caught = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        self.late.measuring = True
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.loss = outputs["loss"].detach()  # read after the fit: no host read inside the measured steps
        scaler = _grad_scaler(trainer)
        if scaler is not None and getattr(scaler, "_scale", None) is not None:
            self.scales.append(scaler._scale.detach().clone().reshape(()))  # queued on the device, not read

    def on_train_end(self, trainer, pl_module):
        self.late.measuring = False
        if self._catch is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._catch.__exit__(None, None, None)
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0
        self.steps = trainer.global_step - self.warmup

    def syncs(self) -> int | None:
        return sum("synchroniz" in str(w.message) for w in self._caught) if self._catch is not None else None


def _shape(spec: dict) -> tuple[dict, int]:
    if spec["model"] == "gpt":
        return (GPT_TINY if spec["dry"] else GPT2_SMALL), 2 if spec["dry"] else 8
    return (LLAMA_TINY if spec["dry"] else LLAMA_WIDE), 2 if spec["dry"] else 4


def _model(spec: dict, device: str):
    shape, _ = _shape(spec)
    if spec["model"] == "gpt":
        model = FusedGPT(lr=3e-4, **shape)
    else:
        model = Llama(**shape)
    if spec["variant"] == "torchao fp8 tensorwise":
        # what a Lightning user writes today: torchao's conversion (its default recipe, the output head kept in
        # bf16), then torch.compile, then Trainer(precision="bf16-mixed")
        import dataclasses

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name("tensorwise")
        if device != "cuda" or torch.cuda.get_device_capability() < (8, 9):
            config = dataclasses.replace(config, emulate=True)  # no FP8 GEMMs here: torchao's FP32 stand-in
        convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn != "head")
    if spec["compile"]:
        model.compile_blocks() if isinstance(model, Llama) else None
    return model


def _precision(spec: dict, device: str) -> dict:
    v = spec["variant"]
    if v == "Lightning 32-true":
        return dict(precision="32-true")
    if v in ("Lightning bf16-mixed", "torchao fp8 tensorwise"):
        return dict(plugins=[MixedPrecision("bf16-mixed", device)])
    if v == "Lightning 16-mixed":  # the plugin object: on a CPU precision="16-mixed" would become bf16 (dry run)
        return dict(plugins=[MixedPrecision("16-mixed", device)])
    if v == "Lightning TransformerEnginePrecision":  # Lightning's FP8: TE's layers, bf16 weights
        from lightning.pytorch.plugins import TransformerEnginePrecision

        return dict(plugins=[TransformerEnginePrecision(weights_dtype=torch.bfloat16)])
    ours = {"ours bf16": ("bf16", {}), "ours fp16": ("fp16", {}),
            "ours lean bf16": ("bf16", dict(master_weights="compensated"))}  # fmt: skip
    if v in ours:
        return dict(plugins=[MixedPrecisionPlugin(ours[v][0], **ours[v][1])])
    if v.startswith("ours fp8 "):
        # full size: torchao's shape rule ("default") converts every block Linear at 4096 wide and keeps the head in
        # bf16; the dry run's tiny Linears are under that rule's sizes, so it names the blocks
        modules = [LlamaBlock] if spec["dry"] else "default"
        return dict(plugins=[MixedPrecisionPlugin("fp8", fp8_recipe=v.split()[-1], fp8_modules=modules)])
    raise ValueError(f"variant={v!r} is not a row of benchmarks/gpu_table.py")


def fit_row(spec: dict) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    L.seed_everything(0, verbose=False)
    shape, batch = _shape(spec)
    seq = shape.get("block_size", shape.get("seq"))
    warmup, steps = spec["warmup"], spec["steps"]
    data = resident_batches(seq, batch, warmup + steps, device)
    model = _model(spec, device)
    late = LateFlagWaits()
    measure = Measure(warmup, batch * seq, late)
    trainer = L.Trainer(
        accelerator=device, devices=1, max_steps=warmup + steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[measure], **_precision(spec, device),
    )  # fmt: skip
    base = 0
    if device == "cuda":
        gc.collect(), torch.cuda.empty_cache(), torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    if spec["compile"]:
        torch._dynamo.utils.counters.clear()
    with late:
        trainer.fit(model, data)
    if not measure.started or measure.steps < 1:
        raise RuntimeError(f"the fit stopped at step {trainer.global_step}, before its measured steps")
    out = dict(tokens_per_s=measure.tokens * measure.steps / measure.seconds, steps=trainer.global_step,
               measured=measure.steps, loss=float(measure.loss))  # fmt: skip
    if device == "cuda":
        out["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        out["syncs_per_step"] = measure.syncs() / measure.steps
    plugin = trainer.precision_plugin
    if isinstance(plugin, MixedPrecisionPlugin):
        out["skipped"] = plugin.skipped_steps
        out["skipped_measured"] = plugin.skipped_steps - (measure.skipped_before or 0)
        if device == "cuda":
            out["late_waits_per_step"], out["late_reads_per_step"] = (
                late.waits / measure.steps, late.reads / measure.steps)  # fmt: skip
    elif _grad_scaler(trainer) is not None and measure.scales:
        scaler = _grad_scaler(trainer)
        scales = torch.stack([torch.tensor(float(scaler._init_scale), device=measure.scales[0].device)]
                             + measure.scales)  # fmt: skip
        backoffs = (scales[1:] < scales[:-1]).tolist()  # GradScaler halves its scale on every skipped step
        out["skipped"], out["skipped_measured"] = sum(backoffs), sum(backoffs[warmup:])
    if spec["compile"]:
        counters = torch._dynamo.utils.counters
        out["graphs"] = counters["stats"]["unique_graphs"]
        out["breaks"] = sum(counters["graph_break"].values())
    return out
