"""The demo workload: stdlib byte-level text and a small GPT that trains on it, in float32 and bfloat16."""

from __future__ import annotations

import ast
import math
import pickle
import re
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_mp.demos import GPT, StdlibTextDataModule
from lightning_mp.demos.gpt import RECIPE, lr_factor
from lightning_mp.demos.seeds import SeedSpread, compare, seed_list

SMALL = dict(block_size=32, batch_size=16, max_bytes=200_000, max_val_batches=4)
TINY_GPT = dict(block_size=32, n_layer=1, n_head=2, n_embd=32)


def _trainer(**kwargs) -> L.Trainer:
    opts = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    opts.update(kwargs)
    return L.Trainer(**opts)


@pytest.fixture(scope="module")
def small_dm() -> StdlibTextDataModule:
    dm = StdlibTextDataModule(**SMALL)
    dm.setup()
    return dm


# ---------------------------------------------------------------- data


def test_reads_real_stdlib_python_source(small_dm):
    dm = small_dm
    assert dm.vocab_size == StdlibTextDataModule.vocab_size == 256
    assert dm.train_data.dtype == torch.uint8
    assert len(dm.train_data) + len(dm.val_data) == 200_000
    assert len(dm.val_data) == int(200_000 * 0.1)
    text = bytes(dm.train_data.tolist())
    assert b"def " in text and b"import " in text and b"return" in text
    assert dm.files == sorted(dm.files) and all(f.endswith(".py") for f in dm.files)
    # third-party packages and machine-specific build files are not part of the text
    assert not any("site-packages" in f or f.startswith("_sysconfigdata_") for f in dm.files)


def test_split_is_one_contiguous_cut_of_the_same_stream(small_dm):
    other = StdlibTextDataModule(**{**SMALL, "val_fraction": 0.25})
    other.setup()
    a = torch.cat([small_dm.train_data, small_dm.val_data])
    b = torch.cat([other.train_data, other.val_data])
    assert torch.equal(a, b)
    assert len(other.val_data) == 50_000


def test_training_examples_are_shifted_chunks_of_the_train_split(small_dm):
    dm, B = small_dm, SMALL["block_size"]
    ds = dm.train_dataset()
    assert len(ds) == (len(dm.train_data) - 1) // B
    for i in (0, 1, len(ds) - 1):
        x, y = ds[i]
        assert x.shape == y.shape == (B,) and x.dtype == torch.long
        assert torch.equal(x[1:], y[:-1])
        assert torch.equal(torch.cat([x, y[-1:]]), dm.train_data[i * B : i * B + B + 1].long())
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (SMALL["batch_size"], B)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_validation_is_capped_and_reads_only_the_val_split(small_dm):
    dm, B = small_dm, SMALL["block_size"]
    ds = dm.val_dataset()
    assert len(ds) == SMALL["max_val_batches"] * SMALL["batch_size"]  # 20 kB of val text has more windows
    assert len(dm.val_dataloader()) == SMALL["max_val_batches"]
    starts = ds.starts.tolist()
    assert starts == sorted(set(starts)) and all(b - a >= B for a, b in zip(starts, starts[1:]))
    assert starts[-1] + B + 1 <= len(dm.val_data)
    x, y = ds[len(ds) - 1]
    assert torch.equal(torch.cat([x, y[-1:]]), dm.val_data[starts[-1] : starts[-1] + B + 1].long())


def _first_batches(dm, n=3):
    it = iter(dm.train_dataloader())
    return [next(it)[0] for _ in range(n)]


def test_same_seed_gives_same_batches(small_dm):
    L.seed_everything(7)
    a = _first_batches(small_dm)
    L.seed_everything(7)
    b = _first_batches(small_dm)
    L.seed_everything(8)
    c = _first_batches(small_dm)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_seed_argument_makes_order_independent_of_global_rng():
    dm = StdlibTextDataModule(**SMALL, seed=3)
    dm.setup()
    torch.manual_seed(1)
    a = _first_batches(dm)
    torch.manual_seed(2)
    b = _first_batches(dm)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_worker_processes_give_the_same_batches():
    # items are pure slices, so only the sampler (in the main process) is random
    dm0 = StdlibTextDataModule(**SMALL, seed=5)
    dm1 = StdlibTextDataModule(**SMALL, seed=5, num_workers=1)
    a, b = _first_batches(dm0, 2), _first_batches(dm1, 2)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize(
    "name, value",
    [
        ("block_size", 0),
        ("block_size", True),
        ("block_size", 32.0),
        ("batch_size", -1),
        ("max_bytes", 0),
        ("val_fraction", 0),
        ("val_fraction", 1.0),
        ("val_fraction", "0.1"),
        ("num_workers", -1),
        ("max_val_batches", 0),
        ("seed", -5),
    ],
)
def test_bad_arguments_raise_naming_the_argument(name, value):
    with pytest.raises(ValueError, match=rf"{name}={re.escape(repr(value))} is not allowed: use "):
        StdlibTextDataModule(**{name: value})


def test_missing_root_raises(tmp_path):
    with pytest.raises(ValueError, match="root must be an existing directory"):
        StdlibTextDataModule(root=tmp_path / "nope")


def test_root_without_python_files_raises(tmp_path):
    (tmp_path / "notes.txt").write_text("not python")
    dm = StdlibTextDataModule(root=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no \.py files"):
        dm.setup()


def test_too_little_text_for_block_size_raises():
    dm = StdlibTextDataModule(block_size=128, max_bytes=1000)
    with pytest.raises(ValueError, match=r"block_size=128.*max_bytes=1000"):
        dm.setup()


def test_root_override_reads_files_in_relative_path_order(tmp_path):
    (tmp_path / "b.py").write_text("B = 2\n" * 100)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.py").write_text("X = 1\n" * 100)
    (tmp_path / "c.txt").write_text("ignored")
    dm = StdlibTextDataModule(root=tmp_path, block_size=8, max_bytes=10_000)
    dm.setup()
    assert dm.files == ["a/x.py", "b.py"]
    text = bytes(torch.cat([dm.train_data, dm.val_data]).tolist())
    assert text.index(b"X = 1") < text.index(b"B = 2") and b"ignored" not in text
    assert b"# ==== b.py ====" in text


# ---------------------------------------------------------------- model


def test_forward_shapes_and_length_check():
    model = GPT(**TINY_GPT)
    idx = torch.randint(0, 256, (3, 32))
    assert model(idx).shape == (3, 32, 256)
    assert model(idx[:, :5]).shape == (3, 5, 256)
    with pytest.raises(ValueError, match="block_size=32"):
        model(torch.randint(0, 256, (1, 33)))
    with pytest.raises(ValueError, match="n_embd must be divisible by n_head"):
        GPT(n_embd=30, n_head=4)


def test_initial_loss_is_near_uniform_and_output_head_is_tied():
    torch.manual_seed(0)
    model = GPT(**TINY_GPT)
    idx = torch.randint(0, 256, (4, 32))
    loss = model.loss_fn(model(idx), torch.randint(0, 256, (4, 32)))
    assert abs(loss.item() - math.log(256)) < 0.3
    assert model.head.weight is model.tok_emb.weight


def test_optimizer_decays_only_matrices():
    model = GPT(**TINY_GPT)
    opt = model.configure_optimizers()
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.fixture(scope="module")
def trained():
    L.seed_everything(0)
    dm = StdlibTextDataModule(**SMALL)
    model = GPT(**TINY_GPT, lr=3e-3)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    trainer = _trainer(max_steps=30, callbacks=[Record()])
    trainer.fit(model, dm)
    return trainer, model, dm, losses


def test_training_reduces_loss(trained):
    _, _, _, losses = trained
    assert len(losses) == 30
    assert losses[0] > math.log(256) - 0.5  # starts near a uniform guess over 256 bytes
    end = sum(losses[-5:]) / 5
    assert end < losses[0] - 1.0, losses  # e.g. 5.5 -> ~3.2 nats: the model has learned byte statistics


def test_training_is_reproducible_under_seed_everything(trained):
    _, _, _, losses = trained
    L.seed_everything(0)
    dm = StdlibTextDataModule(**SMALL)
    model = GPT(**TINY_GPT, lr=3e-3)
    again = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            again.append(outputs["loss"].item())

    _trainer(max_steps=5, callbacks=[Record()]).fit(model, dm)
    assert again == losses[:5]


def test_validate_reports_loss_perplexity_accuracy(trained):
    trainer, model, dm, _ = trained
    (metrics,) = trainer.validate(model, dm, verbose=False)
    assert set(metrics) == {"val_loss", "val_ppl", "val_acc"}
    assert metrics["val_ppl"] == pytest.approx(math.exp(metrics["val_loss"]), rel=1e-4)
    assert metrics["val_loss"] < math.log(256) - 1.0
    assert 0.0 < metrics["val_acc"] < 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_under_autocast(dtype):
    torch.manual_seed(0)
    model = GPT(**TINY_GPT).to(dtype)
    x = torch.randint(0, 256, (2, 32))
    y = torch.randint(0, 256, (2, 32))
    with torch.autocast("cpu", dtype=dtype):
        logits = model(x)
        loss = model.loss_fn(logits, y)
    assert logits.dtype == dtype
    assert loss.dtype == torch.float32  # autocast runs cross_entropy in float32
    assert torch.isfinite(loss) and abs(loss.item() - math.log(256)) < 0.5
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None and p.grad.dtype == dtype and torch.isfinite(p.grad).all()


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_trains_and_validates_under_lightning_bf16(precision):
    L.seed_everything(0)
    dm = StdlibTextDataModule(**{**SMALL, "max_val_batches": 2})
    model = GPT(**TINY_GPT, lr=3e-3)
    trainer = _trainer(max_steps=5, precision=precision, limit_val_batches=2)
    trainer.fit(model, dm)
    (metrics,) = trainer.validate(model, dm, verbose=False)
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["val_loss"] < math.log(256)


def test_generate_appends_tokens():
    torch.manual_seed(0)
    model = GPT(**TINY_GPT).eval()
    out = model.generate(torch.zeros(2, 40, dtype=torch.long), max_new_tokens=5, top_k=10)
    assert out.shape == (2, 45) and out.dtype == torch.long


# ---------------------------------------------------------------- the learning-rate recipe


@pytest.mark.parametrize(
    "step, warmup, decay, expected",
    [
        (0, 0, None, 1.0),  # no warmup, no decay: a constant lr
        (0, 4, None, 1 / 5),  # the first step already moves the weights (nanoGPT's (step + 1) / (warmup + 1))
        (3, 4, None, 4 / 5),
        (4, 4, None, 1.0),  # warmup done: the peak
        (1000, 4, None, 1.0),
        (4, 4, 14, 1.0),  # the cosine starts at the peak...
        (9, 4, 14, 0.55),  # ...is halfway between peak and floor halfway...
        (14, 4, 14, 0.1),  # ...reaches min_lr_ratio at decay_steps...
        (50, 4, 14, 0.1),  # ...and stays there
    ],
)
def test_lr_factor_warms_up_linearly_then_decays_by_a_cosine(step, warmup, decay, expected):
    assert lr_factor(step, warmup, decay, min_lr_ratio=0.1) == pytest.approx(expected)


def test_default_gpt_keeps_a_constant_lr_and_returns_a_bare_optimizer():
    """Fabric's setup(model, model.configure_optimizers()) needs the optimizer itself."""
    opt = GPT(**TINY_GPT).configure_optimizers()
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["lr"] == 3e-4


def test_warmup_and_cosine_give_a_per_step_scheduler_that_a_checkpoint_can_hold():
    model = GPT(**TINY_GPT, lr=1e-3, warmup_steps=2, lr_schedule="cosine", decay_steps=6, min_lr_ratio=0.1)
    config = model.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "step"
    lrs = []
    for _ in range(8):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [1e-3 * lr_factor(s, 2, 6, 0.1) for s in range(8)]
    assert lrs == pytest.approx(expected) and lrs[2] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)
    again = pickle.loads(pickle.dumps(sched))  # the lr function is a partial, not a lambda
    assert again.lr_lambdas[0](3) == pytest.approx(lr_factor(3, 2, 6, 0.1))


def test_cosine_decays_over_the_trainers_steps_in_a_fit():
    L.seed_everything(0)
    model = GPT(**TINY_GPT, lr=1e-3, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    seen = []

    class RecordLR(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    _trainer(max_steps=6, limit_val_batches=0, callbacks=[RecordLR()]).fit(model, StdlibTextDataModule(**SMALL))
    # decay_steps=None: the cosine ends at trainer.estimated_stepping_batches, here max_steps
    assert seen == pytest.approx([1e-3 * lr_factor(s, 2, 6, 0.1) for s in range(6)])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(warmup_steps=-1), r"warmup_steps=-1 is not allowed"),
        (dict(lr_schedule="linear"), r"lr_schedule='linear' is not allowed: use one of 'constant', 'cosine'"),
        (dict(min_lr_ratio=1.5), r"min_lr_ratio=1.5 is not allowed: use a number in \[0, 1\]"),
        (dict(min_lr_ratio=-0.1), r"min_lr_ratio=-0.1 is not allowed"),
        (dict(decay_steps=0), r"decay_steps=0 is not allowed"),
        (dict(lr=0.0), r"lr=0.0 is not allowed"),
    ],
)
def test_bad_schedule_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPT(**TINY_GPT, **kwargs)


def test_cosine_without_a_trainer_asks_for_decay_steps():
    with pytest.raises(ValueError, match=r"decay_steps=None is not allowed without a Trainer.*HINT"):
        GPT(**TINY_GPT, lr_schedule="cosine").configure_optimizers()


def test_the_copyable_example_spells_out_the_same_recipe_as_the_harness():
    """examples/train_gpt.py writes the recipe out (it is for copying); it must not drift from RECIPE."""
    tree = ast.parse((Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py").read_text())
    (defaults,) = [ast.literal_eval(node.args[0]) for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "set_defaults"]  # fmt: skip
    assert {key[len("model."):]: v for key, v in defaults.items() if key.startswith("model.")} == RECIPE


# ---------------------------------------------------------------- comparisons over seeds


def test_seed_list_is_a_count_or_the_seeds_themselves():
    assert seed_list([3]) == [0, 1, 2]
    assert seed_list([0, 7, 9]) == [0, 7, 9]
    for bad, match in (([0], "one number is a count"), ([1, 1], "distinct seeds"), ([2, -1], "distinct seeds")):
        with pytest.raises(ValueError, match=match):
            seed_list(bad)


def test_seed_spread_mean_min_max_and_range_text():
    spread = SeedSpread({0: 2.0, 1: 2.5, 2: 2.3})
    assert (spread.n, spread.mean, spread.min, spread.max) == (3, pytest.approx(2.2667, abs=1e-4), 2.0, 2.5)
    assert spread.range_text(".2f") == "[2.00, 2.50]"
    assert SeedSpread().mean is None and SeedSpread().range_text(".2f") == "-"


@pytest.mark.parametrize(
    "ours, base, verdict, text",
    [
        # every bf16 seed above every fp32 seed: claimed
        ({0: 2.5, 1: 2.6}, {0: 2.0, 1: 2.1}, "beyond", "val loss: bf16 - fp32 = +0.5000, beyond the seed spread"),
        # the means differ by 0.3 but one fp32 seed spiked: the ranges overlap, nothing is claimed
        ({0: 2.5, 1: 2.6}, {0: 2.0, 1: 2.8}, "within", "val loss: bf16 - fp32 = +0.1500, within seed spread"),
        ({0: 2.5}, {0: 2.0}, "one seed", "one seed, no spread measured: no difference claimed"),
        ({}, {0: 2.0}, "no result", "val loss: bf16 - fp32: no result"),
    ],
)
def test_a_difference_is_claimed_only_beyond_the_seed_spread(ours, base, verdict, text):
    result = compare("val loss", "bf16", SeedSpread(ours), "fp32", SeedSpread(base))
    assert result.verdict == verdict
    assert text in result.line(".4f")
    if verdict in ("beyond", "within"):
        assert "(seed 0: +0.5000, seed 1: " in result.line(".4f")  # the paired, per-seed differences
