"""What the plugin leaves to Lightning's loop, against Lightning's own ``16-mixed`` on the same model (issue 45):

* a skipped step's gradients: the loop zeroes them through its ``optimizer_zero_grad`` hook, as under ``16-mixed``;
  the plugin calls no ``zero_grad`` of its own, and the skipped gradients never reach the next update, with
  gradient accumulation too (``docs/behaviour.md``, Skipped steps);
* Lightning's "The closure hasn't been executed" guard: the plugin evaluates the closure before the optimizer, so an
  optimizer whose ``step`` ignores its closure trains, as under ``16-mixed`` (``docs/behaviour.md``, closures)."""

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mp import MixedPrecisionPlugin
from tests.conftest import TinyRegressor, device, regression_data, trainer_kwargs

pytestmark = [pytest.mark.slow, pytest.mark.on_device]

FAULTS = (3, 7, 11, 15)  # batches whose loss is inf: 4 skipped steps in 20


def lightning_16_mixed():
    return MixedPrecision("16-mixed", device(), scaler=torch.amp.GradScaler(device()))


class Counting(TinyRegressor):
    """Counts ``optimizer.zero_grad`` calls, whoever makes them; ``drop_at``: batches whose ``training_step`` returns
    ``None`` (no backward, and the optimizer does not step: the reference run with those steps dropped)."""

    def __init__(self, drop_at=(), **kwargs):
        super().__init__(**kwargs)
        self.drop_at, self.batches, self.zero_grads = set(drop_at), 0, 0

    def training_step(self, batch, batch_idx):
        drop = self.batches in self.drop_at
        self.batches += 1
        loss = super().training_step(batch, batch_idx)
        return None if drop else loss

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        zero_grad = optimizer.zero_grad

        def counting(*args, **kwargs):
            self.zero_grads += 1
            return zero_grad(*args, **kwargs)

        optimizer.zero_grad = counting
        return optimizer


def run(plugin, accumulate=1, steps=20, **kwargs):
    torch.manual_seed(0)
    model = Counting(**kwargs)
    trainer = L.Trainer(plugins=[plugin], max_steps=steps, max_epochs=-1, accumulate_grad_batches=accumulate,
                        **trainer_kwargs())
    trainer.fit(model, regression_data(n=160))
    return model


def same_weights(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("optimizer", ["adamw", "adam_fused"])  # the flag read on the host, and left on the device
def test_skipped_steps_make_as_many_zero_grad_calls_as_16_mixed_and_drop_only_themselves(optimizer):
    plugin = MixedPrecisionPlugin("fp16")
    ours = run(plugin, fault_at=FAULTS, optimizer=optimizer)
    lightning = run(lightning_16_mixed(), fault_at=FAULTS, optimizer=optimizer)
    assert plugin.skipped_steps == 4
    assert ours.zero_grads == lightning.zero_grads == 20  # before: 24, one more per skipped step
    reference = run(MixedPrecisionPlugin("fp16"), drop_at=FAULTS, optimizer=optimizer)
    assert same_weights(ours, reference)  # the skipped steps' gradients reached no later update


def test_with_accumulation_a_skipped_window_is_dropped_whole_and_the_next_one_starts_clean():
    plugin = MixedPrecisionPlugin("fp16")
    ours = run(plugin, accumulate=2, steps=10, fault_at=(4,))  # the third window: batches 4 and 5
    lightning = run(lightning_16_mixed(), accumulate=2, steps=10, fault_at=(4,))
    assert plugin.skipped_steps == 1 and plugin.training_steps == 10
    assert ours.zero_grads == lightning.zero_grads == 10  # once per window, at its first backward
    reference = run(MixedPrecisionPlugin("fp16"), accumulate=2, steps=10, drop_at=(4, 5))
    assert same_weights(ours, reference)


class ClosureIgnoringSGD(torch.optim.SGD):
    """An optimizer whose ``step`` never calls its closure."""

    def step(self, closure=None):
        return super().step()


class IgnoresClosure(TinyRegressor):
    def configure_optimizers(self):
        return ClosureIgnoringSGD(self.parameters(), lr=0.1)


class ForgetsClosure(TinyRegressor):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step()  # the hook overridden without passing the closure on


@pytest.mark.parametrize("impl", ["lightning", "ours"])
def test_the_closure_guard_fires_as_under_16_mixed(impl):
    def fit(model):
        plugin = lightning_16_mixed() if impl == "lightning" else MixedPrecisionPlugin("fp16")
        L.Trainer(plugins=[plugin], max_steps=3, **trainer_kwargs()).fit(model, regression_data())

    torch.manual_seed(0)
    model = IgnoresClosure()
    before = [p.detach().clone() for p in model.parameters()]
    fit(model)  # the plugin evaluated the closure before the optimizer: no "closure hasn't been executed"
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # it stepped on those gradients
    with pytest.raises(MisconfigurationException, match="The closure hasn't been executed"):
        fit(ForgetsClosure())  # a closure nobody evaluates is still caught
