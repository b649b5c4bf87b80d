"""A model zoo: lightning_mp against Lightning's own precisions on several small models, in one process.

    python benchmarks/zoo.py                          # every model, 4 rounds x 8 steps, 1 thread
    python benchmarks/zoo.py --models gpt2-2x64 llama-2x64 --rounds 6
    python benchmarks/zoo.py --quick                  # every model at a tiny size (a smoke test)
    python benchmarks/zoo.py --bytecodes              # also Python bytecodes per step, a count with no noise
    python benchmarks/zoo.py --unchecked              # also ours bf16 without its inf/NaN check, as bf16-mixed runs
    python benchmarks/zoo.py --faults                 # also the page faults of a step (the allocator's share of it)
    python benchmarks/zoo.py --steady-malloc          # the same with glibc keeping freed memory: no page faults

For each model, four variants train through a real ``lightning.Trainer`` on random tokens (random images for
the ResNet): ``32-true``, Lightning's ``bf16-mixed``, and ``MixedPrecisionPlugin("bf16")`` / ``("fp16")`` with
their defaults (``gemm="auto"``: fp16 GEMMs are emulated on CPUs without fp16 arithmetic). Every fit builds a
fresh model from the same seed. The variants are interleaved: in each round every variant runs ``--steps``
steps, and every other round runs them in reverse order, so a slowing machine or what ran just before weighs on
all of them alike. Each step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` (forward,
backward, unscale/check, optimizer step) by two clocks: CPU time of the training thread (``time.thread_time``;
on a shared CPU it counts only this step's own work, exact with ``--threads 1``, where torch computes on that
thread) and wall time. The first ``--warmup`` steps of every fit are dropped.

Page faults: glibc's ``malloc`` gives large freed blocks back to the kernel (above its adaptive mmap threshold, or
trimmed off the top of the heap), and the kernel zeroes every 4 KiB page of the next such allocation on its first
touch. A step that allocates what the previous one freed pays that again every step, whatever the precision, and
how much depends on the order of allocations, which differs between variants and between processes. ``--faults``
adds a table of the minor faults per step (``getrusage``, this thread); ``--steady-malloc`` reruns the zoo in a
child process whose glibc keeps freed memory (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``), so that the
ratios compare the variants' own work.

A variant's ms/step is the median over rounds of its per-round median step; a ratio is the median over rounds of
the per-round ratio (two variants timed in the same round, minutes apart at most), with its range over rounds in
brackets. ``transformers`` models are skipped, with one line, where it is not installed
(``pip install -e ".[bench]"``). A variant that raises is reported in its model's row and the zoo goes on.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import subprocess
import sys
import time
import warnings
import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.demos import GPT, ResNet

try:
    import transformers
except ImportError:  # the bench extra is not installed: the transformers models are skipped
    transformers = None

VOCAB = 1024  # tokens for the models we build; the demo GPT is byte-level (256)
# --steady-malloc: glibc serves every allocation below 1 GiB from its heap and never trims it (read at start-up)
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
try:
    import resource
except ImportError:  # Windows: no fault counter (the column then reads 0)
    resource = None


def _faults() -> int:
    """Minor page faults so far: this thread's on Linux, the process's elsewhere."""
    if resource is None:
        return 0
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt


class StepTimer(Callback):
    """CPU time of the training thread, wall time and minor page faults of every training step (CUDA synchronized)."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.faults: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self._t0 = (time.thread_time(), time.perf_counter(), _faults())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self.cpu.append(time.thread_time() - self._t0[0])
        self.wall.append(time.perf_counter() - self._t0[1])
        self.faults.append(_faults() - self._t0[2])


class BytecodeCounter(Callback):
    """Python bytecodes the training thread runs in one training step (``on_train_batch_start`` to ``_end``), counted
    with ``sys.settrace``'s opcode events: deterministic, so a few hundred bytecodes of overhead show where timings
    on a shared CPU move by several percent. Counts Python only (not the C++ ops, not their cost per bytecode)."""

    def __init__(self, step: int) -> None:
        self.step, self.count = step, 0

    def _trace(self, frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.count += 1
        return self._trace

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            sys.settrace(self._trace)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sys.settrace(None)


class TokenLM(L.LightningModule):
    """Next-token cross-entropy over a network that maps tokens ``(B, T)`` to logits ``(B, T, V)``, or to an output
    that holds them in ``.logits`` (``transformers``)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        logits = getattr(out, "logits", out)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class TransformerEncoderLM(nn.Module):
    """A causal ``nn.TransformerEncoder`` language model (pre-norm, learned positions)."""

    def __init__(self, n_layer: int, d_model: int, block_size: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        layer = nn.TransformerEncoderLayer(d_model, max(1, d_model // 32), 4 * d_model, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=x.device)
        h = self.encoder(self.tok(x) + self.pos(torch.arange(T, device=x.device)), mask=mask, is_causal=True)
        return self.head(h)


def _tokens(batch: int, seq: int, vocab: int = VOCAB, batches: int = 4) -> DataLoader:
    data = torch.randint(0, vocab, (batch * batches, seq + 1), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch)


def _images(batch: int, size: int, batches: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch * batches, 1, size, size, generator=g)
    labels = torch.randint(0, 10, (batch * batches,), generator=g)
    return DataLoader(TensorDataset(images, labels), batch_size=batch)


def _hf(config_name: str, model_name: str, **config) -> nn.Module:
    # token ids 0: GPT-2's default ids (50256) lie outside our small vocabulary
    config = getattr(transformers, config_name)(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, **config)
    return getattr(transformers, model_name)(config)


def gpt(quick):
    n_layer, n_embd, batch, seq = (1, 32, 2, 16) if quick else (3, 128, 16, 64)
    return GPT(n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 32), block_size=seq), _tokens(batch, seq, 256)


def resnet(quick):
    width, batch = (4, 8) if quick else (16, 128)
    return ResNet(width=width), _images(batch, 16)


def encoder(quick):
    n_layer, d_model, batch, seq = (1, 32, 2, 16) if quick else (3, 128, 16, 64)
    return TokenLM(TransformerEncoderLM(n_layer, d_model, seq)), _tokens(batch, seq)


def gpt2(n_layer, n_embd, batch, seq):
    def build(quick):
        n_layer_, n_embd_, batch_, seq_ = (1, 32, 2, 16) if quick else (n_layer, n_embd, batch, seq)
        net = _hf("GPT2Config", "GPT2LMHeadModel", n_layer=n_layer_, n_embd=n_embd_, n_head=max(1, n_embd_ // 32),
                  n_positions=seq_)
        return TokenLM(net), _tokens(batch_, seq_)

    return build


def llama(quick):
    hidden, batch, seq = (32, 2, 16) if quick else (64, 8, 64)
    net = _hf("LlamaConfig", "LlamaForCausalLM", hidden_size=hidden, intermediate_size=4 * hidden,
              num_hidden_layers=1 if quick else 2, num_attention_heads=2, num_key_value_heads=2,
              max_position_embeddings=seq)
    return TokenLM(net), _tokens(batch, seq)


# name -> (builder(quick) -> (LightningModule, train DataLoader), needs transformers); full sizes in the builders
MODELS = {
    "gpt": (gpt, False),  # lightning_mp.demos.GPT 3 layers x 128, batch 16 x 64
    "resnet": (resnet, False),  # lightning_mp.demos.ResNet-14 (BatchNorm), 1x16x16 images, batch 128
    "encoder": (encoder, False),  # nn.TransformerEncoder 3 layers x 128, batch 16 x 64
    "gpt2-2x64": (gpt2(2, 64, 8, 64), True),  # transformers GPT2LMHeadModel, batch 8 x 64
    "gpt2-4x256": (gpt2(4, 256, 8, 128), True),  # batch 8 x 128
    "llama-2x64": (llama, True),  # transformers LlamaForCausalLM, batch 8 x 64
}

# variant -> Trainer precision arguments
VARIANTS = {
    "fp32": lambda: {"precision": "32-true"},
    "bf16-mixed": lambda: {"precision": "bf16-mixed"},
    "ours bf16": lambda: {"plugins": [MixedPrecisionPlugin("bf16")]},
    "ours fp16": lambda: {"plugins": [MixedPrecisionPlugin("fp16")]},
}
# (column, numerator, denominator)
RATIOS = [("ours bf16 / bf16-mixed", "ours bf16", "bf16-mixed"), ("ours fp16 / fp32", "ours fp16", "fp32")]
# --unchecked: what ours bf16 costs beyond bf16-mixed without the inf/NaN check of every step (bf16-mixed has none)
UNCHECKED = {"ours bf16 unchecked": lambda: {"plugins": [MixedPrecisionPlugin("bf16", check_finite=False)]}}


def _fit(build, variant: str, args, callback: Callback) -> None:
    """One short fit of a fresh model from the same seed, with ``callback`` watching its steps."""
    L.seed_everything(0, verbose=False)
    model, loader = build(args.quick)
    precision = (VARIANTS.get(variant) or UNCHECKED[variant])()
    trainer = L.Trainer(
        accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=1, max_steps=args.steps,
        callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, **precision,
    )
    trainer.fit(model, loader)


def fit(build, variant: str, args) -> tuple[float, float, float]:
    """One short fit of a fresh model; the median (CPU, wall) seconds and minor page faults of its timed steps."""
    timer = StepTimer()
    _fit(build, variant, args, timer)
    return tuple(statistics.median(t[args.warmup :]) for t in (timer.cpu, timer.wall, timer.faults))


def bytecodes(build, variant: str, args) -> int:
    """Python bytecodes of one training step (the last of ``--steps``) of a fresh fit, in a warm process: a first fit
    runs untraced (the first fit of a process also runs one-time work: imports, caches, kernel registrations)."""
    _fit(build, variant, args, Callback())
    counter = BytecodeCounter(args.steps - 1)
    # the collector off: a collection of an earlier fit's cycles (weakref callbacks, finalizers) inside the counted
    # step is Python that is not the step's, and when it falls there depends on the process's history
    gc.collect()
    gc.disable()
    try:
        _fit(build, variant, args, counter)
    finally:
        gc.enable()
    return counter.count


def describe(build, quick: bool) -> str:
    """What the zoo trains, from the model and the data themselves: the class, parameters, one batch's shape."""
    model, loader = build(quick)
    net = getattr(model, "net", model)
    params = sum(p.numel() for p in net.parameters())
    return f"{type(net).__name__}, {params / 1e6:.2f}M params, batch {tuple(next(iter(loader))[0].shape)}"


def run_model(build, args, variants=None) -> tuple[dict, dict]:
    """Interleaved rounds: per variant its per-round (cpu, wall), empty where it raised; the errors met."""
    variants = list(variants or VARIANTS)
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    errors: dict[str, str] = {}
    for r in range(args.rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            if variant in errors:
                continue
            try:
                times[variant].append(fit(build, variant, args))
            except Exception as e:  # the plugin is work in progress: report the failure, time the rest
                errors[variant] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:200]
                times[variant] = []
    return times, errors


def _ratio(times: dict, num: str, den: str, clock: int) -> str:
    if not times[num] or not times[den]:
        return "error"
    per_round = [a[clock] / b[clock] for a, b in zip(times[num], times[den])]
    spread = f" [{min(per_round):.2f}-{max(per_round):.2f}]" if len(per_round) > 1 else ""
    return f"{statistics.median(per_round):.3f}{spread}"


def _ms(times: dict, variant: str, clock: int) -> str:
    return f"{statistics.median(t[clock] for t in times[variant]) * 1e3:.1f}" if times[variant] else "error"


def _faults_cell(times: dict, variant: str) -> str:
    return f"{statistics.median(t[2] for t in times[variant]):.0f}" if times[variant] else "error"


def _per_variant_table(title: str, variants: list[str], rows: dict[str, list[str]]) -> None:
    print(f"\n{title}\n")
    print("| model | " + " | ".join(variants) + " |")
    print("|---|" + "---:|" * len(variants))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(row) + " |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="default: all")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds per model (default 4)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per fit (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of every fit (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="tiny models, 3 steps of which 1 warm-up (for tests)")
    parser.add_argument("--bytecodes", action="store_true",
                        help="also count the Python bytecodes of one training step per variant (deterministic)")
    parser.add_argument("--unchecked", action="store_true",
                        help="also time ours bf16 with check_finite=False (no inf/NaN check, as bf16-mixed)")
    parser.add_argument("--faults", action="store_true", help="also print the minor page faults per step")
    parser.add_argument("--steady-malloc", action="store_true",
                        help="run in a child process whose glibc keeps freed memory (no page faults in steps)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 3, 1
    for name in ("rounds", "steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)!r} must be >= 1")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup={args.warmup!r} must be in [0, --steps={args.steps!r})")
    if args.steady_malloc and not all(os.environ.get(k) == v for k, v in STEADY_MALLOC.items()):
        # glibc reads these once, at start-up: the same zoo, in a fresh interpreter that has them
        child = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--steady-malloc"]
        print(f"--steady-malloc: {' '.join(f'{k}={v}' for k, v in STEADY_MALLOC.items())}", flush=True)
        env = {**os.environ, **STEADY_MALLOC}
        code = subprocess.call([sys.executable, __file__, *child, "--steady-malloc"], env=env)
        if code:
            raise SystemExit(code)
        return
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no "GPU available" lines per fit
    for message in (".*`validation_step` but have no `val_dataloader`.*", ".*LeafSpec.*"):
        warnings.filterwarnings("ignore", message=message)  # once per fit, about Lightning, not the models

    from lightning_mp.gemm.support import gemm_support

    print(f"torch {torch.__version__}, lightning {L.__version__}, "
          f"transformers {transformers.__version__ if transformers else 'not installed'}; "
          f"{torch.get_num_threads()} thread(s)")
    # 16-bit speed on a CPU depends on its vector unit: every number below is for this one
    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}; gemm='auto': " + ", ".join(
        f"{n} {'native' if gemm_support('cpu', d).native else 'emulated'}"
        for n, d in (("bf16", torch.bfloat16), ("fp16", torch.float16))))
    models = [m for m in args.models if transformers or not MODELS[m][1]]
    if skipped := [m for m in args.models if m not in models]:
        print(f"skipped {', '.join(skipped)}: transformers is not installed (pip install -e \".[bench]\")")
    print(f"{'--quick: tiny sizes, ' if args.quick else ''}{args.rounds} round(s) x {args.steps} steps, "
          f"{args.warmup} warm-up step(s) dropped per fit; ms: CPU time of the training thread per step, "
          "median over rounds; ratios: median per-round ratio [range over rounds]\n", flush=True)

    variants, ratios = [*VARIANTS, *(UNCHECKED if args.unchecked else ())], list(RATIOS)
    if args.unchecked:
        ratios += [(f"{v} / bf16-mixed", v, "bf16-mixed") for v in UNCHECKED]
    rows, all_errors, counts, faults = [], [], {}, {}
    for name in models:
        build = MODELS[name][0]
        try:
            what = describe(build, args.quick)
        except Exception as e:  # e.g. a transformers version without this config: the zoo goes on
            what = f"cannot build: {type(e).__name__}"
        times, errors = run_model(build, args, variants)
        all_errors += [f"{name} / {v}: {e}" for v, e in errors.items()]
        rows.append([name, *(_ms(times, v, 0) for v in variants),
                     *(_ratio(times, n, d, c) for _, n, d in ratios for c in (0, 1))])
        faults[name] = [_faults_cell(times, v) for v in variants]
        if args.bytecodes:
            counts[name] = [str(bytecodes(build, v, args)) if v not in errors else "error" for v in variants]
        print(f"{name}: {what} done", flush=True)

    header = ["model", *(f"{v} ms" for v in variants), *(f"{c} ({k})" for c, _, _ in ratios for k in ("CPU", "wall"))]
    print()
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if counts:
        _per_variant_table("Python bytecodes in one training step (deterministic; the Trainer's own included)",
                           variants, counts)
    if args.faults:
        _per_variant_table("Minor page faults in one training step (median over rounds of each fit's median; a fault "
                           "is a 4 KiB page the kernel zeroes on first touch)", variants, faults)
    for line in all_errors:
        print(f"ERROR {line}")


if __name__ == "__main__":
    main()
