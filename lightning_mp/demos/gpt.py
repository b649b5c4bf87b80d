"""A small nanoGPT-style causal transformer that also runs with 16-bit parameters and under autocast."""

from __future__ import annotations

import functools
import math
from typing import Any, Literal, Optional, Union

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from lightning_mp.validation import check_int, check_number

_LR_SCHEDULES = ("constant", "cosine")

#: The demo recipe that ``benchmarks/gpt_run.py`` and ``examples/train_gpt.py`` train with (GPT's own defaults
#: keep a constant lr, so code that builds ``GPT()`` and calls ``configure_optimizers()`` gets a bare optimizer).
#: Peak lr 1e-3 (nanoGPT's for small character-level models), a linear warmup of 40 steps, 2 / (1 - beta2) with
#: beta2 = 0.95: about the steps AdamW's second-moment average needs before it stops dividing by a near-zero
#: estimate (Ma & Yarats' rule of thumb for an untuned warmup), then a cosine to 0.1 x peak at the last step.
#: Measured on the default 4x256 model, 16 x 128-byte batches, gradients clipped at 1.0, FP32, seeds 0-3: with no
#: warmup the loss jumps at step 8 or 9 by 1.0, 2.1, 4.2 and 1.8 nats (to 4.0-7.5), the seed deciding how much;
#: with this recipe no seed rises more than 0.41 above its running minimum in 60 steps (a hard batch: a 20-step
#: warmup has its largest rise on the same step), and the seeds' mean losses over steps 30-39 spread 0.06, not 0.11.
RECIPE: dict[str, Any] = {"lr": 1e-3, "warmup_steps": 40, "lr_schedule": "cosine", "min_lr_ratio": 0.1}


def lr_factor(step: int, warmup_steps: int, decay_steps: Optional[int], min_lr_ratio: float) -> float:
    """The multiple of the peak lr at optimizer step ``step`` (0-based): a linear warmup over ``warmup_steps``
    (``(step + 1) / (warmup_steps + 1)``, as nanoGPT: never 0, so step 0 moves the weights a little), then 1.0, or
    with ``decay_steps`` a cosine from 1.0 at ``warmup_steps`` to ``min_lr_ratio`` at ``decay_steps``, which it
    stays at after that."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay_steps is None:
        return 1.0
    if step >= decay_steps:
        return min_lr_ratio
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)  # one matmul for q, k and v
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # is_causal=True builds the mask inside the kernel: no (T, T) mask tensor of some fixed dtype
        # to mismatch the activations, and fused kernels can skip the masked half of the work.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(L.LightningModule):
    """A small nanoGPT-style causal language model.

    ``forward(idx)`` maps int64 tokens ``(B, T)`` with ``T <= block_size`` to logits ``(B, T, vocab_size)``.
    All tensors the forward creates are integer positions; everything floating comes from the parameters,
    so the model follows whatever dtype its parameters are stored in and whatever autocast decides.

    Cost: roughly ``12 * n_layer * n_embd**2`` parameters in the blocks plus ``(vocab_size + block_size) *
    n_embd`` in the embeddings (the output head shares the token embedding). The defaults give about
    3.2M parameters.

    Optimizer: AdamW with nanoGPT's weight-decay groups. The learning rate is constant at ``lr`` unless
    ``warmup_steps`` > 0 (a linear ramp up to ``lr`` over that many optimizer steps) or ``lr_schedule="cosine"``
    (after the warmup, a cosine down to ``min_lr_ratio * lr`` at ``decay_steps``, by default the trainer's
    ``estimated_stepping_batches``). With either, ``configure_optimizers`` returns Lightning's dict with a
    per-step scheduler; with neither, the bare optimizer (which Fabric's ``setup`` takes). The recipe of
    ``benchmarks/gpt_run.py`` and ``examples/train_gpt.py`` (:data:`RECIPE`) warms up: without a warmup, AdamW's
    first steps at a high ``lr`` make early loss spikes whose size depends on the seed, in FP32 as in 16 bits.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 256,
        dropout: float = 0.0,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        min_lr_ratio: float = 0.1,
        decay_steps: Optional[int] = None,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                            ("n_head", n_head), ("n_embd", n_embd)):
            check_int(name, value, 1)
        check_number("lr", lr, 0.0, low_open=True)
        check_int("warmup_steps", warmup_steps, 0)
        if lr_schedule not in _LR_SCHEDULES:
            allowed = ", ".join(map(repr, _LR_SCHEDULES))
            raise ValueError(f"lr_schedule={lr_schedule!r} is not allowed: use one of {allowed}.")
        check_number("min_lr_ratio", min_lr_ratio, 0.0)
        if min_lr_ratio > 1:
            raise ValueError(f"min_lr_ratio={min_lr_ratio!r} is not allowed: use a number in [0, 1] (the lr the "
                             "cosine ends at, as a fraction of lr).")  # fmt: skip
        check_int("decay_steps", decay_steps, 1, allow_none="the trainer's estimated_stepping_batches")
        if n_embd % n_head:
            raise ValueError(f"n_embd must be divisible by n_head={n_head!r}, got n_embd={n_embd!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.save_hyperparameters()
        self.block_size = block_size

        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        # Weight tying: the head reuses the token embedding (one fewer vocab x n_embd matrix to store,
        # update and keep in optimizer state).
        self.head.weight = self.tok_emb.weight

        # nanoGPT init: N(0, 0.02) everywhere, and the projections that write into the residual stream
        # scaled by 1/sqrt(2 * n_layer), since 2 * n_layer of them add up along the residual path.
        self.apply(self._init_weights)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

        # Validation metrics. They hold running sums across the epoch, so the epoch value is over all
        # validation tokens rather than an average of per-batch values.
        self.val_ppl = Perplexity()
        self.val_acc = MulticlassAccuracy(num_classes=vocab_size, average="micro")

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length must be <= block_size={self.block_size!r}, got {T!r}")
        # arange is int64 and indexes the embedding, so the added activations take the parameter dtype.
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @staticmethod
    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy, in nats. Under autocast ``cross_entropy`` runs in float32."""
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        loss = self.loss_fn(logits, y)
        # Every example has the same number of tokens, so weighting each batch's mean by its batch size
        # makes the epoch val_loss the mean over tokens, and val_ppl == exp(val_loss) up to rounding.
        # sync_dist averages over devices once, at the end of the epoch (the metrics sync themselves).
        self.log("val_loss", loss, prog_bar=True, batch_size=x.shape[0], sync_dist=True)
        # Perplexity rejects bfloat16 and softmaxes its input, so hand the metrics float32 logits
        # (B*T*V floats: 0.5M per default batch, small next to the activations). update() rather than
        # calling the metric: nobody reads a per-batch value, so don't pay to compute one.
        logits = logits.float()
        self.val_ppl.update(logits, y)
        self.val_acc.update(logits.view(-1, logits.size(-1)), y.view(-1))
        self.log("val_ppl", self.val_ppl, batch_size=x.shape[0])
        self.log("val_acc", self.val_acc, batch_size=x.shape[0])

    def configure_optimizers(self) -> Union[torch.optim.Optimizer, dict[str, Any]]:
        # nanoGPT grouping: decay the matrices (linear weights, embeddings), not biases or LayerNorm
        # parameters. parameters() yields the tied embedding/head weight once.
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas))
        if hp.warmup_steps == 0 and hp.lr_schedule == "constant":
            return optimizer
        decay_steps = None
        if hp.lr_schedule == "cosine":
            decay_steps = hp.decay_steps
            if decay_steps is None:
                if self._trainer is None:
                    raise ValueError(
                        "decay_steps=None is not allowed without a Trainer: lr_schedule='cosine' needs the step it "
                        "ends at. HINT: pass decay_steps (e.g. the number of optimizer steps you will take)."
                    )
                decay_steps = int(self.trainer.estimated_stepping_batches)
        # a partial of a module-level function rather than a lambda, so the scheduler pickles (spawned workers,
        # deepcopy); its state_dict holds only the step, and the schedule comes from the hyperparameters on resume
        factor = functools.partial(
            lr_factor, warmup_steps=hp.warmup_steps, decay_steps=decay_steps, min_lr_ratio=hp.min_lr_ratio
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @torch.no_grad()
    def generate(
        self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None
    ) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``(B, T)``, cropping the context to block_size.

        Each new token reruns the whole context (no key/value cache): fine for a demo, quadratic in length.
        """
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.block_size :])[:, -1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)], dim=1)
        return idx


# ----------------------------------------------------------------------------------------------------
# Images: a small ResNet with BatchNorm on scikit-learn's handwritten digits.
# ----------------------------------------------------------------------------------------------------
