"""Trainer-free numerics: the loss scaler, master weights, the optimizer step, gradient layout, distributed
reduction, sharding, scheduler guard, grad norm. Imports no Lightning."""

import functools

import torch


def without_grad(fn):
    """``@torch.no_grad()`` for the per-step path: it switches grad mode directly. ``torch.no_grad()`` builds two
    context objects on every call (~120 bytecodes), which cost several microseconds right after a backward, when the
    backward has evicted the interpreter's data from the caches."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return fn(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(prev)

    return run
