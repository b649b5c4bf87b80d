"""The Fabric plugin's hold on the FP32 policy's and the emulated GEMMs' kernels: Fabric has no fit for them to span.

The two kinds cost different things, so they are held over different spans:

* **The FP32 policy's kernels** sit at the autocast dispatch keys. Registering them is a table update per overload
  (about 1 ms of host time for the default table with its removal: 1-2% of a small GPT's CPU step, paid every
  iteration before), so they are registered once, at the plugin's first forward, and held until the plugin is
  collected, ``teardown()`` or ``plugin.release_kernels()``. From a forward to the end of its backward (as the GEMMs'
  below) they are switched on (one counter, no registration, paid twice per iteration: a counter per kernel and a write
  of the compile key's tag each time cost ~25 us a switch inside a step, 4% of a tiny MLP's CPU step; switching them
  around each forward and each backward apart, 85 us per iteration); the rest of the time they are switched off and do what
  autocast does. Between a forward and its backward the loop's own code under ``torch.autocast`` (a loss in
  ``fabric.autocast()``) gets the policy's FP32 ops too. Code that runs outside ``torch.autocast`` never reaches them
  (the keys are excluded from dispatch then); code under autocast between iterations gets autocast's own dtypes,
  each listed op through one Python call (a few microseconds; a small MLP forward under autocast 1.3-1.4x,
  ``benchmarks/after_fabric_benchmark.py``).
* **The emulated GEMMs' kernels** (only where 16-bit GEMMs are emulated) sit at ``ADInplaceOrView``, which every
  matrix product in the process passes, autocast or not: held for life they would make each one a Python call
  (1.8-2.1x on a small FP32 ``torch.mm``). They are held from a forward to the end of its backward (or of the
  forward under ``no_grad``, or to the next ``optimizer.step()``), about 0.3 ms per iteration, where emulating the
  GEMMs costs far more.
"""

from __future__ import annotations

from typing import Any

from lightning_mp.policy.dispatch import switch


class KernelHold:
    """What the Fabric plugin holds of ``policy``'s and ``gemm``'s kernels. A copy (``ddp_spawn``'s pickle, a
    ``deepcopy``) holds nothing: it registers its own at its first forward."""

    def __init__(self, policy: Any, gemm: Any) -> None:
        self._policy, self._gemm = policy, gemm
        self._fp32: Any = None  # the policy's kernels, registered switched off (Fp32Activation), from the first forward
        self._on = False  # whether the policy's kernels are switched on (from a forward to the end of its backward)
        self._gemms = False  # whether a forward's hold on the emulated GEMMs' kernels is open

    @property
    def active(self) -> bool:
        """Whether the policy's kernels are switched on (the forward's context then adds only its fallback mode)."""
        return self._on

    def forward(self) -> bool:
        """A 16-bit forward (or backward) begins: the policy's kernels registered if they are not (once) and switched
        on, the emulated GEMMs' held, until :meth:`backward_done`. Whether this call opened the span."""
        if self._on:
            return False  # a second forward before the backward (a GAN's), or the backward of this forward
        if self._fp32 is None:
            self._fp32 = self._policy.activate(on=False)
        switch(self._policy.kernel_plan(), 1)
        self._on = True
        if self._gemm.emulated and not self._gemms:
            self._gemm.hold()
            self._gemms = True
        return True

    def backward_done(self) -> None:
        """The end of a backward, of a forward under ``no_grad``, or an ``optimizer.step()``: the policy's kernels
        off, the GEMMs' kernels out."""
        on, self._on = self._on, False
        if on:
            switch(self._policy.kernel_plan(), -1)
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
        return {**self.__dict__, "_fp32": None, "_on": False, "_gemms": False}
