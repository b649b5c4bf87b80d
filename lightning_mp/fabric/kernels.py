"""The Fabric plugin's hold on the FP32 policy's and the emulated GEMMs' kernels: Fabric has no fit for them to span.

The two kinds cost different things, so they are held over different spans:

* **The FP32 policy's kernels** sit at the autocast dispatch keys. Registering them is a table update per overload
  (about 1 ms of host time for the default table with its removal: 1-2% of a small GPT's CPU step, paid every
  iteration before), so they are registered once, at the plugin's first forward, and held until the plugin is
  collected, ``teardown()`` or ``plugin.release_kernels()``. Inside every forward and its backward the core's
  ``op_context()`` switches them on (a counter per kernel, no registration); the rest of the time they are switched
  off and do what autocast does. Code that runs outside ``torch.autocast`` never reaches them (the keys are excluded
  from dispatch then); code under autocast between iterations gets autocast's own dtypes, each listed op through one
  Python call (a few microseconds; a small MLP forward under autocast 1.3-1.4x,
  ``benchmarks/after_fabric_benchmark.py``).
* **The emulated GEMMs' kernels** (only where 16-bit GEMMs are emulated) sit at ``ADInplaceOrView``, which every
  matrix product in the process passes, autocast or not: held for life they would make each one a Python call
  (1.8-2.1x on a small FP32 ``torch.mm``). They are held from a forward to the end of its backward (or of the
  forward under ``no_grad``, or to the next ``optimizer.step()``), about 0.3 ms per iteration, where emulating the
  GEMMs costs far more.
"""

from __future__ import annotations

from typing import Any


class KernelHold:
    """What the Fabric plugin holds of ``policy``'s and ``gemm``'s kernels. A copy (``ddp_spawn``'s pickle, a
    ``deepcopy``) holds nothing: it registers its own at its first forward."""

    def __init__(self, policy: Any, gemm: Any) -> None:
        self._policy, self._gemm = policy, gemm
        self._fp32: Any = None  # the policy's kernels, switched off (Fp32Activation), from the first forward on
        self._gemms = False  # whether a forward's hold on the emulated GEMMs' kernels is open

    def forward(self) -> bool:
        """A 16-bit forward begins: the policy's kernels registered if they are not (once), the emulated GEMMs' held
        until :meth:`backward_done`. Whether this call opened the GEMMs' hold."""
        if self._fp32 is None:
            self._fp32 = self._policy.activate(on=False)
        if self._gemms or not self._gemm.emulated:
            return False
        self._gemm.hold()
        self._gemms = True
        return True

    def backward_done(self) -> None:
        """The end of a backward, of a forward under ``no_grad``, or an ``optimizer.step()``: the GEMMs' kernels out."""
        if self._gemms:
            self._gemms = False
            self._gemm.remove()

    def release(self) -> None:
        """Everything out (idempotent): the dispatcher as in a fresh process until the next forward."""
        self.backward_done()
        fp32, self._fp32 = self._fp32, None
        if fp32 is not None:
            fp32.remove()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fp32": None, "_gemms": False}
