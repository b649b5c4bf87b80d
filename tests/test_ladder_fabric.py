"""The precision ``schedule`` under Fabric, one process (lightning_mp.core.ladder): each switch between optimizer
steps (the step count is the plugin's count of ``optimizer.step()`` calls), what each rung computes in, the
Parameters and optimizer state kept, and a checkpoint written before or after the switch resuming into the right
format at the right step, bit for bit."""

import gc
import logging

import lightning as L
import pytest
import torch
from torch import nn

from benchmarks.harness import live_storage_bytes
from lightning_mp.fabric import MixedPrecisionPlugin
from lightning_mp.fp8.linears import Fp8Forward

pytestmark = pytest.mark.usefixtures("fp8_needs_torchao")

SWITCH = 3  # the first optimizer step computed in the new setting
STEPS = 6


def net():
    torch.manual_seed(0)  # 16-wide Linears: torchao's FP8 matmul takes them (dims multiple of 16)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)  # the data of step s, whatever the process that computes it
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def plugin_for(precision, schedule, **kwargs):
    if precision == "lean":
        precision, kwargs = "bf16", {"master_weights": "compensated", **kwargs}
    if precision == "fp8":
        kwargs = {"fp8_modules": [nn.Linear], **kwargs}  # both Linears (the default keeps the output head in bf16)
    return MixedPrecisionPlugin(precision, schedule=schedule, **kwargs)


class Run:
    """A Fabric loop; per step what the user sees: the plugin's format, scale, masters (read before the forward), the
    first Linear's output dtype inside the forward, whether its forward is torchao's FP8 one, and the weights after."""

    def __init__(self, plugin):
        self.plugin = plugin
        self.fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        self.net = net()
        self.model, self.opt = self.fabric.setup(self.net, torch.optim.AdamW(self.net.parameters(), lr=1e-2))
        self.params = list(self.net.parameters())
        self.seen, self.steps, self.weights = [], [], []
        self.start = 0  # the next step
        seen = self.seen  # the hook holds the list, not the run: a dropped run's plugin is collected (its kernels go)
        self.net[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))

    def save(self, path):
        self.fabric.save(path, {"model": self.model, "optimizer": self.opt, "precision": self.plugin,
                                "step": self.start})

    def load(self, path):
        self.plugin.setup_optimizers(self.opt)  # lean bf16's documented resume order: its FP32 state stays FP32
        state = {"model": self.model, "optimizer": self.opt, "precision": self.plugin, "step": 0}
        self.fabric.load(path, state)
        self.start = state["step"]

    def train(self, steps, poison=()):
        for step in range(self.start, self.start + steps):
            x, y = batch(step)
            p = self.plugin
            row = {"step": step, "format": p.format.name, "scale": p.loss_scale, "scaler": p.scaler is not None,
                   "masters": p.core.masters is not None, "lean": p.core.lean is not None}
            out = self.model(x)
            row["dtype"] = self.seen[-1]
            # the FP8 forward is the Linear's own ``forward`` attribute for the fit (lightning_mp.fp8.linears)
            row["fp8"] = isinstance(self.net[0].__dict__.get("forward"), Fp8Forward)
            row["out"] = out.dtype
            loss = nn.functional.mse_loss(out, y)
            if step in poison:
                loss = loss * float("inf")
            self.fabric.backward(loss)
            self.opt.step()
            self.opt.zero_grad()
            self.steps.append(row)
            self.weights.append([t.detach().clone() for t in self.net.state_dict().values()])
        self.start += steps
        return self


def column(run, key):
    return [row[key] for row in run.steps]


def bitwise(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def final(run):
    return [t.detach() for t in run.net.state_dict().values()]


def test_fp16_to_bf16_retires_the_loss_scale_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="lightning_mp.schedule"):
        run = Run(plugin_for("fp16", {SWITCH: "bf16"}, init_scale=2.0**8)).train(STEPS, poison={1})
    before, after = [torch.float16] * SWITCH, [torch.bfloat16] * (STEPS - SWITCH)
    assert column(run, "format") == ["fp16"] * SWITCH + ["bf16"] * (STEPS - SWITCH)
    assert column(run, "dtype") == before + after  # what the Linears computed in, step by step
    assert column(run, "out") == [torch.float32] * STEPS  # the loop's loss is FP32 in both rungs
    # the scale: 2^8, halved by the overflow at step 1, then retired for good
    assert column(run, "scale") == [2.0**8, 2.0**8, 2.0**7] + [1.0] * (STEPS - SWITCH)
    assert column(run, "scaler") == [True] * SWITCH + [False] * (STEPS - SWITCH)
    assert run.plugin.loss_scale == 1.0 and run.plugin.scaler is None
    assert run.plugin.skipped_steps == 1 and run.plugin.training_steps == STEPS  # the counters carried over
    assert run.plugin.ladder.current == 1 and run.plugin.ladder.starts == [SWITCH]
    lines = [r.getMessage() for r in caplog.records if "precision schedule" in r.getMessage()]
    assert len(lines) == 1 and f"from step {SWITCH} on, bf16" in lines[0] and "loss scale retires" in lines[0]
    assert all(torch.isfinite(t).all() and t.dtype == torch.float32 for t in final(run))


def test_fp8_to_bf16_takes_the_fp8_forwards_off_the_same_parameters_and_keeps_the_optimizer_state():
    pytest.importorskip("torchao", reason="precision='fp8' needs torchao")
    run = Run(plugin_for("fp8", {SWITCH: "bf16"})).train(STEPS)
    assert column(run, "fp8") == [True] * SWITCH + [False] * (STEPS - SWITCH)
    assert column(run, "format") == ["fp8"] * SWITCH + ["bf16"] * (STEPS - SWITCH)
    assert column(run, "dtype") == [torch.bfloat16] * STEPS
    assert "forward" not in run.net[0].__dict__ and "forward" not in run.net[2].__dict__  # plain Linears again
    # the same Parameter objects, in the optimizer too, and AdamW's state went on from step SWITCH (not restarted)
    assert [id(p) for p in run.net.parameters()] == [id(p) for p in run.params]
    assert [id(p) for p in run.opt.param_groups[0]["params"]] == [id(p) for p in run.params]
    assert all(run.opt.state[p]["step"].item() == STEPS for p in run.params)
    # the bf16 rung computes as a bf16 run does from the same weights and optimizer state: the switch lost nothing
    reference = Run(plugin_for("bf16", None))
    reference.net.load_state_dict(dict(zip(reference.net.state_dict(), run.weights[SWITCH - 1])))
    reference.opt.load_state_dict(_opt_after(plugin_for("fp8", None), SWITCH))
    reference.start = SWITCH
    reference.train(STEPS - SWITCH)
    assert bitwise(final(reference), final(run))


def _opt_after(plugin, steps):
    """The optimizer state of a run of ``plugin`` after ``steps`` steps."""
    return Run(plugin).train(steps).opt.state_dict()


def test_lean_bf16_to_fp32_masters_rebuilds_the_masters_exactly():
    # in one process lean bf16 (bf16 Parameters + exact remainders, FP32 optimizer state) trains bit for bit as
    # bf16 with FP32 masters: the schedule's run must equal the masters' run at every step, across the switch
    run = Run(plugin_for("lean", {SWITCH: {"master_weights": True}})).train(STEPS)
    masters = Run(plugin_for("bf16", None)).train(STEPS)
    assert column(run, "lean") == [True] * SWITCH + [False] * (STEPS - SWITCH)
    assert column(run, "masters") == [False] * SWITCH + [True] * (STEPS - SWITCH)
    assert column(run, "dtype") == [torch.bfloat16] * STEPS
    for step, (a, b) in enumerate(zip(run.weights, masters.weights)):
        assert bitwise(a, b), step
    assert all(p.dtype == torch.float32 for p in run.net.parameters())
    moments = [v for s in run.opt.state.values() for k, v in s.items() if k != "step"]
    assert moments and all(v.dtype == torch.float32 for v in moments)


def test_bf16_to_fp32_computes_in_fp32_and_frees_the_16_bit_copies():
    run = Run(plugin_for("bf16", {SWITCH: "fp32"}))
    params = sum(p.numel() for p in run.net.parameters())

    def held_after(steps):  # every live tensor storage of the process, between two steps
        run.train(steps)
        run.weights.clear()
        gc.collect()
        return live_storage_bytes()

    before = held_after(SWITCH - 1)
    after = held_after(STEPS - SWITCH + 1)
    assert column(run, "dtype") == [torch.bfloat16] * SWITCH + [torch.float32] * (STEPS - SWITCH)
    assert column(run, "masters") == [True] * SWITCH + [False] * (STEPS - SWITCH)
    assert run.plugin.core.masters is None and run.plugin.format.name == "fp32"
    assert before - after >= 2 * params  # the bf16 copies' 2 bytes per parameter went (measured: exactly that)


CHECKPOINTED = [
    ("fp16", "bf16", {"init_scale": 2.0**8}, {1}),
    ("fp8", "bf16", {}, ()),
    ("lean", {"master_weights": True}, {}, ()),
    ("bf16", "fp32", {}, ()),
]


@pytest.mark.parametrize("saved_at", [SWITCH - 1, SWITCH, SWITCH + 1], ids=["before", "at", "after"])
@pytest.mark.parametrize("first, then, kwargs, poison", CHECKPOINTED, ids=[c[0] for c in CHECKPOINTED])
def test_a_checkpoint_across_the_switch_resumes_in_the_right_format_bit_for_bit(tmp_path, first, then, kwargs,
                                                                                   poison, saved_at):
    if first == "fp8":
        pytest.importorskip("torchao", reason="precision='fp8' needs torchao")
    schedule = {SWITCH: then}
    straight = Run(plugin_for(first, schedule, **kwargs)).train(STEPS, poison=poison)
    Run(plugin_for(first, schedule, **kwargs)).train(saved_at, poison=poison).save(tmp_path / "ckpt.pt")
    resumed = Run(plugin_for(first, schedule, **kwargs))
    resumed.load(tmp_path / "ckpt.pt")
    assert resumed.start == saved_at
    assert resumed.plugin.ladder.current == (saved_at >= SWITCH)  # the rung that wrote it
    assert resumed.plugin.training_steps == saved_at and resumed.plugin.skipped_steps == straight.plugin.skipped_steps
    resumed.train(STEPS - saved_at, poison=poison)
    # each resumed step computed as the uninterrupted run's same step did
    for key in ("format", "dtype", "fp8", "scale", "masters", "lean"):
        assert column(resumed, key) == column(straight, key)[saved_at:], key
    assert bitwise(final(resumed), final(straight))
    assert resumed.plugin.core.scaler.state_dict() == straight.plugin.core.scaler.state_dict()


@pytest.mark.parametrize("first, then, kwargs, poison", CHECKPOINTED, ids=[c[0] for c in CHECKPOINTED])
def test_a_rollback_past_the_switch_goes_back_to_the_first_rung_and_switches_again(tmp_path, first, then, kwargs,
                                                                                  poison):
    if first == "fp8":
        pytest.importorskip("torchao", reason="precision='fp8' needs torchao")
    schedule = {SWITCH: then}
    straight = Run(plugin_for(first, schedule, **kwargs)).train(STEPS, poison=poison)
    run = Run(plugin_for(first, schedule, **kwargs)).train(SWITCH - 1, poison=poison)
    run.save(tmp_path / "ckpt.pt")
    run.train(2, poison=poison)  # past the switch
    run.load(tmp_path / "ckpt.pt")  # the same Fabric and plugin, back into rung 0
    assert run.plugin.ladder.current == 0 and run.start == SWITCH - 1
    run.steps = []
    run.train(STEPS - run.start, poison=poison)
    for key in ("format", "dtype", "fp8", "scale", "masters", "lean"):
        assert column(run, key) == column(straight, key)[SWITCH - 1:], key
    assert bitwise(final(run), final(straight))


def test_a_guarded_scheduler_holds_still_on_skipped_steps_on_both_sides_of_the_switch():
    plugin = plugin_for("fp16", {SWITCH: "bf16"}, init_scale=2.0**8)
    run = Run(plugin)
    scheduler = torch.optim.lr_scheduler.StepLR(run.opt, step_size=1, gamma=0.5)
    plugin.guard_schedulers(scheduler)
    lrs = []
    for step in range(STEPS + 1):
        run.train(1, poison={1, 5})
        scheduler.step()
        lrs.append(run.opt.param_groups[0]["lr"])
    assert column(run, "format") == ["fp16"] * SWITCH + ["bf16"] * (STEPS + 1 - SWITCH)
    assert plugin.skipped_steps == 2
    # halved at each clean step: held at step 1 (fp16) and at step 5 (bf16, after the switch)
    assert lrs == [1e-2 * 0.5**n for n in (1, 1, 2, 3, 4, 4, 5)]


def test_a_fraction_of_the_run_is_refused_under_fabric_when_the_plugin_is_made():
    # Fabric has no run length: refused at construction, before a step is computed (not after the first one)
    with pytest.raises(ValueError, match=r"schedule=\{0\.5: \.\.\.\}: a fraction of the run needs its length.*"
                                         r"HINT: give the step as an int.*Fabric has no length"):
        plugin_for("fp16", {0.5: "bf16"})
    with pytest.raises(ValueError, match=r"a fraction of the run needs its length"):
        plugin_for("bf16", {0.5: "fp32", 0.9: "bf16"})


def gan_updates(plugin, iterations=3):
    """A GAN under Fabric: two optimizers, two optimizer.step() a iteration, ``fake = G(z)`` built before the
    discriminator's step and back-propagated after it. Per iteration, the generator's update."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
    D = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    G, opt_g = fabric.setup(G, torch.optim.SGD(G.parameters(), lr=0.1))
    D, opt_d = fabric.setup(D, torch.optim.SGD(D.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    updates = []
    for _ in range(iterations):
        z, real = torch.randn(8, 8, generator=g), torch.randn(8, 16, generator=g)
        fake = G(z)
        fabric.backward(D(real).mean() - D(fake.detach()).mean())
        opt_d.step()  # the plugin's step count: odd here
        opt_d.zero_grad()
        before = [p.detach().clone() for p in G.parameters()]
        fabric.backward(D(fake).mean())  # through G's graph, built before the discriminator's step
        opt_g.step()
        opt_g.zero_grad()
        updates.append([p.detach() - b for b, p in zip(before, G.parameters())])
    return updates


@pytest.mark.parametrize("first, then", [("bf16", "fp32"), ("fp16", "bf16"), ("bf16", "fp16")])
def test_a_switch_between_a_gans_two_optimizer_steps_keeps_the_generators_update(first, then):
    # Fabric counts optimizer.step() calls: the switch at step 3 falls after iteration 1's discriminator step, and
    # the generator's backward then runs through copies of the old rung. Before: that update was lost, with no word.
    switched = gan_updates(MixedPrecisionPlugin(first, schedule={3: then}))
    reference = gan_updates(MixedPrecisionPlugin(first))  # the same run without the switch
    for step, (a, b) in enumerate(zip(switched[1], reference[1])):
        # the discriminator's forward in the new rung: the same update to a few of its roundings (measured: 2^-7)
        assert (a - b).norm() <= 2**-5 * b.norm(), step
    assert all(torch.equal(a, b) for a, b in zip(switched[0], reference[0]))  # the iteration before: the same


def test_precision_monitor_shows_the_format_over_steps_and_says_when_the_loss_scale_retires(tmp_path):
    """Fabric's PrecisionMonitor, as LossScaleMonitor under the Trainer: precision/format drops from fp16's 11
    significand bits to bf16's 8 at the switch, the scale to 1.0, and one precision/schedule text says so."""
    from lightning.fabric.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_mp.fabric import PrecisionMonitor

    logger = TensorBoardLogger(tmp_path, name="fabric")
    plugin = plugin_for("fp16", {SWITCH: "bf16"}, init_scale=2.0**8)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin], loggers=logger)
    PrecisionMonitor(fabric, grad_range_every_n_steps=None)
    module = net()
    model, opt = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    for step in range(STEPS):
        x, y = batch(step)
        fabric.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    logger.finalize("success")
    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("precision/format")] == [
        (s, 11.0 if s < SWITCH else 8.0) for s in range(STEPS)]
    assert [e.value for e in acc.Scalars("precision/loss_scale")] == [256.0] * SWITCH + [1.0] * (STEPS - SWITCH)
    [text] = [e for e in acc.Tensors("precision/schedule/text_summary")]
    assert text.step == SWITCH and b"the loss scale retires" in text.tensor_proto.string_val[0]


def test_lean_with_bf16_moments_to_fp32_masters_upcasts_the_optimizer_state_and_trains_as_a_resume(tmp_path):
    """Fabric hands the plugin its optimizers at their first step, not at a connect: lean bf16's bf16 moments must
    still become FP32 at the switch (torch's AdamW refuses bf16 moments beside FP32 Parameters: "expected dtype
    BFloat16"), and the run goes on as a resume of the lean run's checkpoint under FP32 masters, bit for bit."""
    lean = {"optimizer_state_dtype": torch.bfloat16}
    run = Run(plugin_for("lean", {SWITCH: {"master_weights": True}}, **lean)).train(STEPS)
    assert column(run, "lean") == [True] * SWITCH + [False] * (STEPS - SWITCH)
    assert {t.dtype for s in run.opt.optimizer.state.values() for t in s.values() if t.dim()} == {torch.float32}
    Run(plugin_for("lean", None, **lean)).train(SWITCH).save(tmp_path / "lean.pt")
    resumed = Run(MixedPrecisionPlugin("bf16"))
    resumed.load(tmp_path / "lean.pt")
    resumed.train(STEPS - SWITCH)
    assert bitwise(final(resumed), final(run))
