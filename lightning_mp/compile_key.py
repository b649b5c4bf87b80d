"""torch.compile's caches see the package's kernels: while they change what a trace records, the cache key says so.

Why
---
The FP32 policy (:mod:`lightning_mp.policy.dispatch`) and the emulated GEMMs (:mod:`lightning_mp.gemm.emulation`)
are ``torch.library`` kernels, at the autocast keys and at ``ADInplaceOrView``. Dynamo's graph is recorded above the
dispatcher, so it is the same with and without them; AOTAutograd then traces that graph through the dispatcher, and
the forward and backward graphs it builds hold the policy's FP32 casts and the emulation's FP32 GEMMs, or not. Its
cache (``TORCHINDUCTOR_AUTOGRAD_CACHE``, on by default, on disk and shared by every process of the user) keys an
entry by the Dynamo graph, the inputs, the configs and the autocast state, not by the registered kernels: a
``bf16-mixed`` run and a run with the plugin, of the same model, got each other's graphs (the second run's losses
were the first run's, bit for bit).

How
---
``torch.compiler.config.cache_key_tag`` enters every compile cache key (AOTAutograd's, inductor's FX graph cache,
autotuning, profile-guided recompilation). While a kernel set is in force, the tag carries a part naming its state
(:func:`provide`, :func:`count_part`): the policy's kernels by a digest of their plans and whether each is switched
on, the emulation by the 16-bit format it emulates. Runs in the same state share their cache entries (also across
processes: the parts are stable strings); runs in different states never do. With no part set the tag is the user's
own, so ``bf16-mixed`` and other users keep torch's keys. A tag the user set is kept, in front of the parts.

When
----
The parts change where a kernel set is registered, switched or entered (the Fabric plugin switches the policy's
kernels twice per iteration): that costs a dict update, or nothing for a part computed when asked (:func:`provide`,
the policy's). The tag itself is written by a callback torch runs at the
start of every compile, Dynamo's and a lazily compiled backward's (``torch._dynamo.callback``), where the cache keys
are computed: the state at that moment is the state the trace records. Writing it at every switch instead (through
``torch.compiler.config``'s Python ``__setattr__``) cost about 5% of a tiny MLP's Fabric step. A compile outside our
forwards while a run holds its kernels gets the tag too: a cache miss at worst, never a graph of another state.
Compiles that bypass Dynamo (a backend called by hand) do not run the callback and see the tag of the last compile.
``torch._dynamo.reset()`` clears torch's callbacks but keeps this one (:class:`_Callbacks`).

Not covered: Dynamo's own in-memory cache, kept per code object (a model class's ``forward``, a ``training_step``)
across ``torch.compile`` calls, which guards on neither the tag nor the kernels. A second fit in one process over
the same model class can run the code the first compiled where nothing else it guards on differs (seen: two fits with
different ``fp32_ops``; a ``bf16-mixed`` fit and one with the plugin differ in the copies' hooks, and recompile).
``torch._dynamo.reset()`` between such fits.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable

import torch.compiler.config as _compiler_config
from torch._dynamo.callback import callback_handler

_PARTS: dict[str, str] = {}
_PROVIDERS: dict[str, Callable[[], str | None]] = {}  # parts computed with the tag (the policy's: no cost per switch)
_COUNTS: dict[str, dict[str, int]] = {}  # per counted part, its values and how many hold each
# Re-entrant: a collected plugin's finalizer releases its kernels from wherever the collector runs, which can be
# inside a write of the tag on this thread (an allocation there triggers it)
_LOCK = threading.RLock()
_MARK = "|lightning_mp."  # what begins each of our parts: the user's own tag is what comes before the first


def digest(text: str) -> str:
    """A short stable name for ``text`` (the same in every process)."""
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:12]


def provide(name: str, part: Callable[[], str | None]) -> None:
    """Our part ``name`` of the tag is ``part()`` (``None``: no such part), called when a compile starts."""
    _PROVIDERS[name] = part


def _parts() -> dict[str, str]:  # the lock held
    provided = {name: value for name, part in _PROVIDERS.items() if (value := part()) is not None}
    return {**_PARTS, **provided}


def count_part(name: str, value: str, delta: int) -> None:
    """One more (``+1``) or one less (``-1``) holder of ``value`` in the part ``name``, which lists the values held
    (several threads or runs at once: a value goes when its last holder does)."""
    with _LOCK:
        counts = _COUNTS.setdefault(name, {})
        counts[value] = counts.get(value, 0) + delta
        if counts[value] <= 0:
            del counts[value]
        _write(name, ",".join(sorted(counts)) or None)


def _write(name: str, value: str | None) -> None:
    if value is None:
        _PARTS.pop(name, None)
    else:
        _PARTS[name] = value


def tag() -> str:
    """The tag as a compile starting now sees it (written by :func:`_sync`): the user's, then our parts. The user's is
    read from the config each time, as what precedes our first part: torch restores configs it patched around a
    compile (a lazily compiled backward's), which can put back a tag of ours written earlier."""
    with _LOCK:
        base = _compiler_config.cache_key_tag.split(_MARK, 1)[0]
        return base + "".join(f"{_MARK}{key}={part}" for key, part in sorted(_parts().items()))


def _sync(_args: object = None) -> None:
    """At the start of a compile (the outermost, where the keys are computed): the tag names the parts in force."""
    with _LOCK:
        new = tag()
        if new != _compiler_config.cache_key_tag:  # unchanged: no write (a run without our kernels: none ever)
            _compiler_config.cache_key_tag = new


class _Callbacks(list):
    """torch's list of compile-start callbacks, keeping :func:`_sync` through ``torch._dynamo.reset()``, which clears
    it (and which the docs advise between fits): a compile after a reset would see the tag of the compile before."""

    def clear(self) -> None:
        super().clear()
        self.append(_sync)


def _hook() -> None:
    if not isinstance(callback_handler.start_callbacks, _Callbacks):
        callback_handler.start_callbacks = _Callbacks(callback_handler.start_callbacks)
    if _sync not in callback_handler.start_callbacks:
        callback_handler.start_callbacks.append(_sync)


_hook()


def current_parts() -> dict[str, str]:
    """Our parts of the tag now (for tests and diagnostics)."""
    with _LOCK:
        return _parts()
