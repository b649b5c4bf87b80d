"""FP32 master weights for a model whose parameters live in 16 bits.

Why: an update smaller than half a 16-bit ulp of the weight rounds away. At a weight of 1.0 that is anything
below 2^-8 in bf16 or 2^-11 in fp16, so ``lr * grad`` of 1e-4 never moves a bf16 weight. The optimizer
therefore owns an FP32 copy (the master) of every trainable 16-bit parameter; gradients are accumulated into
the master in FP32 and the 16-bit parameter is re-rounded from the master after each applied step.

Memory per trainable parameter: 2 B (16-bit param) + 4 B (master) + 4 B (FP32 master grad: one buffer per
master, allocated once and refilled every step, so a step allocates nothing and a gradient tensor kept across
steps is overwritten by the next one) + optimizer state; the 16-bit gradient is freed as soon as it is folded into
the master. Activations, the bulk of training memory, are 16-bit.

Bookkeeping:

* :meth:`convert` (Lightning's ``convert_module``) rounds parameters to 16 bits but keeps each one's original
  FP32 tensor. No copy is made: the original storage becomes the master (so a fresh run starts from the exact
  FP32 initialisation, not a rounded one) or, for parameters no optimizer trains, is what :meth:`restore`
  puts back (nothing is rounded behind the user's back).
* :meth:`attach` swaps masters into an optimizer's ``param_groups``; the optimizer never sees a 16-bit tensor.
* :meth:`fold_grads` moves 16-bit gradients into the FP32 master gradients (``master.grad += grad16``), called
  after every backward, so accumulation over micro-batches happens in FP32 (bf16 keeps only 8 significant bits).
* :meth:`copy_to_model` re-rounds the 16-bit parameters from the masters after an applied step.
* :meth:`restore` (teardown) puts the FP32 values back into the model and the model's parameters back into the
  optimizer, leaving both as plain FP32 training would.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.optim import Optimizer


class MasterWeights:
    """Owns the 16-bit <-> FP32 pairing of a model's parameters.

    Args:
        dtype: the 16-bit storage format of the model's parameters.
        keep_fp32: ``keep_fp32(module)`` is true for modules whose own parameters stay FP32 (norm layers...).
    """

    def __init__(self, dtype: torch.dtype, keep_fp32=lambda module: False) -> None:
        self.dtype = dtype
        self._keep_fp32 = keep_fp32
        # param -> its tensor before conversion (for params that have no master)
        self._originals: dict[nn.Parameter, Tensor] = {}
        # parallel lists of 16-bit model params and their FP32 masters
        self.params: list[nn.Parameter] = []
        self.masters: list[nn.Parameter] = []
        # one FP32 gradient buffer per master, reused every step (no per-step allocation): a master's .grad is its
        # buffer from the first backward of an accumulation window until zero_grad sets it to None
        self._grad_buffers: list[Tensor] = []
        self._master_of: dict[nn.Parameter, nn.Parameter] = {}
        self._optimizers: list[Optimizer] = []

    # ------------------------------------------------------------------ set-up
    @torch.no_grad()
    def convert(self, module: nn.Module) -> nn.Module:
        """Store the module's floating parameters in 16 bits (except those of ``keep_fp32`` modules)."""
        # a parameter shared with a kept module (a tied embedding and output head) stays FP32 everywhere
        kept = {p for mod in module.modules() if self._keep_fp32(mod) for p in mod.parameters(recurse=False)}
        for mod in module.modules():
            for p in mod.parameters(recurse=False):
                if p in kept or not p.is_floating_point() or p.dtype == self.dtype or p in self._originals:
                    continue
                self._originals[p] = p.data
                p.data = p.data.to(self.dtype)
        return module

    @torch.no_grad()
    def attach(self, optimizer: Optimizer) -> None:
        """Put FP32 masters in place of the 16-bit parameters this optimizer trains."""
        swapped: dict[Tensor, Tensor] = {}
        for group in optimizer.param_groups:
            new_params = []
            for p in group["params"]:
                if p in self._master_of:
                    master = self._master_of[p]
                elif p in self._originals and p.requires_grad:
                    original = self._originals.pop(p)
                    master = nn.Parameter(original.float(), requires_grad=True)
                    self.params.append(p)
                    self.masters.append(master)
                    self._grad_buffers.append(torch.empty_like(master))
                    self._master_of[p] = master
                else:  # FP32 already (kept modules, or master_weights over an FP32 model): the param is its master
                    master = p
                if master is not p:
                    swapped[p] = master
                new_params.append(master)
            group["params"][:] = new_params  # in place: LBFGS keeps a reference to this very list
        _rekey_state(optimizer, swapped)
        self._optimizers.append(optimizer)

    # ------------------------------------------------------------------ per step
    @torch.no_grad()
    def fold_grads(self) -> None:
        """``master.grad += param.grad`` in FP32 for every 16-bit param with a gradient; frees the 16-bit grad.

        Two fused calls for the whole model: masters without a gradient (first micro-batch of a window) get their
        buffer filled with the cast of the 16-bit gradient (``_foreach_copy_`` casts), the others take a
        mixed-dtype ``_foreach_add_``. The Python loop only sorts tensors into the two lists.
        """
        fresh, fresh_grads, acc, acc_grads = [], [], [], []
        for p, m, buf in zip(self.params, self.masters, self._grad_buffers):
            g = p.grad
            if g is None:
                continue
            if m.grad is None:
                m.grad = buf
                fresh.append(buf)
                fresh_grads.append(g)
            else:
                acc.append(m.grad)
                acc_grads.append(g)
            p.grad = None
        if fresh:
            torch._foreach_copy_(fresh, fresh_grads)
        if acc:
            torch._foreach_add_(acc, acc_grads)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Re-round the 16-bit parameters from the masters (one fused copy with the cast)."""
        if self.params:
            torch._foreach_copy_(self.params, self.masters)

    # ------------------------------------------------------------------ access
    def master_of(self, param: nn.Parameter) -> nn.Parameter | None:
        return self._master_of.get(param)

    def fp32_value(self, param: nn.Parameter) -> Tensor | None:
        """The exact FP32 value of a converted parameter (its master, or its untouched original)."""
        master = self._master_of.get(param)
        if master is not None:
            return master.detach()
        return self._originals.get(param)

    # ------------------------------------------------------------------ teardown
    @torch.no_grad()
    def restore(self) -> None:
        """Give the model back its FP32 values and the optimizers back the model's parameters."""
        back = {m: p for p, m in self._master_of.items()}
        for opt in self._optimizers:
            for group in opt.param_groups:
                group["params"][:] = [back.get(q, q) for q in group["params"]]
            _rekey_state(opt, back)
        for p, m in zip(self.params, self.masters):
            p.data = m.data
            p.grad = m.grad
        for p, original in self._originals.items():
            p.data = original
        self._originals.clear()
        self.params, self.masters, self._grad_buffers = [], [], []
        self._master_of.clear()
        self._optimizers.clear()


def _rekey_state(optimizer: Optimizer, mapping: dict) -> None:
    """Optimizer state is keyed by parameter object: follow the swap so no state is orphaned."""
    for old, new in mapping.items():
        if old in optimizer.state:
            optimizer.state[new] = optimizer.state.pop(old)
