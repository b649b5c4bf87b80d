"""A small nanoGPT-style causal transformer that also runs with 16-bit parameters and under autocast."""

from __future__ import annotations

import math
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from lightning_mp.validation import check_int


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
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                            ("n_head", n_head), ("n_embd", n_embd)):
            check_int(name, value, 1)
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

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # nanoGPT grouping: decay the matrices (linear weights, embeddings), not biases or LayerNorm
        # parameters. parameters() yields the tied embedding/head weight once.
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.hparams.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=tuple(self.hparams.betas))

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
