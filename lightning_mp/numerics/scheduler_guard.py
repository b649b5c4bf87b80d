"""Keep the learning-rate schedule still on skipped steps.

Lightning steps ``interval="step"`` schedulers after every optimizer step it asked for, including steps the
loss scaler skipped (Lightning issues 5558, 18828): with FP16 at a high initial scale the first steps are all
skipped and the warm-up schedule runs ahead of the weights. The guard makes ``scheduler.step()`` a no-op when
the training step it follows was skipped.

Mechanism: the scheduler's class is swapped for a subclass whose ``step`` checks the flag, and swapped back at
teardown. A subclass, not a wrapper object, so ``isinstance`` checks, ``state_dict()`` (which copies the
instance ``__dict__``) and Lightning's own scheduler handling see the same object with the same state.

The guard holds its schedulers weakly (:func:`_ref`): a Fabric loop's scheduler is built on Fabric's optimizer
wrapper, which holds the strategy and so the plugin. Held strongly from the plugin's core (which the plugin's teardown
finalizer holds), it kept a dropped plugin alive for the life of the process, and with it the FP32 policy's kernels.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Callable

_GUARDED: dict[type, type] = {}
# scheduler -> its skip predicate; outside the instance so state_dict() (a copy of __dict__) never sees it
_SKIP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _guarded_class(cls: type) -> type:
    if cls not in _GUARDED:

        def step(self, *args: Any, **kwargs: Any) -> None:
            skip = _SKIP.get(self)
            if skip is not None and skip():
                return
            cls.step(self, *args, **kwargs)

        def __reduce_ex__(self, protocol: int) -> Any:
            # pickle and deepcopy see the scheduler's own class: the copy is an ordinary, unguarded scheduler
            # (the guard belongs to this run's plugin), and the dynamic subclass never has to be importable
            return (_new_instance, (cls,), self.__getstate__())

        _GUARDED[cls] = type(
            cls.__name__, (cls,), {"step": step, "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__}
        )
    return _GUARDED[cls]


def _new_instance(cls: type) -> Any:
    return cls.__new__(cls)


def _ref(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj``, or a strong one where it takes none (a class with ``__slots__``)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class WeakSchedulers:
    """Schedulers as a front end passed them, held weakly; iterating gives the ones still alive (a core's record of
    ``guard_schedulers``, replayed by a precision schedule's switch)."""

    def __init__(self, schedulers: Iterable[Any]) -> None:
        self._refs = [_ref(s) for s in schedulers]

    def __iter__(self) -> Iterator[Any]:
        return (s for s in (ref() for ref in self._refs) if s is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class SchedulerGuard:
    """Holds schedulers still while ``skip()`` is true; ``remove()`` restores the ones still alive."""

    def __init__(self, schedulers: Iterable[Any], skip: Callable[[], bool]) -> None:
        self._schedulers = []
        for scheduler in schedulers:
            if not callable(getattr(scheduler, "step", None)) or type(scheduler) in _GUARDED.values():
                continue
            original = type(scheduler)
            scheduler.__class__ = _guarded_class(original)
            _SKIP[scheduler] = skip
            self._schedulers.append((_ref(scheduler), original))

    def __getstate__(self) -> dict[str, Any]:  # a pickled plugin (ddp_spawn, torch.save mid-run): its copy guards none
        return {"_schedulers": []}  # (pickled schedulers come back as their own class, unguarded: _guarded_class)

    def remove(self) -> None:
        for ref, original in self._schedulers:
            scheduler = ref()
            if scheduler is not None:
                scheduler.__class__ = original
                _SKIP.pop(scheduler, None)
        self._schedulers.clear()
