"""Fp8StatisticsMonitor in real fits: its tags in a real TensorBoard event file, every N steps, in an fp8 run (the
Linears computing in FP8) and as a what-if in a bf16 run (which Linear FP8 would hurt), for the Trainer and Fabric."""

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger as FabricTensorBoardLogger
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.nn import functional as F

import lightning_mp.fabric
from lightning_mp import Fp8StatisticsMonitor, MixedPrecisionPlugin
from lightning_mp.fabric import MixedPrecisionPlugin as FabricPlugin
from lightning_mp.fp8.statistics import STATS, TENSORS
from tests.test_fp8_autopilot_integration import OutlierNet, data, fit, one_thread  # noqa: F401 (a fixture)

pytest.importorskip("torchao", reason="precision='fp8' needs torchao: pip install 'lightning_mp[fp8]'")
pytestmark = pytest.mark.slow


def events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator(str(log_dir), size_guidance={"scalars": 0}).Reload()


def fp8_tags(acc):
    return {t for t in acc.Tags()["scalars"] if t.startswith("fp8/")}


def test_an_fp8_run_logs_every_statistic_of_its_fp8_linears_every_n_steps(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="", version="")
    fit(MixedPrecisionPlugin("fp8", fp8_modules=["hidden", "head"]), steps=6, logger=logger,
        callbacks=[Fp8StatisticsMonitor(every_n_steps=3)])  # fmt: skip
    acc = events(tmp_path)
    assert fp8_tags(acc) == {f"fp8/{m}/{t}/{s}" for m in ("hidden", "head") for t in TENSORS for s in STATS}
    assert [e.step for e in acc.Scalars("fp8/hidden/input/amax")] == [2, 5]
    assert all(e.value > 25 for e in acc.Scalars("fp8/head/grad_output/sqnr_db"))  # healthy: e4m3's ~31 dB
    assert [e.value for e in acc.Scalars("fp8/hidden/weight/saturated_fraction")] == [0.0, 0.0]
    scale = acc.Scalars("fp8/hidden/input/scale")[0].value
    assert scale == 2.0 ** round(torch.tensor(scale).log2().item())  # rowwise: a power of two


def test_a_bf16_run_shows_which_linear_fp8_would_hurt(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="", version="")
    fit(MixedPrecisionPlugin("bf16"), steps=2, logger=logger, callbacks=[Fp8StatisticsMonitor(every_n_steps=1)])
    acc = events(tmp_path)
    flushed = {m: acc.Scalars(f"fp8/{m}/input/flushed_fraction")[-1].value for m in ("offender", "hidden", "head")}
    assert flushed["offender"] > 0.9 and flushed["hidden"] < 0.01 and flushed["head"] < 0.01
    assert acc.Scalars("fp8/offender/input/sqnr_db")[-1].value > 30  # SQNR alone would not see it


def test_a_recipe_other_than_the_fp8_runs_own_is_refused():
    with pytest.raises(ValueError, match="fp8_recipe='nope' is not allowed"):
        Fp8StatisticsMonitor(recipe="nope")
    with pytest.raises(ValueError, match="this run computes FP8 with 'rowwise'"):
        fit(MixedPrecisionPlugin("fp8", fp8_modules=["hidden"]), steps=1, logger=TensorBoardLogger("unused"),
            callbacks=[Fp8StatisticsMonitor(recipe="tensorwise")])  # fmt: skip


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_fabric_logs_the_same_tags(tmp_path, precision):
    kwargs = {"fp8_modules": ["hidden", "head"]} if precision == "fp8" else {}
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricPlugin(precision, **kwargs)],
                    loggers=FabricTensorBoardLogger(tmp_path, name="", version=""))
    model = OutlierNet(0)
    net, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=3e-3))
    lightning_mp.fabric.Fp8StatisticsMonitor(fabric, net, every_n_steps=2, recipe=None)
    for x, y in list(data(0, steps=4)):
        optimizer.zero_grad()
        fabric.backward(F.cross_entropy(net(x).float(), y))
        optimizer.step()
    fabric.loggers[0].finalize("success")
    acc = events(tmp_path)
    modules = ("hidden", "head") if precision == "fp8" else ("offender", "hidden", "head")
    assert fp8_tags(acc) == {f"fp8/{m}/{t}/{s}" for m in modules for t in TENSORS for s in STATS}
    assert [e.step for e in acc.Scalars("fp8/head/weight/amax")] == [1, 3]
