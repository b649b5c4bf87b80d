"""The collectives' pure parts; the collectives themselves run in tests/test_ddp.py (two gloo processes)."""

import torch

from lightning_mp.numerics.distributed import contiguous_runs as _runs


def test_gradients_that_tile_one_buffer_form_one_in_place_run():
    flat = torch.zeros(10)
    a, b, c = flat[:3], flat[3:7].view(2, 2), flat[7:]
    other = torch.zeros(2)
    assert [len(r) for r in _runs([a, b, c])] == [3]  # one all-reduce on the buffer itself
    assert [len(r) for r in _runs([a, b, other, c])] == [2, 1, 1]  # an FP32 parameter's own gradient breaks it
    assert [len(r) for r in _runs([b, a])] == [1, 1]  # out of order: not one region
    assert [len(r) for r in _runs([flat[::2], flat[1::2]])] == [1, 1]  # strided views never run together
