"""The demo workload: stdlib byte-level text and a small GPT that trains on it, in float32 and bfloat16."""

from __future__ import annotations

import math
import re

import lightning as L
import pytest
import torch

from lightning_mp.demos import GPT, StdlibTextDataModule

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
