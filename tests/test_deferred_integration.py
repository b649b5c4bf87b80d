"""A clean step makes no host read with a fused optimizer, under the Trainer and in a Fabric loop; skipped steps, the
scale curve, the held schedule, the logged tags and the stop are those of the host path, bit for bit
(:mod:`lightning_mp.numerics.deferred`). The host path is the same plugin with ``deferral.enabled = False``."""

import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_mp import LossScaleMonitor, MixedPrecisionPlugin
from lightning_mp.fabric import MixedPrecisionPlugin as FabricPlugin
from tests.conftest import TinyRegressor, regression_data, trainer_kwargs
from tests.host_reads import recording
from tests.test_callbacks_integration import events, scalars

pytestmark = pytest.mark.slow

OPTIMIZERS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),  # on the CPU: the for-loop implementation
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


class Model(TinyRegressor):
    def __init__(self, optimizer="adamw_fused", scheduler=False, **kwargs):
        super().__init__(**kwargs)
        self.kind, self.scheduler = optimizer, scheduler

    def configure_optimizers(self):
        opt = OPTIMIZERS[self.kind](self.parameters())
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.9**i)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Reads(Callback):
    """Per training step: (sync reads, deferred reads, the optimizer's own) from batch start to batch end."""

    def __init__(self, reads):
        self.reads, self.per_step = reads, []

    def on_train_batch_start(self, *args):
        self.reads.clear()
        self.reads.on = True

    def on_train_batch_end(self, *args):
        self.reads.on = False
        self.per_step.append((self.reads.sync, self.reads.deferred, self.reads.count("optimizer")))


class HostPath(Callback):
    """The reference: every flag read on the host before the step, as without deferral."""

    def on_train_start(self, trainer, pl_module):
        trainer.precision_plugin.core.step.deferral.enabled = False


class Record(Callback):
    """The learning rate each step used, and the parameters and optimizer state at the end."""

    def __init__(self):
        self.lrs = []

    def on_train_batch_start(self, trainer, *args):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_end(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        self.params = [p.detach().clone() for p in pl_module.parameters()]
        self.state = [v.clone() for p in pl_module.parameters() for v in opt.state[p].values()]


def fit(model, plugin, callbacks=(), **kwargs):
    trainer = L.Trainer(plugins=[plugin], callbacks=list(callbacks), **trainer_kwargs(**kwargs))
    trainer.fit(model, regression_data())
    return trainer


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_clean_trainer_step_with_a_fused_adamw_reads_nothing_on_the_host(precision):
    with recording(on=False) as reads:
        probe = Reads(reads)
        fit(Model(), MixedPrecisionPlugin(precision), [probe], max_steps=5)
    # step 1: the optimizer's first step reads its flag on the host (its state is created by a decided step); from
    # step 2 on no read during the step but the previous step's flag, from its copy, at the step's end
    assert probe.per_step == [(1, 0, 0), (0, 0, 0), (0, 1, 0), (0, 1, 0), (0, 1, 0)]


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_foreach", "sgd"])
def test_other_optimizers_read_the_flag_on_the_host_once_per_step(optimizer):
    with recording(on=False) as reads:
        probe = Reads(reads)
        fit(Model(optimizer), MixedPrecisionPlugin("bf16"), [probe], max_steps=3)
    assert [sync for sync, deferred, _ in probe.per_step] == [1, 1, 1]
    assert all(deferred == 0 for _, deferred, _ in probe.per_step)


def test_a_held_scheduler_reads_each_steps_flag_at_its_step():
    with recording(on=False) as reads:
        probe = Reads(reads)
        fit(Model(scheduler=True), MixedPrecisionPlugin("bf16"), [probe], max_steps=4)
    # no read before the optimizer step; the scheduler's step() reads this step's flag (after the step is queued)
    assert probe.per_step == [(1, 0, 0), (0, 1, 0), (0, 1, 0), (0, 1, 0)]
    with recording(on=False) as reads:
        probe = Reads(reads)
        fit(Model(scheduler=True), MixedPrecisionPlugin("bf16", skip_scheduler_on_overflow=False), [probe],
            max_steps=4)
    assert probe.per_step == [(1, 0, 0), (0, 0, 0), (0, 1, 0), (0, 1, 0)]


@pytest.mark.parametrize("scheduler", [False, True])
def test_skipped_steps_the_scale_curve_the_schedule_and_the_logged_tags_match_the_host_path(tmp_path, scheduler):
    faults = {1, 4, 5, 6, 10, 11}
    runs = {}
    for name, extra in (("device", []), ("host", [HostPath()])):
        record, logger = Record(), TensorBoardLogger(tmp_path / name)
        plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8, growth_interval=2, hysteresis=2,
                                      locate_overflows=False)
        L.seed_everything(0)
        fit(Model(scheduler=scheduler, fault_at=faults), plugin, [record, LossScaleMonitor(), *extra],
            logger=logger, log_every_n_steps=1, max_steps=14)
        acc = events(logger.log_dir)
        tags = {tag: scalars(acc, tag) for tag in ("precision/loss_scale", "precision/skipped_steps")}
        runs[name] = (record, tags, plugin.core.scaler.state_dict())
    (dev, dev_tags, dev_state), (host, host_tags, host_state) = runs["device"], runs["host"]
    assert dev_tags == host_tags and dev_state == host_state and dev_state["skipped_steps"] == len(faults)
    assert len({v for _, v in dev_tags["precision/loss_scale"]}) > 2  # the scale moved both ways
    assert dev.lrs == host.lrs
    assert all(torch.equal(a, b) for a, b in zip(dev.params, host.params))
    assert all(torch.equal(a, b) for a, b in zip(dev.state, host.state))


def test_max_consecutive_skips_stops_the_trainer_one_step_late():
    stops = {}
    for name, extra in (("device", []), ("host", [HostPath()])):
        plugin = MixedPrecisionPlugin("bf16", max_consecutive_skips=3, locate_overflows=False)
        model = Model(fault_at=set(range(2, 20)))
        with pytest.raises(FloatingPointError, match="3 optimizer steps in a row") as err:
            fit(model, plugin, extra, max_steps=20)
        stops[name] = (str(err.value), model.seen_batches)
    assert stops["device"][0] == stops["host"][0] and "at step 4" in stops["host"][0]
    assert stops["device"][1] == stops["host"][1] + 1  # one more batch before the host read the flag


def test_the_locator_names_the_next_skip_after_one_read_late(caplog):
    plugin = MixedPrecisionPlugin("bf16")  # locate_overflows=True, the default
    with caplog.at_level(logging.WARNING, logger="lightning_mp.plugin"):
        fit(Model(fault_at={3, 6}), plugin, max_steps=8)
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("step 3 skipped") and "on the device" in lines[0]
    assert lines[1].startswith("step 6 skipped") and plugin.last_overflow is not None  # located, read at once
    assert not plugin.core.step.deferral.enabled and plugin.skipped_steps == 2


def fabric_run(defer, faults=(), steps=6, reads=None):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricPlugin("fp16", init_scale=2.0**8,
                                                                          growth_interval=2)])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, optimizer = fabric.setup(model, optimizer)
    plugin = fabric._precision
    plugin.core.step.deferral.enabled = defer
    g = torch.Generator().manual_seed(1)
    per_step = []
    for i in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        if reads is not None:
            reads.clear()
            reads.on = True
        loss = nn.functional.mse_loss(model(x), y) * (float("inf") if i in faults else 1.0)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if reads is not None:
            reads.on = False
            per_step.append((reads.sync, reads.deferred))
    params = [p.detach().clone() for p in model.parameters()]
    return params, plugin.core.scaler.state_dict() | {"scale": plugin.loss_scale}, per_step


def test_a_clean_fabric_step_with_a_fused_adamw_reads_nothing_and_skips_match_the_host_path():
    with recording(on=False) as reads:
        *_, per_step = fabric_run(defer=True, reads=reads, steps=4)
    assert per_step == [(1, 0), (0, 0), (0, 1), (0, 1)]
    on_device, on_host = fabric_run(True, faults={2, 3}), fabric_run(False, faults={2, 3})
    assert on_device[1] == on_host[1] and on_device[1]["skipped_steps"] == 2
    assert all(torch.equal(a, b) for a, b in zip(on_device[0], on_host[0]))


def test_a_stop_at_the_last_step_of_a_fit_is_counted_not_raised():
    plugin = MixedPrecisionPlugin("bf16", max_consecutive_skips=2, locate_overflows=False)
    fit(Model(fault_at={3, 4}), plugin, max_steps=5)  # the host path raises at step 4, the fit's last
    assert plugin.skipped_steps == 2 and plugin.training_steps == 5 and plugin.last_step_skipped
