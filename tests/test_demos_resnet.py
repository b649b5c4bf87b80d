"""The image workload: scikit-learn's digits, a ResNet with BatchNorm, BatchNorm in mixed dtype under the FP32
policy, and examples/train_resnet.py at a tiny size."""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("sklearn", reason="DigitsDataModule reads sklearn.datasets.load_digits")

from lightning_mp import Fp32Policy, MixedPrecisionPlugin  # noqa: E402
from lightning_mp.demos import DigitsDataModule, ResNet  # noqa: E402
from lightning_mp.demos.digits import _shift_batch  # noqa: E402
from tests.conftest import inside_forward  # noqa: E402

from .conftest import trainer_kwargs  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EPS = {torch.bfloat16: torch.finfo(torch.bfloat16).eps, torch.float16: torch.finfo(torch.float16).eps}  # 2^-7, 2^-10
# one unit of rounding to the format (half an ulp at 1.0): 2^-8 for bf16, 2^-11 for fp16
ROUND = {dtype: eps / 2 for dtype, eps in EPS.items()}
HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


@pytest.fixture(scope="module")
def digits() -> DigitsDataModule:
    dm = DigitsDataModule(batch_size=64, seed=0)
    dm.setup()
    return dm


# ---------------------------------------------------------------- data


def test_digits_shapes_split_and_standardisation(digits):
    assert digits.train_images.shape == (1438, 1, 16, 16) and digits.val_images.shape == (359, 1, 16, 16)
    assert len(digits.train_images) + len(digits.val_images) == DigitsDataModule.num_images
    assert digits.train_images.dtype == torch.float32 and digits.train_labels.dtype == torch.int64
    assert set(digits.train_labels.tolist()) == set(digits.val_labels.tolist()) == set(range(10))
    # standardised with the training split's own statistics
    assert abs(float(digits.train_images.mean())) < 1e-4 and abs(float(digits.train_images.std()) - 1) < 1e-3
    other = DigitsDataModule(val_fraction=0.5, image_size=8)
    other.setup()
    assert other.train_images.shape == (899, 1, 8, 8) and other.val_images.shape == (898, 1, 8, 8)


def test_digits_split_is_fixed_and_batches_repeat(digits):
    again = DigitsDataModule(batch_size=64, seed=0)
    again.setup()
    assert torch.equal(again.val_images, digits.val_images) and torch.equal(again.val_labels, digits.val_labels)
    L.seed_everything(3, verbose=False)  # the split does not depend on the global RNG
    moved = DigitsDataModule(batch_size=64, seed=0)
    moved.setup()
    assert torch.equal(moved.train_labels, digits.train_labels)
    other_split = DigitsDataModule(split_seed=1)
    other_split.setup()
    assert not torch.equal(other_split.val_labels, digits.val_labels)

    def first_batch(dm):
        L.seed_everything(0, verbose=False)
        return next(iter(dm.train_dataloader()))

    (x1, y1), (x2, y2) = first_batch(digits), first_batch(again)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (64, 1, 16, 16)


def test_augmentation_shifts_training_images_only(digits):
    val_x, val_y = next(iter(digits.val_dataloader()))
    assert torch.equal(val_x, digits.val_images[:64]) and torch.equal(val_y, digits.val_labels[:64])
    L.seed_everything(0, verbose=False)
    x, y = next(iter(digits.train_dataloader()))
    plain = DigitsDataModule(batch_size=64, seed=0, augment=False)
    plain.setup()
    L.seed_everything(0, verbose=False)
    x0, y0 = next(iter(plain.train_dataloader()))
    assert torch.equal(y, y0) and not torch.equal(x, x0)
    # a shift moves the ink, it adds none: the total is kept, or less where ink left the frame (the upsampled
    # digits reach the border, so that is common), and the blank fill is the background, not mid-grey
    ink = (x - digits.background).sum(dim=(1, 2, 3))
    ink0 = (x0 - digits.background).sum(dim=(1, 2, 3))
    assert (ink <= ink0 + 1e-3).all() and torch.isclose(ink, ink0, rtol=1e-4).float().mean() > 0.2


def test_shift_batch_moves_each_image_by_at_most_max_shift():
    images = torch.zeros(50, 1, 9, 9)
    images[:, 0, 4, 4] = 1.0
    torch.manual_seed(0)
    shifted = _shift_batch(images, 2)
    rows, cols = shifted[:, 0].nonzero()[:, 1:].unbind(1)
    assert len(rows) == 50 and ((rows - 4).abs() <= 2).all() and ((cols - 4).abs() <= 2).all()
    assert len({(int(r), int(c)) for r, c in zip(rows, cols)}) > 10  # each image draws its own shift


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=0), "batch_size=0 is not allowed: use an integer >= 1"),
        (dict(image_size=4), "image_size=4 is not allowed: use an integer >= 8"),
        (dict(val_fraction=1.0), r"val_fraction=1.0 is not allowed: use a finite number in \(0, 1\)"),
        (dict(augment="yes"), "augment='yes' is not allowed: use True or False"),
        (dict(max_shift=-1), "max_shift=-1 is not allowed: use an integer >= 0"),
    ],
)
def test_digits_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DigitsDataModule(**kwargs)


def test_resnet_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="width=0 is not allowed: use an integer >= 1"):
        ResNet(width=0)
    with pytest.raises(ValueError, match="lr=-0.1 is not allowed: use a finite number > 0"):
        ResNet(lr=-0.1)


# ---------------------------------------------------------------- BatchNorm in mixed dtype


def _saved_fp32_activations(fn, x):
    """Sizes of the FP32 tensors with as many elements as x that autograd saves while fn(x) runs."""
    found = []

    def pack(t):
        if t.dtype == torch.float32 and t.numel() == x.numel():
            found.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return out, found


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batchnorm_takes_16_bit_input_natively_and_matches_fp32(dtype, training):
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(8)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2.0), bn.bias.uniform_(-1, 1)
        bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2.0)
    ref = nn.BatchNorm2d(8)
    ref.load_state_dict(bn.state_dict())
    bn.train(training), ref.train(training)
    x = (torch.randn(16, 8, 6, 6) * 3 + 2).to(dtype).requires_grad_()
    x_ref = x.detach().float().requires_grad_()
    policy = Fp32Policy()

    with policy.install(bn, "cpu"), torch.autocast("cpu", dtype=dtype), policy.op_context():
        y, saved_fp32 = _saved_fp32_activations(bn, x)
    assert y.dtype == dtype, "the normalised activation stays 16-bit"
    assert saved_fp32 == [], "no FP32 copy of the activation is kept for backward"
    assert bn.weight.dtype == bn.running_mean.dtype == bn.running_var.dtype == torch.float32

    y_ref = ref(x_ref)
    # the output is the FP32 result rounded once to the format
    torch.testing.assert_close(y.float(), y_ref, rtol=ROUND[dtype], atol=ROUND[dtype])
    # statistics from the same 16-bit values, accumulated in FP32
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-5, atol=1e-6)

    grad = torch.randn_like(y_ref).to(dtype)
    y.backward(grad)
    y_ref.backward(grad.float())
    assert x.grad.dtype == dtype and bn.weight.grad.dtype == torch.float32
    scale = float(x_ref.grad.abs().max())
    torch.testing.assert_close(x.grad.float(), x_ref.grad, rtol=EPS[dtype], atol=EPS[dtype] * scale)
    torch.testing.assert_close(bn.weight.grad, ref.weight.grad, rtol=EPS[dtype], atol=EPS[dtype])
    torch.testing.assert_close(bn.bias.grad, ref.bias.grad, rtol=EPS[dtype], atol=EPS[dtype])


def test_batchnorm_halves_the_saved_activations_against_an_upcast():
    """What the native path saves against what upcasting the input first (the policy's former way) saved."""
    bn, x = nn.BatchNorm2d(8), torch.randn(32, 8, 8, 8).bfloat16().requires_grad_()

    def saved_bytes(fn):
        total = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.nbytes) or t, lambda t: t):
            fn(x)
        return sum(total)

    policy = Fp32Policy()
    with policy.install(bn, "cpu"), policy.op_context():
        native = saved_bytes(bn)
    upcast = saved_bytes(lambda t: bn(t.float()))
    assert native <= 0.51 * upcast


def test_batchnorm_with_16_bit_parameters_and_other_norms_still_run_in_fp32():
    policy = Fp32Policy()
    x = torch.randn(4, 8, 5, 5).bfloat16()
    all_bf16 = nn.BatchNorm2d(8).bfloat16()  # no FP32 weights to normalise with: upcast, FP32 result
    group = nn.GroupNorm(2, 8)
    with policy.install(all_bf16, "cpu"), policy.install(group, "cpu"), policy.op_context(), torch.autocast(
        "cpu", dtype=torch.bfloat16
    ):
        assert all_bf16(x).dtype == torch.float32
        assert group(x).dtype == torch.float32
        # the functional, called directly: FP32 statistics -> native; 16-bit ones -> upcast
        stats = torch.zeros(8), torch.ones(8)
        assert F.batch_norm(x, *stats, training=True).dtype == torch.bfloat16
        assert F.batch_norm(x, stats[0].bfloat16(), stats[1].bfloat16(), training=True).dtype == torch.float32


# ---------------------------------------------------------------- the ResNet under the plugin


class _Dtypes(L.Callback):
    """Records, during the first training forward, what dtypes a convolution and a BatchNorm see."""

    def __init__(self):
        self.seen = {}

    def on_train_start(self, trainer, pl_module):
        def record(key):
            def hook(module, args, output):
                self.seen.setdefault(key, (module.weight.dtype, args[0].dtype, output.dtype))

            return hook

        block = pl_module.blocks[0]
        self._handles = [inside_forward(block.conv1, record("conv")), inside_forward(block.bn1, record("bn"))]

    def on_train_end(self, trainer, pl_module):
        for handle in self._handles:
            handle.remove()


@pytest.mark.on_device
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_resnet_forward_backward_in_each_precision(precision):
    L.seed_everything(0, verbose=False)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    model, dm, dtypes = ResNet(width=4, blocks_per_stage=1), DigitsDataModule(batch_size=16, seed=0), _Dtypes()
    plugin = MixedPrecisionPlugin(precision)
    L.Trainer(**trainer_kwargs(max_steps=2, limit_val_batches=0, plugins=[plugin], callbacks=[dtypes])).fit(model, dm)
    assert dtypes.seen["conv"] == (dtype, dtype, dtype), "convolution weights and activations in the format"
    assert dtypes.seen["bn"] == (torch.float32, dtype, dtype), "BatchNorm keeps FP32 parameters, 16-bit activations"
    assert model.blocks[0].bn1.running_mean.dtype == torch.float32
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())  # after fit
    assert plugin.skipped_steps == 0


@pytest.mark.on_device
def test_resnet_short_run_beats_chance_by_far():
    L.seed_everything(0, verbose=False)
    model, dm = ResNet(width=8, blocks_per_stage=1), DigitsDataModule(batch_size=64, image_size=8, seed=0)
    trainer = L.Trainer(**trainer_kwargs(max_steps=60, plugins=[MixedPrecisionPlugin("bf16")]))
    trainer.fit(model, dm)
    acc = trainer.validate(model, dm, verbose=False)[0]["val_acc"]
    assert acc > 0.6, f"validation accuracy {acc:.3f} after 60 bf16 steps; chance is 0.1"


# ---------------------------------------------------------------- examples/train_resnet.py


def _load_example():
    spec = importlib.util.spec_from_file_location("examples_train_resnet", EXAMPLES / "train_resnet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_example_table_with_tiny_runs(tmp_path):
    """The real command: two rows over two seeds, each run in its own subprocess, then the Markdown and CSV tables
    with the mean and min-max over seeds, and the differences stated against the seed spread."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(EXAMPLES.parent), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(EXAMPLES / "train_resnet.py"), "--runs", "fp32", "fp16", "--max-steps", "2",
           "--batch-size", "16", "--seeds", "2", "--output", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[1/4] seed 0, fp32 ..." in proc.stdout and "[3/4] seed 1, fp16: ok" in proc.stdout  # order alternates
    with open(tmp_path / "runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert [(r["seed"], r["precision"]) for r in runs] == [("0", "fp32"), ("0", "fp16"), ("1", "fp16"), ("1", "fp32")]
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["precision"] for r in rows] == ["fp32", "fp16"] and all(r["status"] == "ok" for r in rows)
    for r in rows:
        accs = [float(x["val_acc"]) for x in runs if x["precision"] == r["precision"]]
        assert r["seeds_ok"] == "2/2" and float(r["val_acc"]) == pytest.approx(sum(accs) / 2)
        assert (float(r["val_acc_min"]), float(r["val_acc_max"])) == (min(accs), max(accs))
        assert 0 < float(r["val_loss_min"]) <= float(r["val_loss"]) <= float(r["val_loss_max"])
        assert float(r["wall_time_s"]) > 0
        assert float(r["peak_rss_mib"]) > float(r["train_rss_mib"]) > 0 and float(r["peak_tensor_mib"]) > 0
        assert r["steps"] == "2" and r["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert rows[0]["time_ratio"] == rows[0]["mem_ratio"] == "1.0"
    assert rows[1]["skipped_steps"] == "0" and rows[1]["loss_scale"] == "65536"
    table = (tmp_path / "results.md").read_text()
    assert table.startswith("| precision | seeds ok | val acc mean | val acc min-max |") and "| fp16 | 2/2 |" in table
    assert re.search(r"^- val acc: fp16 - fp32 = [+-]\d\.\d{4}, (within seed spread|beyond the seed spread)", table, re.M)
    assert "| seed | precision | val acc |" in table  # the per-run table, with more than one seed
    assert f"CPU capability {torch.backends.cpu.get_cpu_capability()}" in table and table in proc.stdout + "\n"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for version in ("fp16", "fp16_seed1"):  # the first seed keeps the precision's name
        events = EventAccumulator(str(tmp_path / "tensorboard" / version))
        events.Reload()
        assert {"precision/loss_scale", "precision/skipped_steps", "train_loss"} <= set(events.Tags()["scalars"])
        assert "precision/grad_log2_magnitude" in events.Tags()["histograms"]


def test_example_seeds_reach_the_model_and_the_batches(tmp_path):
    """Another seed trains another run (initialisation, batch order); the same seed trains the same one again."""
    example = _load_example()
    runs = [example.train_one("fp32", max_steps=2, batch_size=16, log_dir=tmp_path, seed=seed, version=f"s{i}")
            for i, seed in enumerate((0, 0, 1))]  # fmt: skip
    assert [r["seed"] for r in runs] == [0, 0, 1]
    assert runs[0]["val_loss"] == runs[1]["val_loss"] != runs[2]["val_loss"]


@pytest.mark.parametrize("seeds, message", [(["0"], "one number is a count of seeds"), (["2", "2"], "distinct seeds")])
def test_example_rejects_bad_seeds(capsys, seeds, message):
    with pytest.raises(SystemExit):
        _load_example().main(["--seeds", *seeds])
    assert message in capsys.readouterr().err


def test_example_lightning_reference_row_in_process(tmp_path):
    row = _load_example().train_one("native-bf16-mixed", max_steps=2, batch_size=16, log_dir=tmp_path)
    assert row["precision"] == "native-bf16-mixed" and row["steps"] == 2
    assert row["skipped_steps"] is None and row["loss_scale"] is None  # bf16-mixed has no scaler
    assert (tmp_path / "native-bf16-mixed").is_dir()


def test_example_rejects_a_bad_row_name(capsys):
    with pytest.raises(SystemExit):
        _load_example().main(["--runs", "fp8"])
    err = capsys.readouterr().err
    assert "--runs" in err and "'fp8'" in err and "'bf16'" in err
