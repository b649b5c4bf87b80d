"""Lightning's own precision tests for the Trainer (tag 2.6.5), adapted: each runs with Lightning's ``MixedPrecision``
and with ours, on the CPU, and asserts what a user sees (issue 38). The facts are Lightning's; the code is ours.

Lightning's fp16 runs as ``MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", ...))``: real fp16 on
the CPU (``precision="16-mixed"`` would switch a CPU run to bf16), so the CUDA-only fp16 cases run here. Under
``pytest --device cuda`` (the CUDA suite: every test here is ``on_device``) both plugins run on the GPU instead, with
the same assertions, and those cases run where upstream runs them. Both plugins
start at the same scale, ``2**8`` unless a test says otherwise: ``BoringModel``'s first gradients times ``2**16``
overflow fp16 and would skip steps in both (differently: ``test_several_optimizers_...`` measures how). A difference
of ours by design is asserted as ours, with the sentence of ``docs/behaviour.md`` it rests on. Precision-independent
cases (the scheduler and optimizer-configuration ones) run in fp16 only.

Upstream cases (``tests/tests_pytorch/``, 111 with their parametrizations ``[n]``; 55 here, 56 skipped) and where
each went. "both": the same assertions hold under both plugins; "difference": ours asserted as documented.

========================================================  ==============================================================
upstream case                                             here
========================================================  ==============================================================
plugins/precision/test_amp.py [3]
  test_clip_gradients                                     test_clipping_... (both)
  test_optimizer_amp_scaling_support_in_step_method       test_a_fused_optimizer_with_clipping_... (difference)
  test_amp_with_no_grad                                   test_a_no_grad_forward_... (both)
plugins/precision/test_amp_integration.py [2]
  test_amp_fused_optimizer_parity                         test_fused_and_for_loop_adam_... (both; the scaler's type:
                                                          difference)
  test_skip_training_step_with_grad_scaler                test_a_training_step_returning_none_... (fp16 both; bf16:
                                                          difference)
plugins/precision/test_all.py [4]                         skipped: DeepSpeed, Double, Half and FSDP plugins, none ours;
                                                          the fact: test_contexts_restore_... (both)
plugins/precision/test_half.py [10]                       skipped: HalfPrecision (``*-true``: ours refuses it with a
                                                          hint); its init, convert and configure_model facts for mixed
                                                          precision: test_modules_built_... (both)
plugins/precision/test_double.py [7]                      skipped: DoublePrecision; its facts for mixed precision:
                                                          inputs not cast (test_steps_run_...), pickling
                                                          (test_the_model_pickles_...) (both)
models/test_amp.py [11]
  test_amp_cpus [single_device x 2]                       test_steps_run_under_autocast_... (both); ``plugin.device``:
                                                          ours too (test_the_plugin_says_its_device)
  test_amp_cpus [ddp_spawn x 2]                           skipped: spawned processes; tests/test_ddp.py and
                                                          test_lightning_features_integration.py run ours under DDP
  test_amp_gpus [1 device x 2]                            as test_amp_cpus [single_device], on the CPU in real fp16
  test_amp_gpus [2 devices x 2], test_amp_gpu_ddp_slurm_  skipped: several CUDA devices, SLURM
    managed
  test_precision_16_clip_gradients [2]                    test_clipping_... (both)
models/test_hooks.py::test_trainer_model_hook_system_fit
  [16-mixed x 4]                                          test_hook_order_is_lightnings (both; the checkpoint's key:
                                                          difference)
  [deepspeed x 4]                                         skipped: DeepSpeed
trainer/optimization/test_backward_calls.py [5]           test_backward_... (both; LBFGS in fp16: both refuse)
trainer/optimization/test_multiple_optimizers.py [2]      test_two_optimizers_..., test_manual_two_optimizers_... (both)
trainer/optimization/test_manual_optimization.py [23]
  test_multiple_optimizers_manual_call_counts [2],        test_manual_two_optimizers_... (both); the scale when they
    _manual_log, _manual_amp                              overflow: test_several_optimizers_... (difference)
  test_manual_optimization_and_return_tensor              test_manual_steps_... (both; one process)
  test_manual_optimization_and_accumulated_gradient       test_manual_accumulation_... (both)
  test_multiple_optimizers_step [2]                       test_on_after_backward_sees_scaled_... (both; before Lightning
                                                          2.5.3 both refuse the Mapping; GradScaler's per-optimizer
                                                          stage is Lightning's internals, left out)
  test_step_with_optimizer_closure, _closure_2            test_a_closure_... (both)
  test_step_with_optimizer_closure_with_different_        test_closures_at_different_... (bf16 both; fp16: difference)
    frequencies
  ..._different_frequencies_ddp, _ddp_spawn, _ddp_with_   skipped: DDP on two CUDA devices
    toggle_model
  test_lr_schedulers, _reduce_lr_on_plateau [2],          test_manual_schedulers_... (both)
    test_lr_scheduler_step_not_called,
    test_manual_optimization_with_non_pytorch_scheduler
    [2]
  test_multiple_optimizers_logging [2]                    test_toggled_optimizers_log_... (both)
trainer/optimization/test_optimizers.py [36]
  test_optimizer_with_scheduling, test_multi_optimizer_   test_schedulers_step_when_lightning_says (both); with an
    with_scheduling, test_lr_scheduler_epoch_step_        overflowing step: test_a_skipped_step_holds_the_step_
    frequency [2], test_lr_scheduler_state_updated_       scheduler (difference)
    before_saving [3], test_plateau_scheduler_lr_step_
    interval_updated_after_saving [2], test_lr_
    scheduler_step_hook
  test_init_optimizers_during_evaluation_and_prediction   test_no_optimizers_outside_fit (both)
    [3]
  the other 23 (configure_optimizers parsing and its      skipped: Lightning's own parsing, before and apart from any
    errors; test_optimizer_state_on_device: 2 GPUs)       precision plugin
========================================================  ==============================================================
"""

import pickle
from collections.abc import Mapping
from inspect import getmembers, isfunction
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel, ManualOptimBoringModel
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from packaging.version import Version
from torch import nn
from torch.nn import functional as F

from lightning_mp import MixedPrecisionPlugin
from tests.conftest import device, trainer_kwargs

LIGHTNING_NAME = {"fp16": "16-mixed", "bf16": "bf16-mixed"}
DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
IMPLS = ("lightning", "ours")
INIT_SCALE = 2.0**8

pytestmark = pytest.mark.on_device  # every test here is Lightning's, run with either plugin


def make(impl, precision, init_scale=INIT_SCALE, growth_interval=2000):
    """A fresh plugin: Lightning's ``MixedPrecision`` with a GradScaler in fp16 (both on the test's device), or ours
    with the same knobs."""
    if impl == "ours":
        knobs = dict(init_scale=init_scale, growth_interval=growth_interval) if precision == "fp16" else {}
        return MixedPrecisionPlugin(precision, **knobs)
    scaler = torch.amp.GradScaler(device(), init_scale=init_scale, growth_interval=growth_interval)
    return MixedPrecision(LIGHTNING_NAME[precision], device(), scaler=scaler if precision == "fp16" else None)


def fit(model, plugin, seed=0, **kwargs):
    kwargs.setdefault("limit_val_batches", 0)
    trainer = L.Trainer(plugins=[plugin], **trainer_kwargs(**kwargs))
    L.seed_everything(seed, verbose=False)  # BoringModel's data is torch.randn at the dataloader's creation
    trainer.fit(model)
    return trainer


class count_steps:
    """Count ``optimizer.step`` calls that reach the optimizer (torch's public step hooks), for every optimizer
    created inside the block. A skipped step of either plugin never calls it."""

    def __init__(self):
        self.count = 0
        self._init = torch.optim.Optimizer.__init__

    def __enter__(self):
        counter, init = self, self._init

        def counting_init(opt, *args, **kwargs):
            init(opt, *args, **kwargs)
            opt.register_step_post_hook(lambda *_: setattr(counter, "count", counter.count + 1))

        self._patch = mock.patch.object(torch.optim.Optimizer, "__init__", counting_init)
        self._patch.start()
        return self

    def __exit__(self, *exc):
        self._patch.stop()


def counting_backward():
    """``Tensor.backward`` still runs (upstream mocks it away), so the optimizer sees real gradients."""
    return mock.patch.object(torch.Tensor, "backward", autospec=True, side_effect=torch.Tensor.backward)


both_formats = pytest.mark.parametrize("precision", ["fp16", "bf16"])
both_impls = pytest.mark.parametrize("impl", IMPLS)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)  # the models' initial weights; fit() seeds the data


# ------------------------------------------------------------------------------ plugins/precision/test_amp.py
class RecordingSGD(torch.optim.SGD):
    """Records what the optimizer receives: the largest gradient and the total norm, after any clipping."""

    def __init__(self, params, seen):
        super().__init__(params, lr=0.01)
        self.seen = seen

    def step(self, closure=None):
        loss = None
        if closure is not None:  # bf16-mixed hands the step a closure that runs the backward and the clipping
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.stack([g.norm() for g in grads]).norm().item()
        self.seen.append((max(g.abs().max().item() for g in grads), norm))
        super().step()
        return loss


class ClipModel(BoringModel):
    def __init__(self):
        super().__init__()
        self.seen = []

    def configure_optimizers(self):
        return RecordingSGD(self.parameters(), self.seen)


@both_impls
@both_formats
@pytest.mark.parametrize("algorithm, clip_val", [(None, 0), ("value", 1e-3), ("norm", 1e-2)])
def test_clipping_runs_only_with_a_clip_val_and_the_optimizer_gets_clipped_gradients(
    impl, precision, algorithm, clip_val
):
    """test_amp.py::test_clip_gradients and models/test_amp.py::test_precision_16_clip_gradients: no clipping
    without a ``gradient_clip_val``; with one, the chosen algorithm, and the optimizer reads clipped (and, in fp16,
    unscaled) gradients."""
    model = ClipModel()
    with (
        mock.patch("torch.nn.utils.clip_grad_norm_", wraps=torch.nn.utils.clip_grad_norm_) as by_norm,
        mock.patch("torch.nn.utils.clip_grad_value_", wraps=torch.nn.utils.clip_grad_value_) as by_value,
    ):
        fit(model, make(impl, precision), max_steps=3, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)
    assert (by_norm.call_count, by_value.call_count) == {None: (0, 0), "value": (0, 3), "norm": (3, 0)}[algorithm]
    assert len(model.seen) == 3  # no step skipped
    largest, norm = map(torch.tensor, zip(*model.seen))
    if algorithm is None:
        # BoringModel's true gradients (norms of 4 to 12), far above the clip values below; still scaled by 2**8,
        # they would be in the thousands
        assert ((norm > 1.0) & (norm < 100.0)).all()
    elif algorithm == "value":
        assert (largest <= clip_val).all()
    else:
        assert torch.allclose(norm, torch.full_like(norm, clip_val), rtol=1e-3)


class FusedAdamModel(BoringModel):
    def __init__(self, fused=True):
        super().__init__()
        self.fused = fused

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2, fused=self.fused)


@both_impls
@both_formats
def test_a_fused_optimizer_with_clipping_is_refused_by_lightnings_and_clips_with_ours(impl, precision):
    """test_amp.py::test_optimizer_amp_scaling_support_in_step_method. Lightning's refuses it in both formats (the
    fused step would unscale, and clipping needs unscaled gradients first)."""
    model = FusedAdamModel()
    if impl == "lightning":
        with pytest.raises(RuntimeError, match="does not allow for gradient clipping.*fused"):
            fit(model, make(impl, precision), max_steps=2, gradient_clip_val=1e-2)
        return
    # docs/behaviour.md, comparison table: "| fused optimizers and clipping | refused with `16-mixed` and
    # `bf16-mixed` | work |"
    before = [p.detach().clone() for p in model.parameters()]
    with mock.patch("torch.nn.utils.clip_grad_norm_", wraps=torch.nn.utils.clip_grad_norm_) as clip:
        trainer = fit(model, make(impl, precision), max_steps=2, gradient_clip_val=1e-2)
    assert clip.call_count == 2 and trainer.global_step == 2
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@both_impls
@both_formats
def test_a_no_grad_forward_inside_autocast_keeps_gradient_tracking(impl, precision):
    """test_amp.py::test_amp_with_no_grad."""
    plugin = make(impl, precision)
    # the plugin's device: ours computes on the CPU until a Trainer connects it (``device``), Lightning's on its own
    layer, x = nn.Linear(2, 1).to(plugin.device), torch.randn(1, 2, device=plugin.device)
    with plugin.autocast_context_manager():
        with torch.no_grad():
            layer(x)
        out = layer(x)
        loss = out.mean()
    loss.backward()
    assert loss.grad_fn is not None and out.dtype == DTYPE[precision]
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.float32


# ------------------------------------------------------------------ plugins/precision/test_amp_integration.py
class ScalerSeen(FusedAdamModel):
    def configure_optimizers(self):
        self.scaler = self.trainer.precision_plugin.scaler
        return super().configure_optimizers()


@both_impls
@both_formats
def test_fused_and_for_loop_adam_train_alike(impl, precision):
    """test_amp_integration.py::test_amp_fused_optimizer_parity (CUDA upstream; torch has a fused CPU Adam too)."""
    runs = []
    for fused in (False, True):
        torch.manual_seed(1234)
        model = ScalerSeen(fused)
        fit(model, make(impl, precision), max_steps=5)
        runs.append(model)
    for p, q in zip(*(run.parameters() for run in runs)):
        torch.testing.assert_close(p, q)
    scaler = runs[0].scaler
    if precision == "bf16":
        assert scaler is None  # both
    elif impl == "lightning":
        assert isinstance(scaler, torch.amp.GradScaler)
    else:
        # docs/behaviour.md, "Code written for Lightning's `MixedPrecision`": "otherwise a read-only view that
        # answers what code asks a `GradScaler`"
        assert not isinstance(scaler, torch.amp.GradScaler)
        assert scaler.is_enabled() and scaler.get_scale() == INIT_SCALE


class SkipsOddBatches(BoringModel):
    def training_step(self, batch, batch_idx):
        if batch_idx % 2:
            return None  # Lightning's convention: no backward, no step for this batch
        return super().training_step(batch, batch_idx)


@both_impls
@both_formats
def test_a_training_step_returning_none_skips_the_scaler_too(impl, precision):
    """test_amp_integration.py::test_skip_training_step_with_grad_scaler: 5 batches, 3 with a loss. Upstream counts
    the GradScaler's unscale_/step/update calls (3 each); here the scale shows it: with ``growth_interval=2``, 3
    updates grow it once and leave the tracker at 1 (5 would grow it twice)."""
    with count_steps() as steps:
        trainer = fit(SkipsOddBatches(), make(impl, precision, growth_interval=2), max_steps=5, gradient_clip_val=0.5)
    assert trainer.global_step == 5
    scaler = trainer.precision_plugin.scaler
    if precision == "fp16":
        assert steps.count == 3  # both
        assert scaler.get_scale() == 2 * INIT_SCALE and scaler.state_dict()["_growth_tracker"] == 1
        return
    assert scaler is None
    if impl == "lightning":
        assert steps.count == 5  # bf16-mixed calls optimizer.step(closure) and the closure returns None
    else:
        # docs/behaviour.md, "Skipped steps": "A `training_step` that returns `None` skips the optimizer, as under
        # `16-mixed`: `optimizer.step` is not called (under `bf16-mixed` and without a plugin it is called with a
        # closure that returns `None`, and parameters without gradients do not move either way)."
        assert steps.count == 3


# ---------------------------------------------------- plugins/precision/test_all.py, test_half.py, test_double.py
@both_impls
@both_formats
def test_contexts_restore_autocast_and_the_default_dtype_after_an_error(impl, precision):
    """test_all.py::test_default_dtype_is_restored, for the mixed plugins: neither context changes the default dtype
    (HalfPrecision's and DoublePrecision's do), the forward's turns autocast on, and both undo everything when the
    block raises."""
    plugin = make(impl, precision)
    on = plugin.device  # ours: "cpu" until a Trainer connects it; Lightning's: the device it was made for
    for context in (plugin.module_init_context, plugin.forward_context):
        with pytest.raises(RuntimeError, match="foo"), context():
            assert torch.get_default_dtype() is torch.float32
            if context == plugin.forward_context:
                assert torch.is_autocast_enabled(on) and torch.get_autocast_dtype(on) == DTYPE[precision]
            raise RuntimeError("foo")
        assert torch.get_default_dtype() is torch.float32 and not torch.is_autocast_enabled(on)


class BuiltInConfigureModel(LightningModule):
    def configure_model(self):
        self.l = nn.Linear(1, 3)
        self.dtype_inside = self.l.weight.dtype  # under the plugin's module_init_context

    def test_step(self, batch, batch_idx):
        self.out_dtype = self.l(batch.float().view(1, 1)).dtype


@both_impls
@both_formats
def test_modules_built_under_the_plugin_keep_fp32_parameters(impl, precision):
    """test_half.py's test_module_init_context, test_convert_module and test_configure_model, for mixed precision:
    parameters stay FP32 (``*-true`` would make them 16-bit); the computation is 16-bit."""
    plugin = make(impl, precision)
    with plugin.module_init_context():
        built = nn.Linear(2, 2)
    assert built.weight.dtype == plugin.convert_module(nn.Linear(2, 2)).weight.dtype == torch.float32
    model = BuiltInConfigureModel()
    L.Trainer(plugins=[plugin], **trainer_kwargs()).test(model, [torch.tensor([1.0])], verbose=False)
    assert model.dtype_inside == model.l.weight.dtype == torch.float32
    assert model.out_dtype == DTYPE[precision]


class Pickles(Callback):
    def on_train_batch_end(self, trainer, pl_module, *args):
        self.copy = pickle.loads(pickle.dumps(pl_module))


@both_impls
@both_formats
def test_the_model_pickles_mid_fit_as_its_own_classes(impl, precision):
    """test_double.py::test_double_precision_pickle (the model pickles once the plugin is connected), mid-fit."""
    spy = Pickles()
    model = BoringModel()
    fit(model, make(impl, precision), max_steps=1, callbacks=[spy])
    assert type(spy.copy) is BoringModel and type(spy.copy.layer) is nn.Linear
    assert spy.copy.layer.weight.dtype == torch.float32
    assert torch.equal(spy.copy.layer.weight.cpu(), model.layer.weight)  # pickled mid-fit, on the device


# ---------------------------------------------------------------------------------------- models/test_amp.py
class AMPTestModel(BoringModel):
    """Upstream's model: every step runs under autocast and computes in the 16-bit format; the batch arrives FP32
    (test_double.py's fact from the other side: a mixed plugin casts no inputs)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def _check(self, batch, out):
        plugin = self.trainer.precision_plugin
        expected = torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16
        self.seen.append((torch.is_autocast_enabled(batch.device.type), batch.dtype, out.dtype == expected))

    def step(self, batch):
        out = self(batch)
        self._check(batch, out)
        return self.loss(out)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        out = self(batch)
        self._check(batch, out)
        return out


@both_impls
@both_formats
def test_steps_run_under_autocast_in_the_16_bit_format(impl, precision):
    """models/test_amp.py::test_amp_cpus [single_device] and test_amp_gpus [1 device], on the test's device."""
    limits = dict(limit_train_batches=1, limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1)
    model = AMPTestModel()
    trainer = fit(model, make(impl, precision), max_epochs=1, **limits)
    trainer.test(model, verbose=False)
    trainer.predict(model, return_predictions=False)
    assert trainer.precision_plugin.precision == LIGHTNING_NAME[precision]  # the attribute upstream reads
    assert model.seen == [(True, torch.float32, True)] * 4  # train, validation, test, predict


@pytest.mark.parametrize("impl", ["lightning", "ours"])
def test_the_plugin_says_its_device(impl):
    """models/test_amp.py's AMPTestModel: ``if self.trainer.precision_plugin.device == "cpu"``."""
    trainer = fit(BoringModel(), make(impl, "bf16"), max_steps=1)
    assert trainer.precision_plugin.device == device()


# ---------------------------------------------------------------------------------------- models/test_hooks.py
def members(cls):
    return {h for h, _ in getmembers(cls, predicate=isfunction) if not h.startswith("_")}


# every LightningModule hook, and nn.Module's forward, zero_grad and train (upstream's selection)
MODULE_HOOKS = (members(LightningModule) - {"optimizers", "log", "log_dict", "configure_sharded_model"}) - (
    members(nn.Module) - {"forward", "zero_grad", "train"}
)


def record_calls(obj, names, called, prefix=""):
    """Wrap ``obj``'s methods: each appends its name to ``called`` when it returns (so a hook that calls another is
    listed after it, as upstream records them)."""
    for name in names:
        fn = getattr(obj, name)

        def wrapper(*args, _fn=fn, _name=prefix + name, **kwargs):
            out = _fn(*args, **kwargs)
            called.append(_name)
            return out

        setattr(obj, name, wrapper)


class HookedModel(BoringModel):
    def __init__(self, called, automatic):
        super().__init__()
        self.automatic_optimization, self.called = automatic, called
        record_calls(self, MODULE_HOOKS, called)

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        loss = self.step(batch[0])
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step(lambda: self.called.append("closure"))
        return {"loss": loss}

    def configure_model(self): ...  # overridden so that it is called


class HookedCallback(Callback):
    def __init__(self, called):
        self.checkpoint_keys = []
        record_calls(self, members(Callback), called, "Callback.")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.checkpoint_keys.append(set(checkpoint))


# One training batch as upstream's expected list has it, from the forward to the batch's end.
AUTOMATIC_BATCH = [
    "forward", "training_step", "Callback.on_before_zero_grad", "on_before_zero_grad", "optimizer_zero_grad",
    "Callback.on_before_backward", "on_before_backward", "backward", "Callback.on_after_backward",
    "on_after_backward", "Callback.on_before_optimizer_step", "on_before_optimizer_step", "clip_gradients",
    "configure_gradient_clipping", "optimizer_step",
]  # fmt: skip
MANUAL_BATCH = [
    "forward", "Callback.on_before_backward", "on_before_backward", "backward", "Callback.on_after_backward",
    "on_after_backward", "manual_backward", "closure", "Callback.on_before_optimizer_step",
    "on_before_optimizer_step", "training_step",
]  # fmt: skip


@both_formats
@pytest.mark.parametrize("automatic", [True, False])
def test_hook_order_is_lightnings(tmp_path, precision, automatic):
    """models/test_hooks.py::test_trainer_model_hook_system_fit [16-mixed]: every hook of a fit with validation and
    a checkpoint, in the same order under both plugins, and a batch's hooks in upstream's order."""
    calls, keys = {}, {}
    for impl in IMPLS:
        called = []
        callback = HookedCallback(called)
        trainer = L.Trainer(
            plugins=[make(impl, precision)],
            callbacks=[callback],
            **trainer_kwargs(default_root_dir=tmp_path / impl, enable_checkpointing=True),
            max_epochs=1,
            limit_train_batches=2,
            limit_val_batches=2,
        )
        trainer.fit(HookedModel(called, automatic))
        calls[impl], (keys[impl],) = called, callback.checkpoint_keys
    assert calls["ours"] == calls["lightning"]
    batch = AUTOMATIC_BATCH if automatic else MANUAL_BATCH
    start = calls["ours"].index("forward", calls["ours"].index("Callback.on_train_batch_start"))
    assert calls["ours"][start : start + len(batch)] == batch
    # docs/behaviour.md, "Checkpoints": "The plugin's state (a version, the scale, growth tracker, hysteresis counter
    # and skip counts) is saved under `checkpoint["MixedPrecisionPlugin"]`" (also in bf16, where Lightning's
    # MixedPrecision saves nothing: its state_dict() is empty without a GradScaler)
    assert keys["ours"] - keys["lightning"] == {"MixedPrecisionPlugin"}
    assert keys["lightning"] - keys["ours"] == ({"MixedPrecision"} if precision == "fp16" else set())


# ---------------------------------------------------------------- trainer/optimization/test_backward_calls.py
@both_formats
@pytest.mark.parametrize("num_steps", [1, 2, 3])
def test_backward_runs_once_per_step_and_never_in_test(precision, num_steps):
    """test_backward_calls.py::test_backward_count_simple."""
    for impl in IMPLS:
        model = BoringModel()
        with counting_backward() as backward:
            trainer = fit(model, make(impl, precision), max_steps=num_steps, limit_test_batches=2)
        assert backward.call_count == num_steps, impl
        with counting_backward() as backward:
            trainer.test(model, verbose=False)  # limit_test_batches=2
        assert backward.call_count == 0, impl


@both_impls
@both_formats
def test_backward_runs_once_per_batch_when_accumulating(impl, precision):
    """test_backward_calls.py::test_backward_count_with_grad_accumulation."""
    with counting_backward() as backward:
        trainer = fit(
            BoringModel(), make(impl, precision), max_epochs=1, limit_train_batches=6, accumulate_grad_batches=2
        )
    assert (backward.call_count, trainer.global_step) == (6, 3)
    with counting_backward() as backward:
        fit(BoringModel(), make(impl, precision), max_steps=3, accumulate_grad_batches=2)
    assert backward.call_count == 6


class LBFGSModel(BoringModel):
    def configure_optimizers(self):
        # negative tolerances: LBFGS runs all max_iter iterations, so it evaluates the closure exactly 3 times
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3, tolerance_grad=-1, tolerance_change=-1)


@both_impls
@both_formats
def test_backward_counts_with_lbfgs_closures(impl, precision):
    """test_backward_calls.py::test_backward_count_with_closure (upstream mocks backward away, so LBFGS stops after
    one evaluation; here it runs: 3 evaluations per step, plus one accumulating batch with
    ``accumulate_grad_batches=2``). fp16 with a dynamic scale: both refuse LBFGS."""
    plugin = make(impl, precision)
    if precision == "fp16":
        # docs/behaviour.md, "Other strategies and optimizers": "With a dynamic scale it is refused with a clear
        # error: a step that overflows in the middle of a line search cannot be skipped."
        error = (MisconfigurationException, "AMP and the LBFGS optimizer are not compatible")
        if impl == "ours":
            error = (ValueError, r"LBFGS re-evaluates its closure.*HINT: ")
        with pytest.raises(error[0], match=error[1]):
            fit(LBFGSModel(), plugin, max_steps=2)
        return
    with counting_backward() as backward:
        fit(LBFGSModel(), plugin, max_steps=2)
    assert backward.call_count == 2 * 3
    with counting_backward() as backward:
        fit(LBFGSModel(), make(impl, precision), max_steps=2, accumulate_grad_batches=2)
    assert backward.call_count == 2 * (1 + 3)


# --------------------------------------------------------- trainer/optimization/test_multiple_optimizers.py
@both_impls
def test_two_optimizers_need_manual_optimization(impl):
    """test_multiple_optimizers.py::test_multiple_optimizers_automatic_optimization_raises: Lightning's checks, with
    either plugin in place."""

    class WithOptimizerIdx(BoringModel):
        def training_step(self, batch, batch_idx, optimizer_idx):
            return super().training_step(batch, batch_idx)

    class TwoAdams(BoringModel):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters()), torch.optim.Adam(self.parameters())

    with pytest.raises(RuntimeError, match="Remove the `optimizer_idx` argument from `training_step`"):
        fit(WithOptimizerIdx(), make(impl, "fp16"), max_steps=1)
    with pytest.raises(RuntimeError, match="multiple optimizers is only supported with manual optimization"):
        fit(TwoAdams(), make(impl, "fp16"), max_steps=1)


# ------------------------------------------------------- trainer/optimization/test_manual_optimization.py
class ManualOptModel(BoringModel):
    """Upstream's: two SGD optimizers over one layer; the second backward twice (``retain_graph``)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.grads_none = []

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        self.grads_none.append(self.layer.weight.grad is None)
        loss_1 = self.step(batch[0])
        self.manual_backward(loss_1)
        opt_a.step()
        opt_a.zero_grad()
        self.grads_none.append(self.layer.weight.grad is None)
        loss_2 = self.step(batch[0])
        self.manual_backward(loss_2, retain_graph=True)
        self.manual_backward(loss_2)
        self.grads_none.append(self.layer.weight.grad is None)
        opt_b.step()
        opt_b.zero_grad()
        self.grads_none.append(self.layer.weight.grad is None)
        self.log("a", loss_2, on_epoch=True)
        return loss_2

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.layer.parameters(), lr=0.1)


@both_impls
@both_formats
def test_manual_two_optimizers_call_counts_and_logs(impl, precision):
    """test_manual_optimization.py::test_multiple_optimizers_manual_call_counts, _manual_log and _manual_amp, and
    test_multiple_optimizers.py::test_multiple_optimizers_manual: 3 backwards and 2 steps per batch, no gradient
    left after ``zero_grad``. Upstream counts GradScaler.step in fp16; here the steps that reach the optimizer."""
    model = ManualOptModel()
    trainer = L.Trainer(
        plugins=[make(impl, precision)], **trainer_kwargs(), limit_train_batches=2, limit_val_batches=0, max_epochs=1
    )
    with (
        mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward) as backward,
        count_steps() as steps,
    ):
        trainer.fit(model)
    assert (backward.call_count, trainer.global_step, steps.count) == (2 * 3, 2 * 2, 2 * 2)
    assert model.grads_none == [True, True, False, True] * 2
    assert set(trainer.logged_metrics) == {"a_step", "a_epoch"}


class RecordScale(Callback):
    def __init__(self):
        self.scales = []

    def on_train_batch_end(self, trainer, *args):
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


class PoisonedTwoOptimizers(ManualOptModel):
    """ManualOptModel whose losses are made inf for the optimizers named in ``faults[batch_idx]``."""

    def __init__(self, faults):
        super().__init__()
        self.faults = faults

    def training_step(self, batch, batch_idx):
        self.losses_left = list("ab")  # ManualOptModel computes opt_a's loss, then opt_b's
        self.poisoned = self.faults.get(batch_idx, "")
        return super().training_step(batch, batch_idx)

    def step(self, batch):
        loss = super().step(batch)
        return loss * float("inf") if self.losses_left.pop(0) in self.poisoned else loss


@both_impls
def test_several_optimizers_move_the_scale_once_per_training_step_not_once_per_optimizer(impl):
    """test_multiple_optimizers_manual_call_counts [16-mixed] with overflows: batch 0 overflows at both optimizers,
    batch 1 at the second, batch 3 at the first. The scales after each batch, and the steps that reached the
    optimizers (8 asked for)."""
    record = RecordScale()
    with count_steps() as steps:
        fit(PoisonedTwoOptimizers({0: "ab", 1: "b", 3: "a"}), make(impl, "fp16"), max_epochs=1, limit_train_batches=4,
            callbacks=[record])  # fmt: skip
    if impl == "lightning":
        # its GradScaler backs off at each optimizer's overflow, and the second optimizer steps after the first
        # one's overflow in batch 3
        assert record.scales == [2.0**6, 2.0**5, 2.0**5, 2.0**4] and steps.count == 0 + 1 + 2 + 1
        return
    # docs/behaviour.md, comparison table: "| several optimizers | the scale moves once per optimizer (grows too
    # fast) | once per training step |"; and "Skipped steps": "With manual optimization, an overflow found at one
    # optimizer's step skips every later optimizer step in that `training_step`. An optimizer that already stepped
    # on finite gradients stays stepped." (batch 1: the first optimizer steps, the second does not)
    assert record.scales == [2.0**7, 2.0**6, 2.0**6, 2.0**5] and steps.count == 0 + 1 + 2 + 0


class ExtendedManualModel(BoringModel):
    """test_manual_optimization_and_return_tensor / _and_accumulated_gradient: backward on every ``backward_every``-th
    batch (counting from ``first``), a step on every ``step_every``-th; records what each batch did to the weight."""

    def __init__(self, backward_every, step_every, first):
        super().__init__()
        self.automatic_optimization = False
        self.backward_every, self.step_every, self.count = backward_every, step_every, first
        self.seen = []

    def on_train_batch_start(self, batch, batch_idx):
        self.before = self.layer.weight.clone()

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.step(batch)
        loss = loss / loss.clone().detach() * 0.1
        if self.count % self.backward_every == 0:
            self.manual_backward(loss)
            if self.count % self.step_every == 0:
                opt.step()
                opt.zero_grad()
        return loss  # returned, never back-propagated by Lightning in manual optimization

    def on_train_batch_end(self, *args):
        grad = self.layer.weight.grad
        moved = not torch.equal(self.before, self.layer.weight)
        self.seen.append((moved, None if grad is None else bool(grad.abs().sum() > 0)))
        self.count += 1


@both_impls
@both_formats
def test_manual_steps_move_the_weights_only_when_asked(impl, precision):
    """test_manual_optimization.py::test_manual_optimization_and_return_tensor (two CUDA devices, ddp_spawn, fp16
    upstream; one CPU process here): a step on every second batch, and the returned loss adds no backward."""
    model = ExtendedManualModel(backward_every=2, step_every=2, first=0)
    fit(model, make(impl, precision), max_epochs=1, limit_train_batches=6)
    assert model.seen == [(True, None), (False, None)] * 3


@both_impls
@both_formats
def test_manual_accumulation_steps_every_fourth_batch(impl, precision):
    """test_manual_optimization.py::test_manual_optimization_and_accumulated_gradient: a backward every second
    batch, a step every fourth; the accumulated gradient is there in between, gone after the step."""
    model = ExtendedManualModel(backward_every=2, step_every=4, first=1)
    fit(model, make(impl, precision), max_epochs=1, limit_train_batches=8)
    assert model.seen == [(False, None), (False, True), (False, True), (True, None)] * 2


class ScaledGradsModel(ManualOptModel):
    """test_multiple_optimizers_step: ``on_after_backward`` sees the scaled gradients (``scaler.get_scale()``
    times the true ones), ``on_before_optimizer_step`` the unscaled ones."""

    def __init__(self, dicttype):
        super().__init__()
        self.dicttype, self.checks = dicttype, []

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x = batch[0]
        loss_1 = self.loss(self(x))
        self.manual_backward(loss_1)
        opt_a.step()  # no zero_grad: opt_b's gradients add onto the unscaled ones
        loss_2 = self.loss(self(x))
        self.manual_backward(loss_2, retain_graph=True)
        self.manual_backward(loss_2, retain_graph=True)
        opt_b.step()
        opt_b.zero_grad()
        return self.dicttype(loss1=loss_1.detach(), loss2=loss_2.detach())

    def on_after_backward(self):
        scale = self.trainer.precision_plugin.scaler.get_scale()
        assert scale == INIT_SCALE
        self.unscaled = [p.grad / scale for p in self.parameters()]

    def on_before_optimizer_step(self, optimizer):
        self.checks.append(all(torch.allclose(p.grad, g) for p, g in zip(self.parameters(), self.unscaled)))


class CustomMapping(Mapping):
    """A Mapping that is not a dict, as upstream's."""

    def __init__(self, **kwargs):
        self._store = dict(kwargs)

    def __getitem__(self, key):
        return self._store[key]

    def __iter__(self):
        return iter(self._store)

    def __len__(self):
        return len(self._store)

    def copy(self):
        return CustomMapping(**self._store)


@both_impls
@pytest.mark.parametrize("dicttype", [dict, CustomMapping])
def test_on_after_backward_sees_scaled_and_the_step_unscaled_gradients(impl, dicttype):
    """test_manual_optimization.py::test_multiple_optimizers_step [dict, CustomMapping] (CUDA fp16 upstream)."""
    model = ScaledGradsModel(dicttype)
    trainer = L.Trainer(
        plugins=[make(impl, "fp16")], **trainer_kwargs(), limit_train_batches=2, limit_val_batches=0, max_epochs=1
    )
    if dicttype is CustomMapping and Version(L.__version__) < Version("2.5.3"):
        # Lightning's manual loop takes a non-dict Mapping from 2.5.3 on; before, it refuses one under any plugin
        with pytest.raises(MisconfigurationException, match="must either return a Tensor or have no return"):
            trainer.fit(model)
        return
    with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward) as backward:
        trainer.fit(model)
    assert backward.call_count == 2 * 3
    assert model.checks == [True] * 4


class MCDropoutClosure(BoringModel):
    """test_step_with_optimizer_closure: the closure back-propagates two dropout forwards and logs their mean."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.losses, self.seen = [], []

    def training_step(self, batch, batch_idx):
        grad_none = self.layer.weight.grad is None
        opt = self.optimizers()

        def compute_loss():
            return self.loss(F.dropout(self(F.dropout(batch[0], 0.1)), 0.1))

        def closure():
            losses = []
            for i in range(2):
                losses.append(compute_loss())
                self.manual_backward(losses[-1], retain_graph=i == 0)
            loss = torch.stack(losses).mean()
            self.losses.append(loss)
            self.log("train_loss", loss, on_step=True, prog_bar=True, on_epoch=True)
            assert losses[0] != losses[1]

        before = self.layer.weight.clone()
        opt.step(closure=closure)
        opt.zero_grad()
        self.seen.append((grad_none, not torch.equal(before, self.layer.weight)))


@both_impls
@both_formats
def test_a_closure_with_two_backwards_steps_and_logs(impl, precision):
    """test_manual_optimization.py::test_step_with_optimizer_closure."""
    model = MCDropoutClosure()
    trainer = L.Trainer(
        plugins=[make(impl, precision)], **trainer_kwargs(), limit_train_batches=2, limit_val_batches=0, max_epochs=1
    )
    L.seed_everything(1, verbose=False)
    with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward) as backward:
        trainer.fit(model)
    assert backward.call_count == 2 * 2
    assert model.seen == [(True, True)] * 2
    assert trainer.progress_bar_metrics["train_loss_step"] == model.losses[-1]
    assert trainer.progress_bar_metrics["train_loss_epoch"] == pytest.approx(torch.stack(model.losses).mean().item())


class BackwardTwiceClosure(BoringModel):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.moved = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self(batch[0]).sum()

        def closure():
            self.manual_backward(loss, retain_graph=True)
            self.manual_backward(loss)

        before = self.layer.weight.clone()
        opt.step(closure=closure)
        self.moved.append(not torch.equal(before, self.layer.weight))


@both_impls
@both_formats
def test_a_closure_that_backpropagates_one_loss_twice_steps(impl, precision):
    """test_manual_optimization.py::test_step_with_optimizer_closure_2."""
    model = BackwardTwiceClosure()
    trainer = L.Trainer(
        plugins=[make(impl, precision)], **trainer_kwargs(), limit_train_batches=4, limit_val_batches=0, max_epochs=1
    )
    with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward) as backward:
        trainer.fit(model)
    assert (backward.call_count, trainer.global_step, model.moved) == (4 * 2, 4, [True] * 4)


class GanClosures(BoringModel):
    """test_step_with_optimizer_closure_with_different_frequencies: the generator accumulates two batches and steps
    with a closure and a custom keyword, the discriminator steps every fourth batch."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt_gen, opt_dis = self.optimizers()

        def closure(key):
            def run():
                loss = self.loss(F.dropout(self(F.dropout(batch[0], 0.1)), 0.1))
                self.log(key, loss, on_step=True, on_epoch=True)
                self.manual_backward(loss)

            return run

        closure("loss_gen")()
        if batch_idx % 2 == 0:
            opt_gen.step(closure=closure("loss_gen"), optim="sgd")
            opt_gen.zero_grad()
        if batch_idx % 4 == 0:
            opt_dis.step(closure=closure("loss_dis"))
            opt_dis.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.Adam(self.layer.parameters(), lr=0.001)


@both_impls
@both_formats
def test_closures_at_different_frequencies_reach_the_optimizers(impl, precision):
    """Upstream replaces SGD.step and Adam.step with mocks and reads what they were called with."""
    with mock.patch("torch.optim.SGD.step") as sgd_step, mock.patch("torch.optim.Adam.step") as adam_step:
        trainer = fit(GanClosures(), make(impl, precision), max_epochs=1, limit_train_batches=8)
    calls = {name: [c for c in m.mock_calls if c[0] == ""] for name, m in (("sgd", sgd_step), ("adam", adam_step))}
    assert trainer.global_step == 4 + 2
    if impl == "lightning" and precision == "fp16":
        # 16-mixed runs the closure itself and hands its GradScaler's step no closure
        assert calls == {"sgd": [mock.call(optim="sgd")] * 4, "adam": [mock.call()] * 2}
        return
    # ours in fp16: docs/behaviour.md, comparison table: "| an optimizer that needs the closure (SAM) | `16-mixed`:
    # "requires a closure" (GradScaler gets none) | gets it in every format; ..."
    assert calls == {"sgd": [mock.call(closure=mock.ANY, optim="sgd")] * 4, "adam": [mock.call(closure=mock.ANY)] * 2}


class NotATorchScheduler:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def state_dict(self):
        return {}

    def load_state_dict(self, _):
        pass


@both_impls
def test_manual_schedulers_are_the_users_and_stepped_by_the_user(impl):
    """test_manual_optimization.py::test_lr_schedulers, test_lr_schedulers_reduce_lr_on_plateau [2],
    test_lr_scheduler_step_not_called and test_manual_optimization_with_non_pytorch_scheduler [2]."""

    class SameObjects(ManualOptimBoringModel):
        def training_step(self, batch, batch_idx):
            assert self.lr_schedulers() == [self.s1, self.s2]
            assert all(a is b for a, b in zip(self.lr_schedulers(), (self.s1, self.s2)))

        def configure_optimizers(self):
            o1, o2 = (torch.optim.SGD(self.parameters(), lr=0.1) for _ in range(2))
            self.s1, self.s2 = (torch.optim.lr_scheduler.StepLR(o, step_size=1) for o in (o1, o2))
            return [o1, o2], [self.s1, self.s2]

    fit(SameObjects(), make(impl, "fp16"), max_epochs=1, limit_train_batches=1)

    for as_dict in (True, False):

        class Plateau(ManualOptimBoringModel):
            def on_train_epoch_end(self):
                self.lr_schedulers().step(torch.tensor(0.0))  # the user steps it, with its metric

            def configure_optimizers(self):
                opt = torch.optim.SGD(self.parameters(), lr=0.1)
                sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
                self.plateau = sched
                return [opt], [dict(scheduler=sched, monitor="train_loss", interval="step") if as_dict else sched]

        model = Plateau()
        if as_dict:
            with pytest.warns(RuntimeWarning, match=r"\['monitor'\], but the keys will be ignored"):
                trainer = fit(model, make(impl, "fp16"), max_epochs=1, limit_train_batches=1)
            assert trainer.lr_scheduler_configs[0].interval == "step"
        else:
            fit(model, make(impl, "fp16"), max_epochs=1, limit_train_batches=1)
        assert model.plateau.last_epoch == 1

    with mock.patch("torch.optim.lr_scheduler.StepLR.step") as step:
        fit(ManualOptimBoringModel(), make(impl, "fp16"), max_steps=2)
    assert step.call_count == 1  # StepLR's own call at construction; manual optimization never steps it

    for automatic in (True, False):

        class Custom(BoringModel):
            def configure_optimizers(self):
                opt = torch.optim.SGD(self.layer.parameters(), lr=0.1)
                return [opt], [NotATorchScheduler(opt)]

        model = Custom()
        model.automatic_optimization = automatic
        if automatic:
            with pytest.raises(MisconfigurationException, match="doesn't follow PyTorch's LRScheduler"):
                fit(model, make(impl, "fp16"), max_epochs=0)
        else:
            fit(model, make(impl, "fp16"), max_epochs=0)


class ToggledGan(BoringModel):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        for name, opt in zip(("loss_d", "loss_g"), self.optimizers()):
            self.toggle_optimizer(opt)
            loss = self.step(batch)
            self.log(name, loss, prog_bar=True)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.untoggle_optimizer(opt)

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.layer.parameters(), lr=0.1)


@both_impls
@both_formats
def test_toggled_optimizers_log_their_losses(impl, precision):
    """test_manual_optimization.py::test_multiple_optimizers_logging [16-mixed] (CUDA upstream)."""
    trainer = fit(ToggledGan(), make(impl, precision), max_epochs=1, limit_train_batches=2)
    assert set(trainer.logged_metrics) == set(trainer.progress_bar_metrics) == {"loss_d", "loss_g"}


# ------------------------------------------------------------------- trainer/optimization/test_optimizers.py
class TwoSchedulersManual(ManualOptimBoringModel):
    init_lr = 5e-4

    def training_step(self, batch, batch_idx):
        opt1, opt2 = self.optimizers()
        loss = self.loss(self.step(batch))
        opt1.zero_grad()
        opt2.zero_grad()
        self.manual_backward(loss)
        opt1.step()
        opt2.step()

    def on_train_epoch_end(self):
        for scheduler in self.lr_schedulers():
            scheduler.step()

    def configure_optimizers(self):
        opts = [torch.optim.Adam(self.parameters(), lr=self.init_lr) for _ in range(2)]
        return opts, [torch.optim.lr_scheduler.StepLR(o, step_size=1) for o in opts]


class SchedulerState(BoringModel):
    """test_lr_scheduler_state_updated_before_saving: what the checkpoint holds of StepLR(gamma=10). ``lr=1e-3``
    (upstream: 1) keeps every fp16 step finite; ``fault_at`` makes those batches' losses inf."""

    def __init__(self, interval, fault_at=()):
        super().__init__()
        self.interval, self.fault_at = interval, fault_at

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        return {"loss": out["loss"] * float("inf")} if batch_idx in self.fault_at else out

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=10)
        return [opt], [dict(scheduler=sched, interval=self.interval)]

    def on_save_checkpoint(self, checkpoint):
        config = checkpoint["lr_schedulers"][0]
        self.saved = (self.trainer.global_step, config["_step_count"] - 1, config["_last_lr"])


class PlateauAndStep(BoringModel):
    def training_step(self, batch, batch_idx):
        self.log("foo", batch_idx)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters())
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        step = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        return [opt], [dict(scheduler=plateau, interval="step", monitor="foo"), dict(scheduler=step, interval="step")]

    def on_save_checkpoint(self, checkpoint):
        plateau, step = checkpoint["lr_schedulers"]
        self.saved = (plateau["last_epoch"], step["_step_count"] - 1)


class CustomEpochScheduler:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, epoch): ...

    def state_dict(self): ...

    def load_state_dict(self, state_dict): ...


class CustomSchedulerStep(BoringModel):
    def lr_scheduler_step(self, scheduler, metric):
        if isinstance(scheduler, torch.optim.lr_scheduler.StepLR):
            super().lr_scheduler_step(scheduler, metric)
        elif isinstance(scheduler, CustomEpochScheduler):
            scheduler.step(epoch=self.current_epoch)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.layer.parameters(), lr=1e-2)
        step = dict(scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=1), interval="step")
        return [opt], [step, CustomEpochScheduler(opt)]


@both_impls
def test_schedulers_step_when_lightning_says(tmp_path, impl):
    """test_optimizers.py: test_optimizer_with_scheduling, test_multi_optimizer_with_scheduling,
    test_lr_scheduler_epoch_step_frequency [2], test_lr_scheduler_state_updated_before_saving [3],
    test_plateau_scheduler_lr_step_interval_updated_after_saving [2], test_lr_scheduler_step_hook. Ours guards the
    ``interval="step"`` schedulers (held on a skipped step); on steps that are not skipped they step as Lightning's."""
    trainer = fit(BoringModel(), make(impl, "fp16"), max_epochs=1, limit_train_batches=4)
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == [pytest.approx(0.1 * 0.1)]

    model = TwoSchedulersManual()
    trainer = fit(model, make(impl, "fp16"), max_epochs=1, limit_train_batches=4)
    assert [g["lr"] for o in trainer.optimizers for g in o.param_groups] == [pytest.approx(model.init_lr * 0.1)] * 2

    for check_val_every_n_epoch in (1, 2):
        with mock.patch("torch.optim.lr_scheduler.StepLR.step") as step:
            fit(BoringModel(), make(impl, "fp16"), max_epochs=4, limit_train_batches=2, limit_val_batches=2,
                check_val_every_n_epoch=check_val_every_n_epoch)  # fmt: skip
        assert step.call_count == 4 + 1  # once per epoch, once at construction

    for every_n_train_steps, interval in ((None, "epoch"), (2, "step"), (2, "epoch")):
        model = SchedulerState(interval)
        dirpath = tmp_path / f"{every_n_train_steps}{interval}"
        checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=every_n_train_steps)
        fit(model, make(impl, "fp16"), max_epochs=1, limit_train_batches=2, limit_val_batches=1,
            callbacks=[checkpoint], enable_checkpointing=True)  # fmt: skip
        steps = 1 if interval == "epoch" else 2
        assert model.saved == (2, steps, [pytest.approx(1e-3 * 10**steps)])

    for save_on_train_epoch_end in (False, True):
        model = PlateauAndStep()
        checkpoint = ModelCheckpoint(dirpath=tmp_path / f"plateau{save_on_train_epoch_end}",
                                     save_on_train_epoch_end=save_on_train_epoch_end)  # fmt: skip
        fit(model, make(impl, "fp16"), max_epochs=1, limit_train_batches=4, limit_val_batches=1,
            callbacks=[checkpoint], enable_checkpointing=True)  # fmt: skip
        assert model.saved == (4 - (not save_on_train_epoch_end), 4)

    with (
        mock.patch.object(CustomEpochScheduler, "step") as epoch_step,
        mock.patch.object(torch.optim.lr_scheduler.StepLR, "step") as step,
    ):
        fit(CustomSchedulerStep(), make(impl, "fp16"), max_epochs=3, limit_train_batches=2)
    assert epoch_step.mock_calls == [mock.call(epoch=e) for e in range(3)]
    assert step.call_count == 3 * 2 + 1


@both_impls
def test_a_skipped_step_holds_the_step_scheduler(tmp_path, impl):
    """test_lr_scheduler_state_updated_before_saving [every_n_train_steps=2, interval="step"] with the first of the
    two steps overflowing: what the checkpoint holds."""
    model = SchedulerState("step", fault_at=(0,))
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)
    fit(model, make(impl, "fp16"), max_epochs=1, limit_train_batches=2, limit_val_batches=1, callbacks=[checkpoint],
        enable_checkpointing=True)  # fmt: skip
    if impl == "lightning":
        assert model.saved == (2, 2, [pytest.approx(1e-3 * 10**2)])  # its scheduler stepped on the skipped step
        return
    # docs/behaviour.md, comparison table: "| skipped step | the LR scheduler still steps | the schedule holds
    # (configurable) |"; "Skipped steps": "`interval="step"` LR schedulers do not advance on a skipped step
    # (`skip_scheduler_on_overflow=True`)."
    assert model.saved == (2, 1, [pytest.approx(1e-3 * 10)])


@both_impls
@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
def test_no_optimizers_outside_fit(impl, fn):
    """test_optimizers.py::test_init_optimizers_during_evaluation_and_prediction [3]."""
    trainer = L.Trainer(plugins=[make(impl, "fp16")], **trainer_kwargs(), fast_dev_run=2)
    kwargs = {"verbose": False} if fn != "predict" else {"return_predictions": False}
    getattr(trainer, fn)(TwoSchedulersManual(), datamodule=BoringDataModule(), **kwargs)
    assert trainer.lr_scheduler_configs == [] and trainer.optimizers == []
