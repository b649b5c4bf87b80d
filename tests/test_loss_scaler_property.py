"""Property test: the scaler against a tiny reference model, over random step sequences and state round trips."""

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mp.numerics.loss_scaler import LossScaler


def reference(steps, init, growth, backoff, interval, hysteresis, max_scale):
    """The state machine written as plainly as possible: returns the scale after each step and the skip count."""
    scale, tracker, hyst, skipped, out = init, 0, hysteresis, 0, []
    for overflow in steps:
        if overflow:
            skipped += 1
            tracker = 0
            hyst -= 1
            if hyst <= 0:
                scale = scale * backoff
        else:
            tracker += 1
            if tracker == interval:
                tracker, hyst = 0, hysteresis
                scale = min(scale * growth, max_scale)
        out.append(scale)
    return out, skipped


configs = st.fixed_dictionaries(
    {
        "init": st.sampled_from([2.0**k for k in range(4, 20)]),
        "growth": st.sampled_from([2.0, 4.0, 1.5]),
        "backoff": st.sampled_from([0.5, 0.25]),
        "interval": st.integers(1, 6),
        "hysteresis": st.integers(1, 3),
        "max_scale": st.sampled_from([2.0**20, 2.0**24]),
    }
)


@settings(max_examples=200, deadline=None)
@given(config=configs, steps=st.lists(st.booleans(), max_size=60), cuts=st.sets(st.integers(0, 60), max_size=4))
def test_scaler_matches_reference_across_state_dict_round_trips(config, steps, cuts):
    expected, skipped = reference(steps, **config)

    def make():
        return LossScaler(
            init_scale=config["init"],
            growth_factor=config["growth"],
            backoff_factor=config["backoff"],
            growth_interval=config["interval"],
            hysteresis=config["hysteresis"],
            min_scale=2.0**-100,  # never reached here: the reference has no floor
            max_scale=config["max_scale"],
            max_consecutive_skips=10**6,
        )

    scaler, got = make(), []
    for i, overflow in enumerate(steps):
        if i in cuts:  # checkpoint and resume into a fresh scaler built with another init scale
            state = scaler.state_dict()
            scaler = make()
            scaler._set_scale(7.0)
            scaler.load_state_dict(state)
        scaler.update(overflow)
        got.append(scaler.scale)
    assert got == expected
    assert scaler.skipped_steps == skipped
