"""A recording mode for host reads: every call that brings a tensor's value to the host is counted while recording.

On CUDA each of these calls on a device tensor waits for the device (a host sync); on the CPU they cost nothing, so
the CPU tests count calls instead of timing them. A read is one of three kinds, told apart by who made it:

* ``deferred``: the plugin's read of a flag a fused optimizer left on the device, from its copy, one step late
  (:meth:`lightning_mp.numerics.deferred.LateFlag.read`: pinned memory after its event on CUDA, so no sync);
* ``optimizer``: the optimizer's own, inside ``torch/optim`` (non-capturable Adam's step counters live on the host
  by design; their ``.item()`` is not a device read on CUDA either);
* ``sync``: everything else, the reads a step must not make.

The GPU check counts the real syncs with ``torch.cuda.set_sync_debug_mode`` instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from unittest import mock

import torch

READS = ("item", "__bool__", "tolist", "cpu", "__float__", "__int__", "numpy")
_DEFERRED = os.path.join("lightning_mp", "numerics", "deferred.py")
_OPTIM = os.path.join("torch", "optim", "")


class HostReads:
    """What was read while :attr:`on`: one ``(method, kind)`` entry per call."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[tuple[str, str]] = []

    def count(self, kind: str) -> int:
        return sum(1 for _, k in self.calls if k == kind)

    @property
    def sync(self) -> int:
        return self.count("sync")

    @property
    def deferred(self) -> int:
        return self.count("deferred")

    def clear(self) -> None:
        self.calls.clear()

    def _kind(self) -> str:
        frame = sys._getframe(2)  # the caller of the patched method
        while frame is not None:
            name = frame.f_code.co_filename
            if name.endswith(_DEFERRED) and frame.f_code.co_name == "read":
                return "deferred"
            if _OPTIM in name:
                return "optimizer"
            frame = frame.f_back
        return "sync"


@contextlib.contextmanager
def recording(on: bool = True) -> Iterator[HostReads]:
    """Patch the reading methods of ``torch.Tensor``; calls made while ``reads.on`` are recorded."""
    reads = HostReads()
    reads.on = on

    def wrap(name: str, original):
        def read(self, *args, **kwargs):
            if reads.on:
                reads.calls.append((name, reads._kind()))
            return original(self, *args, **kwargs)

        return read

    with contextlib.ExitStack() as stack:
        for name in READS:
            stack.enter_context(mock.patch.object(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name))))
        yield reads
