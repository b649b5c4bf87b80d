"""LoRA on a frozen bf16 base: peak tensor memory above the base, lightning_mp (emulated and native GEMMs) against
Lightning's bf16-mixed. One subprocess per row.

The model is a transformers ``LlamaForCausalLM`` built from a config (random weights, nothing downloaded), loaded in
bf16 and frozen, with rank-``r`` FP32 adapters on every attention and MLP projection (peft's ``LoraLayer``
arithmetic, written out: peft is not a dependency; transformers is, in the `bench` and `dev` extras). Each row
trains it for a few steps with AdamW on the adapters.

Peak above base: the most bytes held in tensors at once during ``fit`` (every allocation and free of torch's CPU
allocator, from ``torch.profiler`` with ``profile_memory``: what ``torch.cuda.max_memory_allocated`` reports on a
GPU), minus the base model's bytes. Also printed: the largest weight's FP32 size, the unit emulated GEMMs' FP32
operand copies come in.

    python benchmarks/lora_memory_benchmark.py
    python benchmarks/lora_memory_benchmark.py --hidden 256 --layers 2 --vocab 8192 --seq 32   # a quick look
"""

from __future__ import annotations

import argparse
import json
import sys

ROWS = ("bf16-mixed", "lightning_mp bf16, gemm='emulated'", "lightning_mp bf16, gemm='native'")


def build(args):
    import torch
    import transformers
    from torch import nn

    class LoRALinear(nn.Module):
        def __init__(self, base: nn.Linear, r: int):
            super().__init__()
            self.base = base
            self.lora_a = nn.Linear(base.in_features, r, bias=False)
            self.lora_b = nn.Linear(r, base.out_features, bias=False)
            nn.init.zeros_(self.lora_b.weight)

        def forward(self, x):
            return self.base(x) + self.lora_b(self.lora_a(x))

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.seq, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    net = transformers.LlamaForCausalLM(config).to(torch.bfloat16).requires_grad_(False)
    for layer in net.model.layers:
        for block in (layer.self_attn, layer.mlp):
            for name, child in list(block.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(block, name, LoRALinear(child, args.rank))
    return net


def worker(row: str, args) -> dict:
    import itertools

    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mp import MixedPrecisionPlugin

    torch.set_num_threads(args.threads)
    net = build(args)

    class Lm(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.net(input_ids=ids, labels=ids).loss.float()

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    base = sum(t.untyped_storage().nbytes() for t in itertools.chain(net.parameters(), net.buffers()))
    largest = max((p for p in net.parameters() if p.dim() == 2), key=lambda p: p.numel())
    ids = torch.randint(0, args.vocab, (args.batch * args.steps, args.seq), generator=torch.Generator().manual_seed(0))
    if row == "bf16-mixed":
        kwargs = dict(precision="bf16-mixed")
    else:
        kwargs = dict(plugins=[MixedPrecisionPlugin("bf16", gemm=row.split("'")[1])])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **kwargs)  # fmt: skip
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.fit(Lm(), DataLoader(TensorDataset(ids), batch_size=args.batch))
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() ==
              torch.autograd.DeviceType.CPU]  # fmt: skip
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()  # negative for a free
        peak = max(peak, live)
    return {"base": base, "peak_above_base": peak, "largest_fp32": largest.numel() * 4,
            "largest": f"{tuple(largest.shape)}", "params": sum(p.numel() for p in net.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return

    import torch

    from lightning_mp.gemm.support import cpu_capability

    from harness import worker_row

    results = {row: worker_row(__file__, *sys.argv[1:], "--worker", row) for row in ROWS}
    first = results[ROWS[0]]
    mib = 2**20
    print(f"CPU capability: {cpu_capability()}; torch {torch.__version__}; {args.threads} thread(s); Llama "
          f"{args.layers}x{args.hidden}, vocab {args.vocab}, {first['params'] / 1e6:.0f}M parameters in bf16 "
          f"({first['base'] / mib:.0f} MiB), LoRA r={args.rank}; batch {args.batch} x {args.seq}, {args.steps} steps; "
          f"largest weight {first['largest']}: {first['largest_fp32'] / mib:.0f} MiB in FP32")
    print("\n| row | peak above base (MiB) | in largest FP32 weights |\n|---|---:|---:|")
    for row, r in results.items():
        print(f"| {row} | {r['peak_above_base'] / mib:.0f} | {r['peak_above_base'] / r['largest_fp32']:.1f} |")


if __name__ == "__main__":
    main()
