"""The precision schedule in Trainer fits: each switch continues the run exactly as a run resumed in the new precision
from the old one's checkpoint would (weights, optimizer state, step counts); what each format leaves on or takes off
the model; the loss scale retiring and being born; gradient accumulation; checkpoints written before and after the
switch; a compiled model; fractions of the run."""

import gc

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import LossScaleMonitor, MixedPrecisionPlugin
from tests.conftest import trainer_kwargs

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fp8_needs_torchao")]
STEPS, SWITCH = 6, 3  # the schedule's switch: step 3 is the first computed in the new setting
FP8 = {"fp8_modules": [nn.Linear]}  # every Linear of the MLP multiplies in FP8 (torchao's size rule picks none)


class Mlp(L.LightningModule):
    """32 -> 64 -> 32 with AdamW; records, per training_step, the step, the format and what the forward computed in."""

    def __init__(self, compiled=False, seed=0, fault_at=()):
        super().__init__()
        self.fault_at = set(fault_at)  # steps whose loss is made inf (an overflow the scaler skips)
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        self.forward_net = torch.compile(self.net, backend="eager") if compiled else self.net
        self.seen = []  # (global_step, format, output dtype, weight dtype inside the first Linear's forward)
        self.weights = {}  # global_step -> the FP32 weights at that step's start (after a switch)
        self.hook = None  # an extra record per step (tests set it)

    def forward(self, x):
        return self.forward_net(x)

    def training_step(self, batch, batch_idx):
        plugin = self.trainer.precision_plugin
        scheduled = isinstance(plugin, MixedPrecisionPlugin)
        step = self.trainer.global_step
        if step not in self.weights:  # the first micro-batch: the step's starting weights
            named = plugin.named_fp32_parameters() if scheduled else self.named_parameters()
            self.weights[step] = {n: p.detach().clone() for n, p in named}
        inner, first = [], self.net[0]
        own = vars(first).get("forward")  # FP8's forward on this instance, if any: it stays
        forward = first.forward
        first.forward = lambda *a: (inner.append(first.weight.dtype), forward(*a))[1]  # the weight the forward reads
        x, y = batch
        out = self(x)
        if own is None:
            del first.forward
        else:
            first.forward = own
        self.seen.append((step, plugin.format.name if scheduled else "none", out.dtype, inner[0] if inner else None))
        if self.hook is not None:
            self.hook(self, step)
        loss = nn.functional.mse_loss(out.float(), y)
        return loss * float("inf") if step in self.fault_at else loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-2)


def data(batches=1, batch_size=16):
    """``batches`` batches per epoch; one batch makes every step an epoch's end, so a resume redoes no data."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batches * batch_size, 32, generator=g)
    return DataLoader(TensorDataset(x, x.flip(1) * 0.5), batch_size=batch_size)


def fit(plugin, steps=STEPS, model=None, loader=None, ckpt_path=None, **kwargs):
    model = model if model is not None else Mlp()
    trainer = L.Trainer(plugins=[plugin] if plugin is not None else None,
                        **trainer_kwargs(max_steps=steps, **kwargs))
    trainer.fit(model, loader if loader is not None else data(), ckpt_path=ckpt_path)
    return model, trainer


def final(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32, name
        assert torch.equal(a[name], b[name]), name


def formats(model):
    return [(step, fmt) for step, fmt, *_ in model.seen]


# (first precision's kwargs, the entry, the plugin a resume in the new setting uses: None for Lightning's own FP32)
LEAN, MASTERS = {"precision": "bf16", "master_weights": "compensated"}, {"precision": "bf16", "master_weights": True}
SWITCHES = {
    "fp8->bf16": ({"precision": "fp8", **FP8}, "bf16", lambda: MixedPrecisionPlugin("bf16")),
    "fp16->bf16": ({"precision": "fp16"}, "bf16", lambda: MixedPrecisionPlugin("bf16")),
    "bf16->fp32": ({"precision": "bf16"}, "fp32", lambda: None),
    "bf16->fp16": ({"precision": "bf16"}, "fp16", lambda: MixedPrecisionPlugin("fp16")),
    "fp16->fp8": ({"precision": "fp16"}, {"precision": "fp8", **FP8}, lambda: MixedPrecisionPlugin("fp8", **FP8)),
    "lean->masters": (LEAN, {"master_weights": True}, lambda: MixedPrecisionPlugin(**MASTERS)),
    "masters->lean": (MASTERS, {"master_weights": "compensated"}, lambda: MixedPrecisionPlugin(**LEAN)),
    # Adam's moments kept in bf16 between lean steps become FP32 (exactly) beside the FP32 Parameters
    "lean(bf16 moments)->masters": ({**LEAN, "optimizer_state_dtype": torch.bfloat16}, {"master_weights": True},
                                    lambda: MixedPrecisionPlugin(**MASTERS)),
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_a_switch_continues_the_run_as_a_resume_in_the_new_precision_would(tmp_path, name):
    """The scheduled run, against two runs: the first precision alone for SWITCH steps (its checkpoint), then a fresh
    Trainer with the new precision resumed from it. Bit for bit: the weights right after the switch are the first
    run's, and the last ones the resumed run's (the optimizer's state and step count carried over, not reset)."""
    first, entry, then = SWITCHES[name]
    scheduled, trainer = fit(MixedPrecisionPlugin(**first, schedule={SWITCH: entry}))
    before, before_trainer = fit(MixedPrecisionPlugin(**first), steps=SWITCH)
    before_trainer.save_checkpoint(tmp_path / "before.ckpt")
    resumed, _ = fit(then(), model=Mlp(seed=1), ckpt_path=tmp_path / "before.ckpt")

    assert_equal(scheduled.weights[SWITCH], final(before))  # the switch itself moves no bit of the weights
    assert_equal(final(scheduled), final(resumed))
    old, new = scheduled.seen[0], scheduled.seen[-1]
    assert formats(scheduled) == [(s, old[1]) for s in range(SWITCH)] + [(s, new[1]) for s in range(SWITCH, STEPS)]
    assert [s[2:] for s in scheduled.seen[SWITCH:]] == [s[2:] for s in resumed.seen]  # the dtypes it computed in
    assert old[1:] != new[1:] or name.startswith(("lean", "masters"))
    optimizer = trainer.optimizers[0]
    assert all(state["step"] == STEPS for state in optimizer.state.values())  # Adam's count went on through it
    assert all(state[k].dtype == torch.float32 for state in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    assert trainer.precision_plugin.ladder.current == 1 and trainer.precision_plugin.training_steps == STEPS


@pytest.mark.parametrize("first, then", [(LEAN, MASTERS), (MASTERS, LEAN)], ids=["lean->masters", "masters->lean"])
def test_lean_and_fp32_masters_switch_bit_for_bit_as_fp32_masters_throughout(first, then):
    entry = {"master_weights": then["master_weights"]}
    scheduled, trainer = fit(MixedPrecisionPlugin(**first, schedule={SWITCH: entry}))
    reference, _ = fit(MixedPrecisionPlugin(**MASTERS))
    for step in range(STEPS):
        assert_equal(scheduled.weights[step], reference.weights[step])
    assert_equal(final(scheduled), final(reference))
    assert (trainer.precision_plugin.core.lean is not None) == (then is LEAN)


def test_fp8_to_bf16_takes_the_fp8_forwards_off_the_same_parameters():
    linears = []

    def record(model, step):  # the instance `forward` attribute FP8 installs on each chosen Linear
        linears.append((step, ["forward" in vars(m) for m in model.net if isinstance(m, nn.Linear)],
                        [id(p) for p in model.net.parameters()], [type(m) for m in model.net]))

    model = Mlp()
    model.hook = record
    ids, classes = [id(p) for p in model.net.parameters()], [type(m) for m in model.net]
    plugin = MixedPrecisionPlugin("fp8", **FP8, schedule={SWITCH: "bf16"})
    fit(plugin, model=model)
    assert [f for _, f, _, _ in linears] == [[True, True]] * SWITCH + [[False, False]] * (STEPS - SWITCH)
    assert [i for _, _, i, _ in linears] == [ids] * STEPS  # the same Parameters throughout
    assert all(issubclass(c, o) for _, _, _, cs in linears for c, o in zip(cs, classes))  # no torchao Float8Linear
    assert [type(m) for m in model.net] == classes  # the model's own classes after the fit
    assert not plugin.core.fp8.chosen
    # the same Parameters hold the optimizer's state: nothing was re-keyed to a copy
    assert {id(p) for p in plugin.core.root.net.parameters()} == set(ids)


def test_bf16_to_fp32_frees_the_16_bit_copies_and_computes_in_fp32():
    model = Mlp()
    shapes = {p.shape for p in model.net.parameters()}

    def live_bf16():  # live bf16 tensors shaped as a Parameter (other tests' may be about: counted once, before)
        gc.collect()
        return sum(isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and o.shape in shapes
                   for o in gc.get_objects())

    copies, before = [], live_bf16()
    model.hook = lambda m, step: copies.append(live_bf16() - before)
    model, trainer = fit(MixedPrecisionPlugin("bf16", schedule={SWITCH: "fp32"}), model=model)
    # a bf16 copy of each of the 4 Parameters (where bf16 GEMMs are emulated, AVX2, a staged operand too), then none
    assert all(n >= 4 for n in copies[:SWITCH]) and copies[SWITCH:] == [0] * (STEPS - SWITCH), copies
    # inside the Linear's forward: the bf16 copy, then the FP32 Parameter itself; the output FP32 after the switch
    assert [s[2:] for s in model.seen] == [(torch.bfloat16, torch.bfloat16)] * SWITCH + \
        [(torch.float32, torch.float32)] * (STEPS - SWITCH)
    assert trainer.precision_plugin.core.masters is None


class TextLogger(Logger):
    """Keeps every ``log_metrics`` call and, as its ``experiment``, every ``add_text`` (TensorBoard's writer has it)."""

    def __init__(self):
        super().__init__()
        self.calls, self.texts = [], []

    name, version = "text", 0

    @property
    def experiment(self):
        return self

    def add_text(self, tag, text, step):
        self.texts.append((tag, text, step))

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))

    def series(self, key):
        return [(step, m[key]) for step, m in self.calls if key in m]


def test_fp16_to_bf16_retires_the_loss_scale_and_the_monitor_says_so():
    logger = TextLogger()
    plugin = MixedPrecisionPlugin("fp16", schedule={SWITCH: "bf16"})
    fit(plugin, callbacks=[LossScaleMonitor()], logger=logger, log_every_n_steps=1)
    assert logger.series("precision/format") == [(s, 11.0) for s in range(SWITCH)] + \
        [(s, 8.0) for s in range(SWITCH, STEPS)]
    assert logger.series("precision/loss_scale") == [(s, 65536.0) for s in range(SWITCH)] + \
        [(s, 1.0) for s in range(SWITCH, STEPS)]
    assert plugin.scaler is None and plugin.loss_scale == 1.0
    [(tag, text, step)] = logger.texts
    assert tag == "precision/schedule" and step == SWITCH
    assert text.startswith(f"step {SWITCH}: bf16") and "the loss scale retires" in text


def test_the_monitor_names_each_switch_at_its_step_when_it_logs_every_few_steps():
    logger = TextLogger()
    plugin = MixedPrecisionPlugin("fp16", schedule={1: "bf16", 3: "fp32", 4: "bf16"})
    fit(plugin, callbacks=[LossScaleMonitor()], logger=logger, log_every_n_steps=3)  # points at steps 2 and 5
    assert logger.series("precision/format") == [(2, 8.0), (5, 8.0)]
    # each switch named by the step it began at; the point at step 5 saw two since the one before: an entry each
    assert [(tag, step) for tag, _, step in logger.texts] == [("precision/schedule", s) for s in (2, 5, 5)]
    texts = [text for _, text, _ in logger.texts]
    assert texts[0].startswith("step 1: bf16") and "the loss scale retires" in texts[0]
    assert texts[1] == "step 3: precision='fp32'"
    assert texts[2].startswith("step 4: bf16 (precision='bf16')") and "retires" not in texts[2]


def test_fp16_to_bf16_logs_the_switch_in_the_fits_log(caplog):
    with caplog.at_level("INFO", logger="lightning_mp.schedule"):
        fit(MixedPrecisionPlugin("fp16", schedule={SWITCH: "bf16"}))
    [line] = [r.getMessage() for r in caplog.records if "precision schedule" in r.getMessage()]
    assert f"from step {SWITCH} on, bf16 (was fp16, loss scale 'dynamic')" in line and "retires" in line


def test_bf16_to_fp16_gives_birth_to_a_dynamic_scale_at_init_scale():
    scales = []
    model = Mlp()
    model.hook = lambda m, step: scales.append(m.trainer.precision_plugin.loss_scale)
    plugin = MixedPrecisionPlugin("bf16", init_scale=2.0**10, schedule={SWITCH: "fp16"})
    fit(plugin, model=model)
    assert scales == [1.0] * SWITCH + [2.0**10] * (STEPS - SWITCH)
    assert plugin.core.scaler.dynamic and plugin.skipped_steps == 0


def test_the_step_counts_and_a_dynamic_scale_carry_over_a_switch():
    """fp16 to fp16 with another knob: the scale and its counters go on as in the run without a schedule, and the
    step skipped before the switch is still counted after it."""
    runs = {}
    for schedule in (None, {SWITCH: {"locate_overflows": False}}):
        scales = []
        model = Mlp(fault_at={1})
        model.hook = lambda m, step: scales.append(m.trainer.precision_plugin.loss_scale)
        plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8, growth_interval=1, hysteresis=1, schedule=schedule)
        logger = TextLogger()
        fit(plugin, model=model, callbacks=[LossScaleMonitor()], logger=logger, log_every_n_steps=1)
        runs[schedule is None] = scales, logger.series("precision/skipped_steps"), final(model)
        assert plugin.skipped_steps == 1 and plugin.training_steps == STEPS and not plugin.core.locate_overflows \
            or schedule is None
    assert runs[True][0] == runs[False][0] == [256.0, 512.0, 256.0, 512.0, 1024.0, 2048.0]
    assert runs[True][1] == runs[False][1] == [(0, 0.0)] + [(s, 1.0) for s in range(1, STEPS)]
    assert_equal(runs[True][2], runs[False][2])


def test_the_optimizer_state_is_the_same_right_after_the_switch():
    states = {}

    def record(model, step):
        optimizer = model.trainer.optimizers[0]
        states[step] = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.net.parameters()]

    class Before(L.Callback):  # before the step's training_step context: the old rung is still on
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == SWITCH:
                record(module, "before")

    model = Mlp()
    model.hook = record
    fit(MixedPrecisionPlugin("fp16", schedule={SWITCH: "bf16"}), model=model, callbacks=[Before()])
    assert len(states["before"]) == 4 and all(s["step"] == SWITCH for s in states["before"])
    for a, b in zip(states["before"], states[SWITCH]):
        assert a.keys() == b.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_switch_under_gradient_accumulation_lands_on_the_first_micro_batch_of_its_step():
    loader = data(batches=2 * STEPS)
    scheduled, trainer = fit(MixedPrecisionPlugin("fp16", schedule={SWITCH: "bf16"}), loader=loader,
                             accumulate_grad_batches=2)
    # both micro-batches of a step in its format: the switch waits for the step's first micro-batch
    assert formats(scheduled) == [(s, "fp16") for s in range(SWITCH) for _ in range(2)] + \
        [(s, "bf16") for s in range(SWITCH, STEPS) for _ in range(2)]
    assert [s[2] for s in scheduled.seen] == [torch.float16] * 2 * SWITCH + [torch.bfloat16] * 2 * (STEPS - SWITCH)
    # the weights the bf16 steps start from are the fp16 run's after its SWITCH accumulated steps, bit for bit
    # (a resume cannot serve as the reference here: Lightning resumes an accumulating epoch's end one micro-batch short)
    before, _ = fit(MixedPrecisionPlugin("fp16"), steps=SWITCH, loader=loader, accumulate_grad_batches=2)
    assert_equal(scheduled.weights[SWITCH], final(before))
    assert all(state["step"] == STEPS for state in trainer.optimizers[0].state.values())


@pytest.mark.parametrize("name", ["fp16->bf16", "fp8->bf16", "lean->masters", "masters->lean"])
@pytest.mark.parametrize("resume_at", [SWITCH - 1, SWITCH, SWITCH + 1], ids=["before", "at", "after"])
def test_a_checkpoint_before_or_after_the_switch_resumes_in_the_right_format_bit_for_bit(tmp_path, name, resume_at):
    """ModelCheckpoint every step; a fresh Trainer and plugin with the same schedule resume from the checkpoint
    written after step ``resume_at - 1`` (``"at"``: the last step of the old rung, the switch comes first thing):
    each step computes in its rung's format, and the last weights are the uninterrupted run's."""
    first, entry, _ = SWITCHES[name]
    schedule = {SWITCH: entry}
    every_step = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    straight, _ = fit(MixedPrecisionPlugin(**first, schedule=schedule), callbacks=[every_step],
                      enable_checkpointing=True)
    plugin = MixedPrecisionPlugin(**first, schedule=schedule)
    resumed, _ = fit(plugin, model=Mlp(seed=1), ckpt_path=tmp_path / f"step={resume_at}.ckpt")
    assert formats(resumed) == formats(straight)[resume_at:]
    assert [s[2:] for s in resumed.seen] == [s[2:] for s in straight.seen[resume_at:]]
    assert_equal(final(straight), final(resumed))
    assert plugin.ladder.current == 1 and plugin.format.name == "bf16"
    assert (plugin.core.lean is not None) == (name == "masters->lean")


COMPILED = {  # first rung, the entry, what the forward's output is in before and after
    "fp16->bf16": ({"precision": "fp16"}, "bf16", torch.float16, torch.bfloat16),
    "fp8->bf16": ({"precision": "fp8", **FP8}, "bf16", torch.bfloat16, torch.bfloat16),
    "bf16->fp32": ({"precision": "bf16"}, "fp32", torch.bfloat16, torch.float32),
}


@pytest.mark.parametrize("name", list(COMPILED))
def test_a_compiled_model_recompiles_once_at_the_switch_not_every_step(name):
    from torch._dynamo.utils import counters

    first, entry, old, new = COMPILED[name]
    graphs = []
    model = Mlp(compiled=True)
    model.hook = lambda m, step: graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    counters.clear()
    fit(MixedPrecisionPlugin(**first, schedule={SWITCH: entry}), model=model)
    # one graph for the old rung's steps, one more at the switch (autocast's dtype and FP8's instance forwards are
    # in the guards), none after
    assert graphs == [1] * SWITCH + [2] * (STEPS - SWITCH)
    assert [s[2] for s in model.seen] == [old] * SWITCH + [new] * (STEPS - SWITCH)


@pytest.mark.parametrize("length", [{"steps": 10}, {"steps": -1, "max_epochs": 2}], ids=["max_steps", "max_epochs"])
def test_a_fraction_of_the_run_becomes_a_step_of_max_steps_or_of_the_epochs(length):
    plugin = MixedPrecisionPlugin("fp16", schedule={0.5: "bf16"})
    model, _ = fit(plugin, loader=data(batches=5), **length)  # 2 epochs of 5 batches: 10 steps either way
    assert plugin.ladder.starts == [5]
    assert formats(model) == [(s, "fp16") for s in range(5)] + [(s, "bf16") for s in range(5, 10)]


def test_a_schedule_of_several_rungs_fp16_fp8_bf16_fp32_climbs_each_in_turn():
    plugin = MixedPrecisionPlugin("fp16", schedule={2: {"precision": "fp8", **FP8}, 4: "bf16", 5: "fp32"})
    model, _ = fit(plugin)
    assert formats(model) == [(0, "fp16"), (1, "fp16"), (2, "fp8"), (3, "fp8"), (4, "bf16"), (5, "fp32")]
    assert [s[2] for s in model.seen] == [torch.float16] * 2 + [torch.bfloat16] * 3 + [torch.float32]
    assert plugin.ladder.current == 3 and plugin.scaler is None


def test_a_plugin_without_the_schedule_resumes_a_checkpoint_written_after_the_switch(tmp_path):
    """Fine-tuning on in the last rung's precision, with a plain plugin: the run goes on as the scheduled one."""
    every_step = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    straight, _ = fit(MixedPrecisionPlugin("fp16", schedule={SWITCH: "bf16"}), callbacks=[every_step],
                      enable_checkpointing=True)
    resumed, _ = fit(MixedPrecisionPlugin("bf16"), model=Mlp(seed=1), ckpt_path=tmp_path / f"step={SWITCH + 1}.ckpt")
    assert formats(resumed) == formats(straight)[SWITCH + 1:]
    assert_equal(final(straight), final(resumed))
