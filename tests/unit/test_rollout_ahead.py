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
    ahead.start(2, 0)
    second, stale = ahead.take(2, 1, set())
    assert second.version == 0 and stale["rollout/staleness/mean"] == 1.0 and ahead.take_dropped() == 0
    assert len(set(first.drawn) | set(second.drawn)) == 4  # the cursor's next prompts, in step order
    assert ahead.experience.data.position == 4


def test_a_batch_that_cannot_train_as_sampled_is_dropped_and_its_prompts_made_again(ahead):
    ahead.take(1, 0, set())
    ahead.start(2, 0)
    ahead.wait()
    dropped = ahead.ready.drawn
    ahead.cfg.rollout.temperature = 0.5  # a policy's adjust between the batch's start and its step
    again, stale = ahead.take(2, 1, set())
    assert ahead.take_dropped() == 4 and again.drawn == dropped and stale["rollout/staleness/mean"] == 0.0  # made now
    assert again.knobs["temperature"] == 0.5

    ahead.start(3, 1)
    ahead.wait()
    skipped = {ahead.ready.drawn[0]}
    ahead.experience.data.exclude = skipped  # a policy skipped one of its prompts meanwhile
    third, _ = ahead.take(3, 2, skipped)
    assert ahead.take_dropped() == 4 and not skipped & set(third.drawn)


def test_the_batch_in_flight_is_state(ahead):
    ahead.take(1, 0, set())
    ahead.start(2, 0)
    state = ahead.state_dict()  # waits for it
    other = RolloutAhead(ahead.cfg, ahead.actor, ahead.experience, ahead.knobs)
    other.load_state_dict(state)
    batch, _ = other.take(2, 1, set())
    assert torch.equal(batch.seqs.input_ids, state["ready"]["seqs"]["input_ids"]) and batch.version == 0
