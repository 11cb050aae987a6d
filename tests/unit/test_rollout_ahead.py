"""rollout.mode one_step_off's bookkeeping, with a real tiny actor, cursor and reward: a batch made ahead
is sampled by the weights of its start (staleness 1 when trained), a batch the step cannot train as
sampled (other sampling knobs, a skipped prompt) is dropped, counted, its prompts given back and made
again, and the batch in flight is state that a snapshot holds."""

import pytest
import torch

from rlctl.config import RunConfig
from rlctl.engine.actor import Actor
from rlctl.engine.ahead import GeneratingActor, RolloutAhead, sampling_knobs
from rlctl.engine.data import PromptCursor, load_prompts
from rlctl.engine.dist import Dist
from rlctl.engine.experience import Experience
from rlctl.engine.model import load_tokenizer
from rlctl.engine.reward.sources import load_reward
from rlctl.engine.rollout.hf import HFRollout


@pytest.fixture()
def ahead(runtime, tiny_model_dir):
    cfg = RunConfig.model_validate(
        {
            "trainer": {"prompts_per_step": 2},
            "algorithm": {"group_size": 2},
            "rollout": {"mode": "one_step_off", "max_new_tokens": 4},
        }
    )
    actor, tok = Actor(cfg, tiny_model_dir, runtime), load_tokenizer(tiny_model_dir)
    data = PromptCursor(load_prompts(cfg, tok).train, cfg.seed)
    rollout = HFRollout(cfg, GeneratingActor(actor), tok)  # what rollout_ahead makes, without a trainer
    experience = Experience(cfg, data, rollout, load_reward(cfg.reward), tok.pad_token_id, Dist(runtime.device))
    made = RolloutAhead(cfg, actor, experience, lambda: sampling_knobs(cfg))
    yield made
    made.close()


def test_a_batch_made_ahead_is_the_next_steps_and_one_update_stale(ahead):
    first, stale = ahead.take(1, 0, set())  # nothing ahead yet: made now
    assert stale == {"rollout/staleness/mean": 0.0, "rollout/staleness/max": 0.0} and first.version == 0
    ahead.fill(1, 0, total=10)
    second, stale = ahead.take(2, 1, set())
    assert second.version == 0 and stale["rollout/staleness/mean"] == 1.0 and ahead.take_dropped() == 0
    assert len(set(first.drawn) | set(second.drawn)) == 4  # the cursor's next prompts, in step order
    assert ahead.experience.data.position == 4


def test_async_runs_up_to_its_staleness_ahead_and_each_batch_keeps_the_weights_of_its_start(ahead):
    ahead.ahead = 2  # rollout.mode async, max_staleness 2
    ahead.take(1, 0, set())
    ahead.fill(1, 0, total=4)  # steps 2 and 3, both by the initial weights
    assert sorted(ahead._threads) == [2, 3]
    with torch.no_grad():
        for p in ahead.actor.module.parameters():
            p.add_(0.5)  # step 1's update, while they are generated: neither sees it
    second, stale2 = ahead.take(2, 1, set())
    ahead.fill(2, 1, total=4)  # step 4, by the updated weights
    third, stale3 = ahead.take(3, 2, set())
    ahead.fill(3, 2, total=4)  # nothing past total
    fourth, stale4 = ahead.take(4, 3, set())
    assert [b.version for b in (second, third, fourth)] == [0, 0, 1]
    assert [s["rollout/staleness/max"] for s in (stale2, stale3, stale4)] == [1.0, 2.0, 2.0]
    assert not ahead._threads and not ahead.ready and ahead.take_dropped() == 0
    assert len({i for b in (second, third, fourth) for i in b.drawn}) == 6  # in step order, none twice


def test_a_batch_that_cannot_train_as_sampled_is_dropped_with_those_after_it_and_made_again(ahead):
    ahead.ahead = 2
    ahead.take(1, 0, set())
    ahead.fill(1, 0, total=10)
    ahead.wait()
    dropped = ahead.ready[2].drawn
    ahead.cfg.rollout.temperature = 0.5  # a policy's adjust between the batches' start and their steps
    again, stale = ahead.take(2, 1, set())
    assert ahead.take_dropped() == 8  # step 2's batch and step 3's, drawn after it
    assert again.drawn == dropped and stale["rollout/staleness/mean"] == 0.0 and again.knobs["temperature"] == 0.5
    ahead.fill(2, 1, total=10)
    ahead.wait()
    skipped = {ahead.ready[3].drawn[0]}
    ahead.experience.data.exclude = skipped  # a policy skipped one of its prompts meanwhile
    third, _ = ahead.take(3, 2, skipped)
    assert ahead.take_dropped() == 8 and not skipped & set(third.drawn)


def test_the_batches_in_flight_are_state(ahead):
    ahead.ahead = 2
    ahead.take(1, 0, set())
    ahead.fill(1, 0, total=10)
    state = ahead.state_dict()  # waits for them
    assert [b["step"] for b in state["ready"]] == [2, 3]
    other = RolloutAhead(ahead.cfg, ahead.actor, ahead.experience, ahead.knobs, ahead=2)
    other.load_state_dict(state)
    batch, _ = other.take(2, 1, set())
    assert torch.equal(batch.seqs.input_ids, state["ready"][0]["seqs"]["input_ids"]) and batch.version == 0
    assert list(other.ready) == [3]


def test_the_modes_are_checked_when_the_config_loads():
    with pytest.raises(ValueError, match=r"rollout.max_staleness applies with rollout.mode async \(the mode is sync\)"):
        RunConfig.model_validate({"rollout": {"max_staleness": 2}})
    assert RunConfig.model_validate({"rollout": {"mode": "async"}, "actor": {"zero_stage": 3}}).actor.zero_stage == 3
    assert RunConfig.model_validate({"rollout": {"mode": "one_step_off", "backend": "vllm"}}).rollout.backend == "vllm"
    ds = {"rollout": {"mode": "one_step_off"}, "algorithm": {"dynamic_sampling": {"enabled": True}}}
    assert RunConfig.model_validate(ds).algorithm.dynamic_sampling.enabled  # its rounds agree in a group of its own
    assert RunConfig.model_validate({"rollout": {"mode": "async", "max_staleness": 3}}).rollout.max_staleness == 3
