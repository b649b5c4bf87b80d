"""GradientRangeMonitor's arguments (its numerics: tests/test_log2_histogram.py; with a Trainer:
tests/test_callbacks_integration.py)."""

import pytest

from lightning_mp import GradientRangeMonitor


# ---------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "50", None])
def test_every_n_steps_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=rf"every_n_steps={bad!r}.*integer >= 1"):
        GradientRangeMonitor(every_n_steps=bad)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_per_param_must_be_a_bool(bad):
    with pytest.raises(ValueError, match=rf"per_param={bad!r}.*True or False"):
        GradientRangeMonitor(per_param=bad)


def test_defaults():
    m = GradientRangeMonitor()
    assert (m.every_n_steps, m.per_param) == (50, False)
