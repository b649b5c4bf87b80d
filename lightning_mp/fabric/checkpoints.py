"""``fabric.load`` for a checkpoint that holds the plugin, whatever Fabric's strategy wrote.

Fabric saves every object of the dict that has ``state_dict()`` (the plugin among them) by that state, and loads it
back through ``load_state_dict`` from a single file (any strategy's full checkpoint). From the folder that
``ModelParallelStrategy`` writes by default (a sharded checkpoint, ``torch.distributed.checkpoint``, Lightning 2.6),
Fabric instead puts the saved dict in the caller's dict in place of the object, so ``fabric.load`` alone leaves the
plugin as it was (initial loss scale, no skip counts, step 0) and the dict holding a plain dict. :func:`load` is
``fabric.load`` followed by the ``load_state_dict`` Fabric left out, for every such object; with a file it changes
nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer


def load(fabric: Any, path: str | Path, state: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """``fabric.load(path, state, **kwargs)``; then each object of ``state`` with ``load_state_dict`` (not a module or
    an optimizer: Fabric loads those) that Fabric replaced by its saved dict loads that dict and goes back in
    ``state``. Returns what ``fabric.load`` returns (the checkpoint's entries ``state`` did not ask for)."""
    objects = {
        key: obj for key, obj in state.items()
        if isinstance(obj, _Stateful) and not isinstance(obj, (nn.Module, Optimizer))
    }
    remainder = fabric.load(path, state, **kwargs)
    for key, obj in objects.items():
        saved = state[key]
        if saved is not obj:  # Fabric's sharded load: the saved state dict instead of the object
            obj.load_state_dict(saved)
            state[key] = obj
    return remainder


__all__ = ["load"]
