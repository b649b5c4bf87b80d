"""Small, real workloads for trying precisions: byte-level language modelling on Python's own source, and
image classification with a BatchNorm ResNet on scikit-learn's handwritten digits
(:class:`DigitsDataModule`, :class:`ResNet`; see their docstrings and ``examples/train_resnet.py``).

The text workload has two pieces:

* :class:`StdlibTextDataModule` reads the standard library's ``.py`` files, which ship with every Python
  install, so the demo needs no download and no tokenizer: every byte is a token (vocabulary 256).
* :class:`GPT` is a nanoGPT-style causal transformer, written so that it also runs with its parameters
  stored in ``bfloat16``/``float16`` and its forward under ``torch.autocast``, which is what Lightning's
  ``"bf16-mixed"``/``"16-mixed"``/``"bf16-true"`` precision settings do to a model.

The text is deterministic for a given Python install (files sorted, then concatenated), but it is not
the same across Python versions or distributions: a different stdlib gives different bytes. Compare
losses between runs on the same interpreter.

Typical use, with the recipe the benchmarks train with (a warmup, then a cosine decay: :data:`gpt.RECIPE`)::

    import lightning as L
    from lightning_mp.demos import GPT, StdlibTextDataModule
    from lightning_mp.demos.gpt import RECIPE

    L.seed_everything(0)
    dm = StdlibTextDataModule(block_size=128, batch_size=16, seed=0)
    model = GPT(vocab_size=dm.vocab_size, block_size=128, **RECIPE)
    L.Trainer(max_steps=800, gradient_clip_val=1.0, precision="bf16-mixed").fit(model, dm)

To compare precisions, train each on several seeds and claim a difference only beyond the seed spread
(:mod:`lightning_mp.demos.seeds`, used by ``benchmarks/compare_precisions.py`` and ``examples/train_resnet.py``).
"""

from lightning_mp.demos.digits import DigitsDataModule
from lightning_mp.demos.gpt import GPT, Block, CausalSelfAttention
from lightning_mp.demos.resnet import BasicBlock, ResNet
from lightning_mp.demos.text import StdlibTextDataModule

__all__ = ["GPT", "BasicBlock", "Block", "CausalSelfAttention", "DigitsDataModule", "ResNet", "StdlibTextDataModule"]
