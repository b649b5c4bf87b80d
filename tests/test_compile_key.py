"""lightning_mp.compile_key: while the FP32 policy's or the emulated GEMMs' kernels are in force, torch.compile's cache
key tag names their state; without them it is the user's own tag, untouched."""

import gc
import subprocess
import sys

import pytest
import torch
import torch.compiler.config as compiler_config

from lightning_mp import Fp32Policy
from lightning_mp.compile_key import count_part, current_parts
from lightning_mp.gemm.emulation import GemmEmulation

SEEN: list[None] = []  # one entry per compile made by seen_by_a_compile


def seen_by_a_compile() -> str:
    """The cache key tag inside a compile starting now (where torch computes its cache keys)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(compiler_config.cache_key_tag)
        return gm.forward

    SEEN.append(None)
    namespace = {}
    name = f"fresh_{len(SEEN)}"  # a new function and file: no entry of Dynamo's for it, no recompile limit reached
    exec(compile(f"def {name}(x):\n    return x + 1\n", f"<{name}>", "exec"), namespace)
    torch._dynamo.reset()  # torch 2.11 compiles one wrapper frame for every function: its recompile limit is 8
    torch.compile(namespace[name], backend=backend)(torch.ones(2))
    return seen[0]


@pytest.fixture(autouse=True)
def _nothing_held_before():
    gc.collect()  # a plugin an earlier test dropped in the middle of its loop releases its kernels when collected
    assert current_parts() == {}


DIGEST = "from lightning_mp import Fp32Policy\nfrom lightning_mp.compile_key import current_parts\n" \
         "with Fp32Policy().activate():\n    print(current_parts()['fp32_policy'])\n"


def test_the_policy_names_its_plan_in_the_tag_while_it_is_held_and_whether_it_is_switched_on():
    base = seen_by_a_compile()  # nothing held: the user's (TORCH_COMPILE_CACHE_KEY_TAG), empty by default
    default, fewer = Fp32Policy(), Fp32Policy(ops={"softmax"})
    with default.activate():
        held = current_parts()["fp32_policy"]
        assert held.endswith("+") and seen_by_a_compile() == f"{base}|lightning_mp.fp32_policy={held}"
        with fewer.activate():  # another plan: another name, both listed
            assert len(current_parts()["fp32_policy"].split(",")) == 2
        assert current_parts()["fp32_policy"] == held
    with default.activate(on=False):  # registered, switched off: another state
        assert current_parts()["fp32_policy"] == held[:-1] + "-"
        with default.switched_on():
            assert current_parts()["fp32_policy"] == held
        assert seen_by_a_compile() == f"{base}|lightning_mp.fp32_policy={held[:-1]}-"
    assert current_parts() == {} and seen_by_a_compile() == base and compiler_config.cache_key_tag == base


def test_switching_writes_no_config_only_a_compile_does(monkeypatch):
    """The Fabric plugin switches the kernels twice per iteration: a dict update each, the tag written by the next
    compile (a write through torch.compiler.config cost ~5% of a tiny MLP's step)."""
    writes, base = [], seen_by_a_compile()
    real_setattr = type(compiler_config).__setattr__

    def recording_setattr(self, name, value):
        if name == "cache_key_tag":
            writes.append(value)
        real_setattr(self, name, value)

    monkeypatch.setattr(type(compiler_config), "__setattr__", recording_setattr)
    policy = Fp32Policy()
    with policy.activate(on=False):
        for _ in range(3):
            with policy.switched_on():
                assert current_parts()["fp32_policy"].endswith("+")
        assert writes == []
        assert seen_by_a_compile().endswith("-") and len(writes) == 1
    monkeypatch.undo()
    assert seen_by_a_compile() == base == compiler_config.cache_key_tag


def test_the_plans_name_is_the_same_in_every_process_so_runs_in_one_state_share_the_disk_cache():
    names = [subprocess.run([sys.executable, "-c", DIGEST], capture_output=True, text=True, timeout=120).stdout
             for _ in range(2)]  # fmt: skip
    with Fp32Policy().activate():
        assert names == [current_parts()["fp32_policy"] + "\n"] * 2


def test_an_emulating_context_names_its_format_and_the_native_one_nothing():
    emulated, native = GemmEmulation("emulated"), GemmEmulation("native")
    emulated.setup("cpu", torch.float16, hold=False)
    native.setup("cpu", torch.bfloat16, hold=False)
    try:
        with native.context():
            assert current_parts() == {}
        with emulated.context():
            assert current_parts() == {"gemm_emulated": "fp16"}
            with emulated.context():  # nested (a recomputed forward inside a backward): counted
                pass
            assert current_parts() == {"gemm_emulated": "fp16"}
        assert current_parts() == {}
    finally:
        emulated.remove()


def test_a_tag_the_user_set_stays_in_front_and_comes_back():
    base, compiler_config.cache_key_tag = compiler_config.cache_key_tag, "mine"
    try:
        count_part("fp32_policy", "abc+", +1)
        count_part("gemm_emulated", "fp16", +1)
        count_part("gemm_emulated", "bf16", +1)
        ours = "|lightning_mp.fp32_policy=abc+|lightning_mp.gemm_emulated="
        assert seen_by_a_compile() == f"mine{ours}bf16,fp16"
        compiler_config.cache_key_tag = "theirs"  # changed by the user meanwhile: their new tag is the base
        count_part("gemm_emulated", "bf16", -1)
        assert seen_by_a_compile() == f"theirs{ours}fp16"
        count_part("gemm_emulated", "fp16", -1)
        count_part("fp32_policy", "abc+", -1)
        assert seen_by_a_compile() == "theirs" and current_parts() == {}
    finally:
        compiler_config.cache_key_tag = base


def test_a_tag_of_ours_that_torch_put_back_is_not_taken_for_the_users():
    """torch restores configs it patched around a compile (a lazily compiled backward's): an older tag of ours back in
    the config is replaced at the next compile, not kept in front as if the user had set it."""
    policy = Fp32Policy()
    base = seen_by_a_compile()
    with policy.activate(on=False):
        stale = seen_by_a_compile()
        with policy.switched_on():
            compiler_config.cache_key_tag = stale  # put back, as a config patch's exit does
            assert seen_by_a_compile() == stale[:-1] + "+" and stale.startswith(base + "|lightning_mp.")
    assert seen_by_a_compile() == base


def test_a_compile_after_torch_dynamo_reset_still_sees_the_tag():
    """reset() clears torch's compile-start callbacks (the docs advise it between fits, and the compile tests call
    it): the tag's callback stays, or a compile after a reset would see the tag of the compile before it."""
    policy = Fp32Policy()
    with policy.activate(on=False):
        assert seen_by_a_compile().endswith("-")
        torch._dynamo.reset()
        with policy.switched_on():
            assert seen_by_a_compile().endswith("+")
        torch._dynamo.reset()
        assert seen_by_a_compile().endswith("-")
