"""Where the activations sit against FP16's range, and which modules would overflow it, in any run.

The gradient monitor covers the backward. This one covers the forward: on a sampled step it hooks every module's
output and counts log2|x| per octave (the same exact ``frexp`` buckets as ``precision/grad_log2_magnitude``), the
fraction of elements FP16 could not hold, and each module's largest magnitude. It needs no plugin, so one FP32 (or
bf16) run answers "would FP16 overflow in the forward, and where?" before any FP16 run is tried.

Cost: nothing on steps that are not sampled (no hooks are installed). On a sampled step, a few elementwise passes
over each distinct output tensor (a container that returns its last child's tensor is counted once), queued on the
device; everything comes back in one transfer at the end of that training step (one host sync per sampled step).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp import ranges_plot
from lightning_mp.gradient_range_monitor import (
    NUM_BUCKETS,
    REFERENCE_FORMAT,
    _measure_on_device,
    _unpack,
    histogram_kwargs,
    reference_scale,
)
from lightning_mp.loss_scaler import DEFAULT_INIT_SCALE
from lightning_mp.monitor_base import _logger_step, _PrecisionMonitor
from lightning_mp.overflow_locator import _tensors

_TAG_HISTOGRAM = "precision/activation_log2_magnitude"
_TAG_OVERFLOW = "precision/activation_overflow_fraction"
_TAG_UNDERFLOW = "precision/activation_underflow_fraction"
_TAG_AMAX = "precision/activation_amax"
_TAG_IMAGE = "precision/ranges_vs_formats"


@dataclass
class _Sample:
    """One sampled step's measurements, still on the device."""

    step: int
    packed: Tensor | None = None  # [zeros, underflow, not_overflow, NUM_BUCKETS counts] over distinct outputs
    numel: int = 0
    modules: dict[str, int] = field(default_factory=dict)  # name -> position in `amax` (first-call order)
    amax: list[Tensor] = field(default_factory=list)  # per module: largest |output| (0-dim, on the device)
    input_amax: list[Tensor | None] = field(default_factory=list)  # per module: largest |input| (None: no input)
    grads: Tensor | None = None  # gradient counts at scale 1, for the picture
    grad_numel: int = 0


class ActivationRangeMonitor(_PrecisionMonitor):
    """Histogram of log2|activation|, the fractions FP16 could not hold, and the modules that would overflow it.

    Works in any run: with :class:`lightning_mp.MixedPrecisionPlugin` in any format, with Lightning's own precision
    settings, or in plain FP32 (where it tells whether FP16 *would* overflow in the forward). Activations are the
    floating tensors each module's ``forward`` returns (a tensor, or one level of tuple / list / dict), in the
    training forward of a sampled step.

    ==============================================  =================================================================
    Key                                             Logged value
    ==============================================  =================================================================
    ``precision/activation_log2_magnitude``         histogram of log2|x| over the nonzero finite elements of every
                                                    module output, one bucket per octave (``[k, k+1)`` holds
                                                    2^k <= |x| < 2^(k+1)); TensorBoard loggers only
    ``precision/activation_overflow_fraction``      fraction of output elements with |x| > 65504 (FP16's largest),
                                                    inf or NaN
    ``precision/activation_underflow_fraction``     fraction with 0 < |x| < 2^-24 (below FP16's smallest subnormal:
                                                    flushed to zero in FP16)
    ``precision/activation_amax/<module name>``     the module's largest |output| (``per_module=True``; the model
                                                    itself is ``<model>``)
    ``precision/ranges_vs_formats``                 an image (``log_image=True``, TensorBoard loggers, needs
                                                    matplotlib): the activation and gradient histograms on the log2
                                                    axis over the ranges of fp16, bf16, fp8 e4m3 and fp8 e5m2
                                                    (normal and subnormal parts), with the gradients also drawn
                                                    shifted by the loss scale
    ==============================================  =================================================================

    An output counts once however many modules return it (a ``Sequential`` returns its last child's tensor). The
    loss scale in the picture is the one the step used in an FP16 run of the plugin (or of Lightning's
    ``16-mixed``), and FP16's starting scale 2^16 otherwise ("where FP16 would put them").

    :attr:`fp16_overflow_modules` names the modules whose output went above 65504 **while their inputs were
    within FP16's range** (where an overflow starts, not every module downstream that inherits it), first
    offender first, over all sampled steps so far. The first time there is one, a warning names them with the
    remedy: keep those classes in FP32 (``fp32_modules``) or train in bf16.

    Args:
        every_n_steps: measure every this many optimizer steps (logger steps ``n-1, 2n-1, ...``), on the first
            micro-batch of that step. Steps in between cost nothing.
        per_module: also log ``precision/activation_amax/<module name>`` for every module.
        log_image: also log the ``precision/ranges_vs_formats`` picture on sampled steps (measures the step's
            gradients for it too).

    Raises:
        MisconfigurationException: at ``fit`` when the Trainer has no logger.
    """

    _requires_plugin = False

    def __init__(self, every_n_steps: int = 50, per_module: bool = False, log_image: bool = True) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(
                f"every_n_steps={every_n_steps!r} is not allowed: use an integer >= 1 (measure every that many "
                "optimizer steps)."
            )
        for name, value in (("per_module", per_module), ("log_image", log_image)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is not allowed: use True or False.")
        super().__init__()
        self.every_n_steps = every_n_steps
        self.per_module = per_module
        self.log_image = log_image
        self._offenders: list[str] = []
        self._handles: list[Any] = []
        self._sample: _Sample | None = None
        self._last_sampled: int | None = None
        self._known: dict[int, tuple[weakref.ref, int, Tensor]] = {}
        self._pending_inputs: list[Tensor | None] = []  # largest |input| of the forwards in flight (modules nest)
        self._warned_offenders = False
        self._warned_histogram = False
        self._warned_image = False

    @property
    def fp16_overflow_modules(self) -> list[str]:
        """Modules whose output exceeded FP16's largest value (65504) on a sampled step while their inputs did not,
        first offender first (a copy)."""
        return list(self._offenders)

    # ------------------------------------------------------------------ hooks of the Trainer
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._sample, self._last_sampled = None, None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = _logger_step(trainer)
        if self._sample is not None and self._sample.step != step:
            self._flush(trainer)  # a sampled step whose optimizer never stepped (training_step returned None)
        if not trainer.is_global_zero or (step + 1) % self.every_n_steps or step == self._last_sampled:
            return
        self._last_sampled = step
        self._sample = _Sample(step)
        self._known.clear()
        for name, module in pl_module.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre_hook))
            self._handles.append(module.register_forward_hook(self._post_hook(name or "<model>")))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        sample = self._sample
        if sample is None or not self.log_image:
            return
        if self._plugin is not None:
            grads = [g for _, g in self._plugin.named_grads(optimizer)]
        else:  # Lightning's own precision unscales before this hook too
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            packed = _measure_on_device(grads, 1.0, per_tensor=False)
            sample.grads = packed if sample.grads is None else sample.grads + packed.to(sample.grads.device)
            sample.grad_numel += sum(g.numel() for g in grads)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._remove_hooks()  # only the first micro-batch of a sampled step is measured
        if self._sample is not None and (self._sample.grads is not None or not self.log_image):
            self._flush(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()
        if self._sample is not None:
            self._flush(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()
        self._sample = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()

    # ------------------------------------------------------------------ hooks of the modules
    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        if self._sample is None or not torch.is_grad_enabled():
            return None
        with torch.no_grad(), torch._C.DisableTorchFunction():
            amaxes = [self._amax_of(a) for a in args if isinstance(a, Tensor) and a.is_floating_point()]
        self._pending_inputs.append(torch.stack(amaxes).amax() if amaxes else None)
        return None

    def _post_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            sample = self._sample
            if sample is None or not torch.is_grad_enabled() or not self._pending_inputs:
                return
            input_amax = self._pending_inputs.pop()
            with torch.no_grad(), torch._C.DisableTorchFunction():
                new, amaxes = [], []
                for t in _tensors(output):
                    if not t.is_floating_point():
                        continue
                    seen = self._known.get(id(t))
                    if seen is not None and seen[0]() is t and seen[1] == t._version:
                        amaxes.append(seen[2])
                        continue
                    amaxes.append(self._amax_of(t))
                    new.append(t)
                if not amaxes:
                    return
                for t in new:
                    packed = _measure_on_device([t], 1.0, per_tensor=False)
                    sample.packed = packed if sample.packed is None else sample.packed + packed.to(sample.packed.device)
                    sample.numel += t.numel()
                amax = torch.stack(amaxes).amax()
            if name in sample.modules:  # called again (a shared module): keep the largest
                i = sample.modules[name]
                sample.amax[i] = torch.maximum(sample.amax[i], amax.to(sample.amax[i].device))
                if sample.input_amax[i] is not None and input_amax is not None:
                    sample.input_amax[i] = torch.maximum(sample.input_amax[i], input_amax.to(sample.amax[i].device))
                return
            sample.modules[name] = len(sample.amax)
            sample.amax.append(amax)
            sample.input_amax.append(input_amax)

        return hook

    def _amax_of(self, t: Tensor) -> Tensor:
        """Largest |t| as a 0-dim FP32 tensor (inf for inf or NaN), reused for a tensor already reduced this step."""
        seen = self._known.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return seen[2]
        if t.numel() == 0:
            amax = torch.zeros((), device=t.device)
        else:
            lo, hi = torch.aminmax(t.detach())
            amax = torch.maximum(-lo.float(), hi.float()).nan_to_num(nan=float("inf"))
        self._known[id(t)] = (weakref.ref(t), t._version, amax)
        return amax

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending_inputs.clear()
        self._known.clear()

    # ------------------------------------------------------------------ logging
    def _flush(self, trainer: pl.Trainer) -> None:
        sample, self._sample = self._sample, None
        if sample is None or sample.packed is None:
            return
        device = sample.packed.device
        n = len(sample.amax)
        has_input = [a is not None for a in sample.input_amax]
        parts = [
            sample.packed.to(device),
            torch.stack([a.to(device) for a in sample.amax]).double(),
            torch.stack([(a if a is not None else torch.zeros(())).to(device) for a in sample.input_amax]).double(),
        ]
        if sample.grads is not None:
            parts.append(sample.grads.to(device))
        values = torch.cat(parts).tolist()  # the one host sync of a sampled step
        size = 3 + NUM_BUCKETS
        acts = _unpack(values[:size], sample.numel, 1)
        amax = values[size : size + n]
        input_amax = values[size + n : size + 2 * n]
        grads = _unpack(values[size + 2 * n :], sample.grad_numel, 1) if sample.grads is not None else None

        names = list(sample.modules)
        limit = REFERENCE_FORMAT.max
        starts = [
            name
            for name, out, inp, has in zip(names, amax, input_amax, has_input)
            if out > limit and (not has or inp <= limit)
        ]
        # a container around an offender is not one itself: the submodule says where, more precisely
        new = [n for n in starts if not any(_encloses(n, d) for d in starts) and n not in self._offenders]
        self._offenders.extend(new)
        if self._offenders and not self._warned_offenders:
            self._warned_offenders = True
            classes = sorted({type(trainer.lightning_module.get_submodule(n)).__name__ for n in new if n != "<model>"})
            rank_zero_warn(
                f"`{type(self).__name__}`: at step {sample.step} the output of {', '.join(f'`{n}`' for n in new)} "
                f"went above FP16's largest value ({limit:g}) from inputs within its range: FP16 would overflow "
                "there in the forward pass. HINT: keep those modules in FP32 with "
                f"`MixedPrecisionPlugin('fp16', fp32_modules=DEFAULT_FP32_MODULES + ({', '.join(classes)},))`, "
                "or train in precision='bf16'."
            )

        metrics = {_TAG_OVERFLOW: acts.overflow_fraction, _TAG_UNDERFLOW: acts.underflow_fraction}
        if self.per_module:
            metrics.update({f"{_TAG_AMAX}/{name}": value for name, value in zip(names, amax)})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=sample.step)

        experiments = (getattr(lg, "experiment", None) for lg in trainer.loggers)
        writers = [w for w in experiments if hasattr(w, "add_histogram_raw")]
        if not writers:
            if not self._warned_histogram:
                self._warned_histogram = True
                rank_zero_warn(
                    f"`{type(self).__name__}` logs the `{_TAG_HISTOGRAM}` histogram and the `{_TAG_IMAGE}` image only "
                    "to loggers whose experiment has `add_histogram_raw` / `add_image` (TensorBoardLogger); with "
                    f"{', '.join(type(lg).__name__ for lg in trainer.loggers)} only the scalars are logged."
                )
            return
        for writer in writers:
            writer.add_histogram_raw(_TAG_HISTOGRAM, global_step=sample.step, **histogram_kwargs(acts.histogram))
        if self.log_image:
            self._log_image(trainer, writers, sample.step, acts.histogram, grads.histogram if grads else None)

    def _log_image(self, trainer: pl.Trainer, writers: list, step: int, acts: list[int], grads: list[int] | None):
        if not ranges_plot.plotting_available():
            if not self._warned_image:
                self._warned_image = True
                rank_zero_warn(
                    f"`{type(self).__name__}` draws `{_TAG_IMAGE}` with matplotlib, which is not installed: no image "
                    "is logged. HINT: `pip install lightning-mp[plot]` (or `pip install matplotlib`), or pass "
                    "`log_image=False` to silence this."
                )
            return
        scale, label = _picture_scale(trainer, self._plugin)
        image = ranges_plot.render_ranges_vs_formats(acts, grads, scale, step, scale_label=label)
        for writer in writers:
            if hasattr(writer, "add_image"):
                writer.add_image(_TAG_IMAGE, image, global_step=step, dataformats="HWC")


def _picture_scale(trainer: pl.Trainer, plugin: Any) -> tuple[float, str]:
    """The loss scale to draw: the step's own in an FP16 run (ours or Lightning's), FP16's starting scale else."""
    if plugin is not None:
        scale = reference_scale(plugin)
        own = plugin.format.dtype == REFERENCE_FORMAT.dtype
        return (float(plugin.last_step_scale) if own else scale), ("loss scale" if own else "FP16's starting scale")
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and hasattr(scaler, "get_scale") and scaler.is_enabled():
        return float(scaler.get_scale()), "loss scale"
    return DEFAULT_INIT_SCALE, "FP16's starting scale"


def _encloses(outer: str, inner: str) -> bool:
    return outer != inner and (outer == "<model>" or inner.startswith(outer + "."))


__all__ = ["ActivationRangeMonitor"]
