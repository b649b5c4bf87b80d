"""The GPU table's models and their data, held on the device (benchmarks/gpu_table.py).

* :class:`FusedGPT`: the demo GPT at GPT-2 small's shape (12 x 768, 12 heads, sequence 1024) with fused AdamW:
  the rows for correctness and overhead. At 768 wide FP8 cannot win, even compiled (torchao's shape rule converts
  none of its Linears under rowwise), so it has no FP8 row.
* :class:`Llama`: a Llama-shaped decoder (RMSNorm, rotary attention, SwiGLU, no biases, untied head) wide enough for
  FP8's GEMMs to pay for their casts: width 4096, Llama-2-7B's 11008 hidden, 4 layers, sequence 2048. About 1.07 B
  parameters: FP32 masters, gradients and AdamW's state take about 19 GB, the activations of a batch of 4 about
  10 GB, so every row fits in an H100's 80 GB. Each block is compiled on its own (``torch.compile`` per block, as
  torchtitan does): the blocks share one compiled graph, so compiling costs one block's time whatever the depth.

:func:`resident_batches` takes the batches off the host once, before the fit: a step then reads device memory only,
so no row pays a host collation or a pageable copy that would push every ratio toward 1.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mp.demos import GPT, StdlibTextDataModule

GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024)
GPT_TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=32)
LLAMA_WIDE = dict(dim=4096, n_layers=4, n_heads=32, hidden=11008, vocab=32000, seq=2048)
LLAMA_TINY = dict(dim=64, n_layers=2, n_heads=4, hidden=192, vocab=512, seq=32)  # FP8: dimensions multiples of 16


class FusedGPT(GPT):
    """The demo GPT with fused AdamW: the optimizer that skips an overflowed step on the device, without a host read."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, fused=True)


class Resident:
    """A fixed list of batches already on the device, in the order given: what the Trainer iterates each epoch."""

    def __init__(self, batches: list[tuple[Tensor, Tensor]]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def resident_batches(block: int, batch: int, n: int, device: str) -> Resident:
    """``n`` batches of ``batch`` windows of ``block`` bytes of the stdlib text (real text: the loss means something),
    moved to ``device`` once."""
    dm = StdlibTextDataModule(block_size=block, batch_size=batch, seed=0, max_bytes=max(4 << 20, 2 * n * batch * block))
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    return Resident([tuple(t.to(device) for t in next(it)) for _ in range(n)])


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = _rotate(q, cos, sin).to(v.dtype), _rotate(k, cos, sin).to(v.dtype)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)
        self.attn, self.mlp = Attention(dim, n_heads), SwiGLU(dim, hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(L.LightningModule):
    """Llama's layout at the given sizes; ``compile_blocks()`` compiles each block (after any FP8 conversion)."""

    def __init__(self, dim: int, n_layers: int, n_heads: int, hidden: int, vocab: int, seq: int, lr: float = 3e-4):
        super().__init__()
        self.lr = lr
        self.tok_emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.head = nn.Linear(dim, vocab, bias=False)
        # rotary tables in FP32 (non-persistent buffers: no precision plugin casts or checkpoints them)
        inv = 1.0 / (10000 ** (torch.arange(0, dim // n_heads, 2, dtype=torch.float32) / (dim // n_heads)))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # N(0, 0.02); the projections into the residual stream scaled by 1/sqrt(2 n_layers)
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def compile_blocks(self) -> None:
        for i, block in enumerate(self.blocks):
            self.blocks[i] = torch.compile(block)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)
