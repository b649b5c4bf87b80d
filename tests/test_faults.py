"""Fault injection: nothing may be lost or corrupted when gradients go non-finite, runs die, or checkpoints
come from elsewhere."""

import os
import signal
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from tests.conftest import TinyRegressor, TwoOptimizers, device, regression_data, trainer_kwargs
from tests.test_plugin_integration import Snapshot, fit, same_tree

RESUME_WORKER = os.path.join(os.path.dirname(__file__), "resume_worker.py")


@pytest.mark.on_device
def test_overflow_in_one_micro_batch_skips_the_whole_accumulation_window():
    snap = Snapshot()
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8, growth_interval=1000)
    # micro-batches 0..7 make steps 0..3; micro-batch 3 is the second half of step 1
    fit(TinyRegressor(fault_at={3}), plugin, max_steps=4, accumulate_grad_batches=2, callbacks=[snap])
    rows = snap.rows  # one row per micro-batch
    assert same_tree(rows[1]["weights"], rows[3]["weights"])  # step 1 applied nothing
    assert not same_tree(rows[3]["weights"], rows[5]["weights"])  # step 2 did
    assert rows[3]["scale"] == 2.0**7 and plugin.skipped_steps == 1  # backed off once for the whole window


@pytest.mark.on_device
def test_overflow_in_the_second_of_two_optimizers_skips_it_and_moves_the_scale_once():
    # the first optimizer stepped before the second backward produced the overflow; it cannot be undone, and is
    # not: what was applied used finite gradients. The sub-net with the overflow does not move.
    class LateFault(TwoOptimizers):
        def manual_backward(self, loss, *args, **kwargs):
            if self.trainer.global_step >= 2 and self.fault_now and loss.requires_grad and self._second:
                loss = loss * float("inf")
            self._second = not self._second
            super().manual_backward(loss, *args, **kwargs)

    model = LateFault()
    model._second, model.fault_now = False, False
    snap = Snapshot()

    class Arm(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            pl_module.fault_now = batch_idx == 1

    plugin = MixedPrecisionPlugin("fp16", init_scale=64.0, growth_interval=100)
    fit(model, plugin, max_steps=6, callbacks=[snap, Arm()])
    before, at = snap.rows[0], snap.rows[1]
    assert same_tree({k: v for k, v in before["weights"].items() if k.startswith("g.")},
                     {k: v for k, v in at["weights"].items() if k.startswith("g.")})
    assert not same_tree({k: v for k, v in before["weights"].items() if k.startswith("d.")},
                         {k: v for k, v in at["weights"].items() if k.startswith("d.")})
    assert at["scale"] == 32.0 and at["skipped"] == 1


@pytest.mark.on_device
@pytest.mark.parametrize("skip_scheduler, expected_halvings", [(True, 5), (False, 6)])
def test_skipped_step_does_not_advance_the_lr_schedule_by_default(skip_scheduler, expected_halvings):
    class Scheduled(TinyRegressor):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    model = Scheduled(fault_at={2}, lr=1.0)
    plugin = MixedPrecisionPlugin("bf16", skip_scheduler_on_overflow=skip_scheduler)
    trainer = fit(model, plugin, max_steps=6)
    assert trainer.global_step == 6
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.5**expected_halvings
    assert type(trainer.lr_scheduler_configs[0].scheduler) is torch.optim.lr_scheduler.StepLR  # guard removed


@pytest.mark.on_device
def test_checkpoint_taken_right_after_a_skipped_step_resumes_exactly(tmp_path):
    def plugin():
        return MixedPrecisionPlugin("fp16", init_scale=2.0**6, growth_interval=3)

    faults = {7}  # the last step of epoch 0: the epoch-end checkpoint follows a skipped step
    L.seed_everything(0)
    straight = TinyRegressor(fault_at=faults)
    fit(straight, plugin(), max_epochs=2)

    L.seed_everything(0)
    first = TinyRegressor(fault_at=faults)
    first_plugin = plugin()
    trainer = fit(first, first_plugin, max_epochs=1)
    assert first_plugin.last_step_skipped
    trainer.save_checkpoint(tmp_path / "after_skip.ckpt")
    resumed = TinyRegressor(fault_at=faults)
    resumed.seen_batches = 8
    trainer = L.Trainer(plugins=[plugin()], max_epochs=2, **trainer_kwargs())
    trainer.fit(resumed, regression_data(), ckpt_path=tmp_path / "after_skip.ckpt")
    assert same_tree(resumed.state_dict(), straight.state_dict())


@pytest.mark.slow
def test_run_killed_with_sigkill_resumes_from_last_checkpoint_to_the_same_weights(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    straight = tmp_path / "straight"
    killed = tmp_path / "killed"
    base = [sys.executable, RESUME_WORKER, "--epochs", "4"]
    subprocess.run([*base, "--dir", str(straight)], env=env, check=True, capture_output=True, timeout=240)

    proc = subprocess.Popen([*base, "--dir", str(killed), "--sleep", "0.05"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        while not (killed / "ckpt" / "epoch=1.ckpt").exists():  # mid-run: two epochs done, two to go
            assert proc.poll() is None, "the worker ended before it could be killed"
            assert time.time() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "final.pt").exists()
    subprocess.run([*base, "--dir", str(killed), "--resume"], env=env, check=True, capture_output=True, timeout=240)

    a, b = torch.load(straight / "final.pt"), torch.load(killed / "final.pt")
    assert a["global_step"] == b["global_step"] == 32
    assert same_tree(a["state"], b["state"])
    assert a["scaler"] == b["scaler"]


@pytest.mark.on_device
def test_checkpoint_of_lightning_16_mixed_hands_over_its_scale(tmp_path):
    native = MixedPrecision("16-mixed", device())
    trainer = fit(TinyRegressor(fault_at={1}), native, max_steps=3)
    native_scale = native.scaler.get_scale()
    assert native_scale == 2.0**15
    trainer.save_checkpoint(tmp_path / "native.ckpt")

    plugin = MixedPrecisionPlugin("fp16")
    seen = {}

    class Look(Callback):
        def on_train_start(self, trainer, pl_module):
            seen["scale"] = trainer.precision_plugin.loss_scale

    trainer = L.Trainer(plugins=[plugin], max_steps=5, callbacks=[Look()], **trainer_kwargs())
    trainer.fit(TinyRegressor(), regression_data(), ckpt_path=tmp_path / "native.ckpt")
    assert seen["scale"] == native_scale  # not silently reset to 2^16


@pytest.mark.on_device
def test_plain_fp32_checkpoint_resumes_with_the_configured_scale(tmp_path):
    trainer = fit(TinyRegressor(), None, max_steps=3)
    trainer.save_checkpoint(tmp_path / "fp32.ckpt")
    weights = torch.load(tmp_path / "fp32.ckpt", weights_only=False)["state_dict"]
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8)
    seen = {}

    class Look(Callback):
        def on_train_start(self, trainer, pl_module):
            seen["scale"] = trainer.precision_plugin.loss_scale
            seen["state"] = {k: v.clone().cpu() for k, v in pl_module.state_dict().items()}  # the checkpoint's: CPU

    trainer = L.Trainer(plugins=[plugin], max_steps=5, callbacks=[Look()], **trainer_kwargs())
    trainer.fit(TinyRegressor(), regression_data(), ckpt_path=tmp_path / "fp32.ckpt")
    assert seen["scale"] == 2.0**8
    assert same_tree(seen["state"], weights)  # the FP32 values, exactly, not their fp16 rounding


@pytest.mark.on_device
def test_scaler_state_from_a_static_run_does_not_override_a_dynamic_one(tmp_path):
    trainer = fit(TinyRegressor(), MixedPrecisionPlugin("fp16", loss_scale=8.0), max_steps=2)
    trainer.save_checkpoint(tmp_path / "static.ckpt")
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8)
    trainer = L.Trainer(plugins=[plugin], max_steps=3, **trainer_kwargs())
    trainer.fit(TinyRegressor(), regression_data(), ckpt_path=tmp_path / "static.ckpt")
    assert plugin.loss_scale == 2.0**8


@pytest.mark.on_device
def test_nan_in_the_forward_of_a_bf16_run_never_reaches_the_weights():
    class NanForward(TinyRegressor):
        def forward(self, x):
            out = self.net(x)
            if self.seen_batches == 2:
                out = out * torch.tensor(float("nan"), device=out.device)
            return out

    snap = Snapshot()
    fit(NanForward(), MixedPrecisionPlugin("bf16"), max_steps=5, callbacks=[snap])
    for row in snap.rows:
        assert all(torch.isfinite(v).all() for v in row["weights"].values())
    assert snap.rows[2]["last"] and snap.rows[2]["skipped"] == 1

def test_a_device_without_autocast_fails_at_setup():
    from lightning_mp.formats import check_device_supports as _check_device_supports
    from lightning_mp.formats import resolve_precision

    with pytest.raises(RuntimeError, match=r"precision='bf16'.*'meta'.*HINT"):
        _check_device_supports(resolve_precision("bf16"), "meta")
    _check_device_supports(resolve_precision("fp32"), "meta")  # fp32 needs nothing


@pytest.mark.on_device
def test_model_without_parameters_in_any_optimizer_trains_nothing_and_breaks_nothing():
    class NoOpt(TinyRegressor):
        def configure_optimizers(self):
            return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)

    model = NoOpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fit(model, MixedPrecisionPlugin("bf16"), max_steps=2)
    assert same_tree(before, model.state_dict())
