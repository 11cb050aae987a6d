"""A round trip for every Stateful a snapshot carries: state_dict() through torch.save and back into a
fresh object gives the same state, the restored object then behaves exactly like the original, and a
state of another version is refused with a sentence naming the owner."""

import io
import random

import numpy as np
import pytest
import torch

from rlctl.algos.kl import AdaptiveKLController, FixedKLController
from rlctl.checkpoint.rng import RNGState
from rlctl.engine.data import PromptCursor
from rlctl.engine.trainer import TrainerState
from rlctl.policies import load_policies
from rlctl.policies.guard import PolicyGuard
from rlctl.stateful import StateMismatchError

from helpers import REPO


def through_storage(state: dict) -> dict:
    """What a snapshot does to a state dict: torch.save into bytes, torch.load back."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def roundtrip(original, fresh):
    """Load ``original``'s state into ``fresh``; both must then report the same state."""
    fresh.load_state_dict(through_storage(original.state_dict()))
    assert same(fresh.state_dict(), original.state_dict())
    return fresh


def refuses_other_versions(obj, owner: str) -> None:
    state = through_storage(obj.state_dict())
    state["version"] = state["version"] + 1
    with pytest.raises(StateMismatchError, match=owner):
        obj.load_state_dict(state)


def test_trainer_state():
    a = TrainerState()
    a.step, a.tokens_seen, a.prompts_seen, a.token_budget = 7, 1234, 56, 4096
    b = roundtrip(a, TrainerState())
    assert (b.step, b.tokens_seen, b.prompts_seen, b.token_budget) == (7, 1234, 56, 4096)
    refuses_other_versions(b, "trainer")


def test_a_trainer_state_from_before_the_token_budget_loads_without_one():
    """Version 2 (before the GPU's default micro-batch token budget): those runs cut no micro-batches by
    tokens, and resume so."""
    old = {"version": 2, "step": 3, "tokens_seen": 10, "prompts_seen": 4, "last_val": None}
    b = TrainerState()
    b.token_budget = 512
    b.load_state_dict(old)
    assert (b.step, b.token_budget) == (3, None)


def test_rng_state_replays_every_generator():
    rng = RNGState()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    saved = through_storage(rng.state_dict())
    first = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(2), np.random.seed(2), torch.manual_seed(2)  # move every generator elsewhere
    rng.load_state_dict(saved)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])
    refuses_other_versions(rng, "RNG")


def test_prompt_cursor_continues_the_same_order_across_epochs():
    rows = [{"prompt": str(i)} for i in range(10)]
    a = PromptCursor(rows, seed=3)
    a.next_batch(7)
    a.next_batch(7)  # into the second epoch
    b = roundtrip(a, PromptCursor(rows, seed=3))
    assert [i for i, _ in a.next_batch(9)] == [i for i, _ in b.next_batch(9)]
    refuses_other_versions(b, "data cursor")


@pytest.mark.parametrize("make", [lambda: FixedKLController(0.1), lambda: AdaptiveKLController(0.1, 0.05, 100)])
def test_kl_controllers(make):
    a = make()
    a.update(0.2, 32)
    b = roundtrip(a, make())
    a.update(0.01, 16)
    b.update(0.01, 16)
    assert a.value == b.value
    refuses_other_versions(b, "KL controller")


def test_policy_guard_keeps_counts_windows_skips_and_adjustments():
    rules = load_policies([REPO / "policies" / "default.yaml"])
    a = PolicyGuard(rules)
    for step in range(1, 30):
        a.check(step, {"step": step, "actor/grad_norm": 1.0 + 0.01 * step, "actor/ppo_kl": 0.2 if step % 3 else 0.0})
    a.skipped_prompts |= {4, 9}
    a.adjustments.append({"step": 5, "changes": {"actor.lr": {"from": 1e-6, "to": 5e-7}}})
    b = roundtrip(a, PolicyGuard(rules))
    row = {"step": 30, "actor/grad_norm": 500.0, "actor/ppo_kl": 0.2}  # above 100x the window's largest
    fired_a = [f.rule for f in a.check(30, row).firings]
    fired_b = [f.rule for f in b.check(30, row).firings]
    assert fired_a == fired_b and "grad-spike" in fired_a
    assert b.skipped_prompts == {4, 9}
    refuses_other_versions(b, "policy guard")


def test_policy_guard_carries_knob_settings_and_still_reads_version_1():
    rules = load_policies([REPO / "policies" / "default.yaml"])
    a = PolicyGuard(rules)
    assert a.knobs is None  # unknown until the trainer records them
    a.check(1, {"step": 1, "actor/grad_norm": 1.0, "actor/ppo_kl": 0.2})
    a.knobs = {"algorithm.kl_coef": {"value": 0.01}, "actor.lr": {"value": 5e-4, "scale": 0.5, "offset": 0.0}}
    b = roundtrip(a, PolicyGuard(rules))
    assert b.knobs == a.knobs and b.knobs is not a.knobs
    assert a.state_dict()["version"] == 2
    v1 = {k: v for k, v in through_storage(a.state_dict()).items() if k != "knobs"}
    v1["version"] = 1  # what an older rlctl wrote: no knob settings
    c = PolicyGuard(rules)
    c.knobs = {"actor.lr": {"value": 1.0}}
    c.load_state_dict(v1)
    assert c.knobs is None and c.engine.state_dict() == a.engine.state_dict()
    assert c.state_dict()["version"] == 2
    for bad in ({**a.state_dict(), "knobs": 5}, {**a.state_dict(), "knobs": {"actor.lr": "x"}}, v1 | {"version": 2}):
        with pytest.raises(StateMismatchError, match="policy state is not readable"):
            c.load_state_dict(bad)
        assert c.knobs is None  # nothing changed
