"""lightning_mp.fabric.load: ``fabric.load`` plus the plugin's ``load_state_dict`` that Fabric's sharded load leaves
out. The sharded load itself (2 ranks and 1, ``ModelParallelStrategy``): test_fabric_checkpoints_ranks_integration.py."""

import lightning as L
import torch
from torch import nn

from lightning_mp.fabric import MixedPrecisionPlugin, load


class ShardedLoadFabric:
    """What Lightning 2.6's ModelParallelStrategy does with a folder: the model loads, and every other entry of the
    dict is replaced by what was saved under its key (``state[key] = metadata.pop(key)``)."""

    def __init__(self, saved):
        self.saved = saved

    def load(self, path, state, **kwargs):
        for key in state.keys() - {"model"}:
            state[key] = self.saved[key]
        return {"extra": 1}


def test_the_plugin_replaced_by_its_saved_dict_loads_it_and_goes_back_in_the_dict():
    saved = MixedPrecisionPlugin("fp16", init_scale=2.0**7)
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8)
    model = nn.Linear(2, 2)
    state = {"model": model, "precision": plugin, "step": 0}
    remainder = load(ShardedLoadFabric({"precision": saved.state_dict(), "step": 5}), "folder", state)
    assert state["precision"] is plugin and plugin.loss_scale == 2.0**7  # fabric.load alone: a dict, scale 2**8
    assert state["model"] is model and state["step"] == 5 and remainder == {"extra": 1}


def test_a_full_file_loads_as_with_fabric_load(tmp_path):
    plugin = MixedPrecisionPlugin("fp16", init_scale=2.0**8)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = nn.Linear(2, 2)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt, "precision": plugin, "step": 3})
    fresh = MixedPrecisionPlugin("fp16", init_scale=2.0**4)
    state = {"model": model, "optimizer": opt, "precision": fresh, "step": 0}
    load(fabric, tmp_path / "ckpt.pt", state)
    assert state["precision"] is fresh and fresh.loss_scale == 2.0**8 and state["step"] == 3
