"""Reward models (`reward.model`, a `model` entry of `reward.sources`): a tiny real Llama sequence
classifier built here with the built-in character tokenizer, saved with save_pretrained and scored by
ModelReward; the directory checks and the config's located errors."""

import json
import textwrap

import pytest
import torch
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

from rlctl.config.load import load_config
from rlctl.config.reward import RewardConfig, RewardModelConfig
from rlctl.engine.dist import MEAN
from rlctl.engine.model import build_char_tokenizer
from rlctl.engine.reward.model import ModelReward
from rlctl.engine.reward.sources import load_reward, metrics_of, recording
from rlctl.errors import ConfigError, InputError
from rlctl.preflight import check_config_names

from helpers import save_reward_model

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("rm_dir",)

PROMPTS = ["abc=", "de=", "fghij=", "k=", "abc="]
COMPLETIONS = ["abc", "x", "fghijfghij", "", "abd"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return save_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm")


def reward(path, batch_size=16, dtype="fp32", key="reward.model.path"):
    return ModelReward(RewardModelConfig(path=str(path), dtype=dtype, batch_size=batch_size), key)


def direct_score(path, text):
    """logit[0] of the unpadded text (its <bos> included), straight from transformers."""
    tok = build_char_tokenizer()
    model = LlamaForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([tok(text)["input_ids"]])).logits[0, 0].item()


@pytest.mark.slow
def test_scores_are_logit_zero_of_prompt_plus_completion(rm_dir):
    scores = reward(rm_dir)(PROMPTS, COMPLETIONS)
    assert scores[0] == pytest.approx(direct_score(rm_dir, "abc=abc"), abs=1e-5)
    assert scores[2] == pytest.approx(direct_score(rm_dir, "fghij=fghijfghij"), abs=1e-5)
    assert len(set(round(s, 4) for s in scores)) == len(scores)  # texts are told apart


def test_batched_equals_one_by_one_and_padding_side_plays_no_part(rm_dir, tmp_path):
    one_by_one = reward(rm_dir, batch_size=1)(PROMPTS, COMPLETIONS)
    batched = reward(rm_dir, batch_size=3)(PROMPTS, COMPLETIONS)
    assert batched == pytest.approx(one_by_one, abs=1e-5)
    right = save_reward_model(tmp_path / "right", padding_side="right")
    assert reward(right, batch_size=3)(PROMPTS, COMPLETIONS) == batched


def test_the_model_is_frozen_in_eval_mode_and_deterministic(rm_dir):
    fn = reward(rm_dir, dtype="bf16")
    first = fn(PROMPTS, COMPLETIONS)
    model = fn.model
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert reward(rm_dir, dtype="bf16")(PROMPTS, COMPLETIONS) == first  # a fresh load (a resume) scores alike
    fp32 = reward(rm_dir, dtype="auto")  # auto is fp32 on the CPU
    fp32.load()
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}


def test_long_texts_keep_their_end_and_are_counted(tmp_path):
    path = save_reward_model(tmp_path / "short", context=8)
    fn = reward(path)
    scores = fn(["abcdef=", "ab="], ["abcdef", "ab"])
    assert fn.truncated == 1
    tok = build_char_tokenizer()
    model = LlamaForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        cut = model(input_ids=torch.tensor([tok("abcdef=abcdef")["input_ids"][-8:]])).logits[0, 0].item()
    assert scores[0] == pytest.approx(cut, abs=1e-5)


def test_the_reward_models_chat_template_is_applied(rm_dir, tmp_path):
    path = save_reward_model(tmp_path / "chat")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}#{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    fn = reward(path)
    tok = build_char_tokenizer()
    assert fn.texts(["ab="], ["ab"]) == [tok("u:ab=#a:ab#", add_special_tokens=False)["input_ids"]]
    assert fn(["ab="], ["ab"])[0] != pytest.approx(reward(rm_dir)(["ab="], ["ab"])[0])


def test_sources_combine_a_model_and_a_function(rm_dir):
    cfg = RewardConfig(
        sources=[
            {"function": "rlctl.engine.reward.builtin:echo_reward", "weight": 0.5},
            {"model": {"path": str(rm_dir), "batch_size": 2}, "weight": 2.0},
        ]
    )
    fn = load_reward(cfg)
    assert metrics_of(fn) == {
        "critic/score/echo_reward/mean": MEAN,
        "critic/score/tiny-rm/mean": MEAN,
        "critic/score/tiny-rm/truncated_frac": MEAN,
    }
    model_scores = reward(rm_dir, batch_size=2)(PROMPTS, COMPLETIONS)
    with recording(fn) as out:
        total = fn(PROMPTS, COMPLETIONS, target=["abc", "de", "fghij", "k", "abc"])
    assert out["critic/score/tiny-rm/mean"] == pytest.approx(sum(model_scores) / 5, abs=1e-5)
    assert out["critic/score/tiny-rm/truncated_frac"] == 0.0
    echo = out["critic/score/echo_reward/mean"]
    assert sum(total) / 5 == pytest.approx(0.5 * echo + 2.0 * sum(model_scores) / 5, abs=1e-5)


def test_the_shorthand_logs_only_truncation(rm_dir):
    fn = load_reward(RewardConfig(model={"path": str(rm_dir)}))
    with recording(fn) as out:
        fn(PROMPTS, COMPLETIONS)
    assert out == {"critic/score/tiny-rm/truncated_frac": 0.0}


def test_directories_that_are_no_reward_model_are_named(tmp_path):
    causal = save_reward_model(tmp_path / "lm", head=LlamaForCausalLM)
    cfg = RewardConfig(
        sources=[{"function": "rlctl.engine.reward.builtin:echo_reward"}, {"model": {"path": str(causal)}}]
    )
    with pytest.raises(InputError, match=r"'reward.sources\[1\].model.path' .*LlamaForCausalLM, not a sequence-c"):
        load_reward(cfg)
    two = save_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(InputError, match=r"'reward.model.path' .*has 2 labels; a reward model has exactly one"):
        load_reward(RewardConfig(model={"path": str(two)}))
    bare = save_reward_model(tmp_path / "bare")
    (bare / "model.safetensors").unlink()
    with pytest.raises(InputError, match=r"'reward.model.path' .*holds no weights"):
        load_reward(RewardConfig(model={"path": str(bare)}))
    config = json.loads((causal / "config.json").read_text())  # a causal LM's weights under a classifier's name
    config.update(architectures=["LlamaForSequenceClassification"], id2label={"0": "LABEL_0"})
    (causal / "config.json").write_text(json.dumps(config))
    headless = load_reward(RewardConfig(model={"path": str(causal)}))  # the check before work reads no weights
    with pytest.raises(InputError, match=r"'reward.model.path' .*lack score.weight: the score head is not trained"):
        headless(PROMPTS, COMPLETIONS)


@pytest.mark.parametrize(
    "reward_yaml, message",
    [
        ("model: {path: /no/such/rm}", r"'reward.model.path'.*no such model directory: /no/such/rm"),
        ("sources: [{model: {path: /no/such/rm}}]", r"'reward.sources.0.model.path'.*no such model directory"),
        ("model: {path: RM}\n  url: 'http://h'", "give one of 'url' and 'model', not both"),
        ("model: {path: RM}\n  sources: [{function: a:b}]", "'sources' or 'model', not both"),
        ("sources: [{model: {path: RM}, kwargs: {a: 1}}]", "'kwargs' apply to a 'function' or 'url' source"),
        ("sources: [{model: {path: RM, batch_size: 0}}]", "'reward.sources.0.model.batch_size'"),
        ("model: {path: RM, dtype: fp16}", "'reward.model.dtype'"),
    ],
)
def test_config_errors_name_the_key(tmp_path, rm_dir, reward_yaml, message):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(f"reward:\n  {reward_yaml.replace('RM', str(rm_dir))}\n"))
    with pytest.raises(ConfigError, match=message):
        check_config_names(load_config(path))  # a missing directory: checked before a start, not by the schema
