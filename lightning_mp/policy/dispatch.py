"""The FP32 op policy as kernels at the autocast dispatch keys, switched on and off process-wide.

How it works
------------
``torch.autocast`` is a dispatch key (``AutocastCPU``, ``AutocastCUDA``) that sits above autograd: while
autocast is on, every op on a tensor of that device passes it, and for most ops the key falls through at no
cost. ``activate(plan)`` registers, with ``torch.library``, a small Python kernel at that key for each listed
aten overload that autocast does not already run in FP32 (:func:`lightning_mp.policy.aten.kernel_plan`), and,
for the default table's ops the plan leaves out where autocast's own list runs them in FP32 (CUDA's transcendentals
in bf16), a kernel that calls them as given, in 16 bits, so that an unlisted op is 16-bit on every device. The
FP32 kernel upcasts 16-bit floating tensor arguments to FP32 (or, for ops with an optional ``dtype``, passes
``dtype=torch.float32`` as CUDA autocast does: the kernel converts on the fly where it can), then calls the op
with the autocast keys excluded, exactly as autocast's own FP32 kernels do. ``remove()`` deregisters it:
another autocast user in the process (Lightning's ``bf16-mixed``) then sees torch's autocast unchanged.

What it costs
-------------
Unlisted ops: nothing (the dispatcher's table lookup is the same with or without the registrations); outside
``torch.autocast`` nothing runs either (the keys are excluded from dispatch). A listed op pays a Python call (a few
microseconds), the upcast copies autocast's FP32 list also makes, and an FP32 output. Registering a plan is a table
update per overload (about 1 ms for the default table, a sixth of that to take it out): once per fit for the Trainer,
once per plugin for Fabric, which switches the kernels on and off each iteration (:func:`switch`: a counter).

Why process-global
------------------
Autocast state is replayed where torch recomputes or differentiates: activation checkpointing re-enters autocast
for the recomputation, on CUDA on autograd's device threads, where a thread-local switch would be off. The flip side:
while a plan is active, every thread that runs under autocast gets the listed ops in FP32. Plans held at the same
time add up: the union of their overloads is FP32 (an overload's kernel is the same whichever plan asked for it).

``torch.compile`` traces through the kernels (Dynamo's fake tensors reach them like real ones), so compiled
graphs have the listed ops in FP32. Dynamo does not guard on the registrations: a graph compiled by a lowering
backend ("aot_eager", "inductor") keeps the casts it traced; compile while the policy is in the state it will
run in (a plugin compiles inside its fit). The compile caches on disk see the state: their key names the registered
plans (:mod:`lightning_mp.compile_key`), so graphs traced with and without the policy never mix.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet

from lightning_mp.compile_key import digest, provide
from lightning_mp.formats import HALF_DTYPES, upcast
from lightning_mp.policy.aten import AUTOCAST_KEYS, BATCH_NORM, SET_DTYPE, Rule
from lightning_mp.policy.mode import _native_mixed_batch_norm

# Autocast's own FP32 kernels exclude every autocast key for the inner call; so do these, so the op (and the ops
# a composite decomposes into) is not cast again.
_NO_AUTOCAST = DispatchKeySet(DispatchKey.AutocastCPU) | DispatchKeySet(DispatchKey.AutocastCUDA)
_FP32 = torch.float32


def _up(obj: Any) -> Any:
    """A 16-bit floating tensor as FP32 (also inside a Tensor[] list), anything else as it is (per argument of every
    listed op call: a few bytecodes for a tensor and for an int list, ``normalized_shape``)."""
    if isinstance(obj, torch.Tensor):
        return upcast(obj)
    if isinstance(obj, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in obj):
        return type(obj)(map(_up, obj))
    return obj


@contextlib.contextmanager
def switched_on(plan: frozenset[tuple[str, str, Rule]]) -> Iterator[None]:
    """The plan's registered kernels compute in FP32 inside the block (process-wide; nests): :func:`switch`, on and
    off. A registered kernel that no hold switches on does what autocast does (at the cost of a Python call)."""
    switch(plan, 1)
    try:
        yield
    finally:
        switch(plan, -1)


def switch(plan: frozenset[tuple[str, str, Rule]], delta: int) -> None:
    """One hold more (``+1``) or less (``-1``) switching the plan's registered kernels on: a counter for the plan
    (one per kernel cost ~10 us a switch inside a step, for ~100) and one per kernel another plan shares."""
    with _LOCK:
        for cell in _CELLS.get(plan, ()):
            cell[0] += delta
        if plan in _CELLS:
            _ON[plan] = _ON.get(plan, 0) + delta


def _autocast_off(op: Any, key: str, overload: str) -> Callable[..., Any] | None:
    """What a switched-off kernel runs: the dispatch autocast itself would do for ``overload``, i.e. a fallthrough
    to the keys below ``key`` (nested ops still meet autocast, as a composite such as ``nll_loss_nd`` needs for the
    ``nll_loss`` autocast runs in FP32). ``None`` where autocast has a kernel of its own for the overload (on CUDA:
    ``binary_cross_entropy``, which it refuses, and ``rms_norm``): there the kernel computes in FP32 even when off."""
    packet, _, name = overload.partition(".")
    if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{packet}" + (f".{name}" if name else ""), key):
        return None
    exclude = torch._C._ExcludeDispatchKeyGuard
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), DispatchKey.CompositeImplicitAutograd)

    def fallthrough(*args: Any, **kwargs: Any) -> Any:
        if composite:  # decomposed here, with autocast still on for the ops it calls
            return op.decompose(*args, **kwargs)
        with exclude(_NO_AUTOCAST):  # a leaf kernel: what autocast's fallthrough reaches
            return op(*args, **kwargs)

    return fallthrough


def _make_kernel(op: Any, rule: Rule, off: Callable[..., Any] | None, on: list[list[int]],
                 fp32_elsewhere: Callable[[], bool] = bool) -> Callable[..., Any]:
    """The kernel of one overload (``off``: what runs while ``on[0][0]`` is 0). The dispatcher passes the schema's
    positional arguments positionally (trailing defaults dropped), keyword-only ones by name (only when given)."""
    exclude = torch._C._ExcludeDispatchKeyGuard

    if rule.lower:  # an unlisted op autocast would run in FP32: as given, as for an op on none of its lists
        fp32 = _make_kernel(op, rule._replace(lower=False), None, [[1]])  # autocast's own FP32 treatment

        def lower_kernel(*args: Any, **kwargs: Any) -> Any:
            if not on[0][0] or fp32_elsewhere():  # plans that disagree: FP32 wins (see _register)
                return fp32(*args, **kwargs)
            with exclude(_NO_AUTOCAST):
                return op(*args, **kwargs)

        return lower_kernel

    if rule.kind == SET_DTYPE:
        index, kwarg_only = rule.dtype_index, rule.dtype_kwarg_only

        def set_dtype_kernel(*args: Any, **kwargs: Any) -> Any:
            if not on[0][0] and off is not None:
                return off(*args, **kwargs)
            if getattr(args[0], "dtype", None) not in HALF_DTYPES:  # FP32/FP64 input: nothing (RMSNorm's mean)
                with exclude(_NO_AUTOCAST):
                    return op(*args, **kwargs)
            positional = not kwarg_only and len(args) > index
            given = args[index] if positional else kwargs.get("dtype")
            if given is None:  # an explicit dtype is the caller's precision
                if positional:
                    args = (*args[:index], _FP32, *args[index + 1 :])
                else:
                    kwargs["dtype"] = _FP32
            with exclude(_NO_AUTOCAST):
                return op(*args, **kwargs)

        return set_dtype_kernel

    batch_norm = rule.kind == BATCH_NORM

    def upcast_kernel(*args: Any, **kwargs: Any) -> Any:
        if not on[0][0] and off is not None:
            return off(*args, **kwargs)
        # batch norm with a 16-bit input and FP32 weight and statistics runs mixed-dtype natively: statistics in
        # FP32 inside the kernel, no FP32 copy of the activation for autograd to keep (see _native_mixed_batch_norm)
        if not (batch_norm and _native_mixed_batch_norm(args[0], args[1:5])):
            args = tuple(map(_up, args))
            if kwargs:
                kwargs = {name: _up(value) for name, value in kwargs.items()}
        with exclude(_NO_AUTOCAST):
            return op(*args, **kwargs)

    return upcast_kernel


# (autocast key, overload) -> [holds, the Library holding its kernel, [its switch: [holds]], rule.lower, kernel]
_KERNELS: dict[tuple[str, str], list[Any]] = {}
# active plans (frozensets of (key, overload, rule)) -> number of handles holding each, and the kernels' switches
_PLANS: dict[frozenset[tuple[str, str, Rule]], int] = {}
_CELLS: dict[frozenset[tuple[str, str, Rule]], list[list[int]]] = {}
_ON: dict[frozenset[tuple[str, str, Rule]], int] = {}  # per registered plan, the holds that switch it on
_DIGESTS: dict[frozenset[tuple[str, str, Rule]], str] = {}  # per plan, its name in the compile cache key
_TARGETS: dict[tuple[str, str], tuple[Any, Any]] = {}  # (key, overload) -> the aten op, what it runs switched off
# Re-entrant: a collected Fabric plugin's finalizer releases its hold from wherever the collector runs, which can be
# inside a registration on this thread (an allocation there triggers it); a plain Lock deadlocked there.
_LOCK = threading.RLock()


def _register(lib: Any, key: str, overload: str, rule: Rule, cell: list[int]) -> list[Any]:
    """The :data:`_KERNELS` entry of one overload, its kernel registered in ``lib``. A kernel that keeps an op in 16
    bits computes it in FP32 while another plan switched on does so at the other device's key (a bf16 and an fp16 fit
    in one process: CUDA autocast runs `exp` in FP32 itself, so the fp16 plan shows its wish on the CPU)."""
    on = [cell]  # the counter that switches it on (its plan's), in a list: another plan gives it one of its own
    others = [(other, overload) for other in AUTOCAST_KEYS if other != key]

    def fp32_elsewhere() -> bool:
        return any((e := _KERNELS.get(name)) is not None and e[2][0][0] > 0 and not e[3] for name in others)

    found = _TARGETS.get((key, overload))
    if found is None:  # asked once per process, before a registration replaces autocast's own kernel
        packet, _, name = overload.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), name or "default")
        found = _TARGETS[(key, overload)] = (op, _autocast_off(op, key, overload))
    kernel = _make_kernel(found[0], rule, found[1], on, fp32_elsewhere)
    lib.impl(overload, kernel, key)
    return [0, lib, on, rule.lower, kernel]


def _compile_key_part() -> str | None:
    """The policy's part of the compile key, asked at each compile: each registered plan's digest, ``+`` where on."""
    with _LOCK:
        for plan in _PLANS.keys() - _DIGESTS.keys():
            _DIGESTS[plan] = digest(repr(sorted(plan)))
        return ",".join(sorted(_DIGESTS[plan] + ("+" if _ON.get(plan) else "-") for plan in _PLANS)) or None


provide("fp32_policy", _compile_key_part)


class Fp32Activation:
    """A hold on an FP32 kernel plan (:meth:`lightning_mp.Fp32Policy.activate`); ``remove()`` releases it, the kernels
    go with the last hold. A context manager. ``on=False``: registered switched off (see :func:`switch`)."""

    def __init__(self, plan: frozenset[tuple[str, str, Rule]], on: bool = True) -> None:
        self._plan: frozenset[tuple[str, str, Rule]] | None = plan
        self._on = on
        with _LOCK:
            count = _PLANS.get(plan, 0)
            _PLANS[plan] = count + 1
            if not count:  # the same plan already registered: one counter, not one per overload
                done: list[tuple[str, str]] = []
                try:
                    with warnings.catch_warnings():  # overriding autocast's own kernel (a user-listed "matmul") warns
                        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")  # once; remove() restores it
                        lib = None  # one for the plan's new kernels: half the time of one each (1 ms, not 2, for 100)
                        cells = [[0]]  # the plan's counter, for its new kernels
                        for key, overload, rule in plan:
                            entry = _KERNELS.get((key, overload))
                            if entry is None:
                                lib = lib or torch.library.Library("aten", "IMPL")
                                entry = _KERNELS[(key, overload)] = _register(lib, key, overload, rule, cells[0])
                            else:  # another plan's: a counter of its own, moved by every plan holding it
                                own = entry[2][0] = [entry[2][0][0]]
                                cells.append(own)
                                for other, theirs in _CELLS.items():
                                    if any(k == key and o == overload for k, o, _ in other):
                                        theirs.append(own)
                            entry[0] += 1
                            done.append((key, overload))
                except BaseException:
                    del _PLANS[plan]
                    _drop(done)
                    raise
                _CELLS[plan] = cells
        if on:
            switch(plan, 1)

    @property
    def active(self) -> bool:
        return self._plan is not None

    def remove(self) -> None:
        plan, self._plan = self._plan, None
        if plan is None:
            return
        if self._on:
            switch(plan, -1)
        with _LOCK:
            count = _PLANS.pop(plan) - 1
            if count:
                _PLANS[plan] = count
            else:
                del _CELLS[plan]
                _ON.pop(plan, None)
                _drop([(key, overload) for key, overload, _ in plan])

    def __enter__(self) -> Fp32Activation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Fp32Activation({len(self._plan or ())} kernels, {'active' if self.active else 'removed'})"


def _drop(kernels: list[tuple[str, str]]) -> None:
    """Release one hold on each kernel (the lock held); the last hold deregisters it. A plan's kernels share a Library,
    which goes with the last of them: where plans overlap, the ones still held get a Library each."""
    gone: dict[int, Any] = {}  # by id, the Libraries of the kernels that go
    for name in kernels:
        entry = _KERNELS[name]
        entry[0] -= 1
        if not entry[0]:
            del _KERNELS[name]
            gone[id(entry[1])] = entry[1]
    for lib in gone.values():
        kept = [(name, entry) for name, entry in _KERNELS.items() if entry[1] is lib]
        lib._destroy()  # torch's autocast kernels (or their fallthrough) are back
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for (key, overload), entry in kept:
                entry[1] = torch.library.Library("aten", "IMPL")
                entry[1].impl(overload, entry[4], key)


def active_kernels(key: str) -> frozenset[str]:
    """The overloads that have a policy kernel at ``key`` right now (for tests and diagnostics)."""
    with _LOCK:
        return frozenset(overload for (k, overload) in _KERNELS if k == key)
