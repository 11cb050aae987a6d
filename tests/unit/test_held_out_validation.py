"""Validation's pieces: held-out data in every form, the built-in held-out split, greedy sampling, the
metrics' arithmetic, the config's rules and the trainer state that carries the last validation."""

import math

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlctl.config import DataConfig, load_config, validate_config
from rlctl.engine.batch import Sequences
from rlctl.engine.counters import TrainerState
from rlctl.engine.data import load_rows, load_val_rows, read_prompt_file
from rlctl.engine.dist import Dist
from rlctl.engine.rollout.hf import SeededGumbelSampler
from rlctl.engine.validation import VAL_STEP, Validator
from rlctl.errors import ConfigError, InputError
from rlctl.preflight import check_config_names

ROWS = [
    {"prompt": "ab=", "target": "ab", "data_source": "echo"},
    {"prompt": "cd=", "target": "cd", "data_source": "echo"},
    {"prompt": "xy=", "target": "yx", "data_source": "reverse"},
]


def test_held_out_prompts_from_jsonl_parquet_and_datasets_directories(tmp_path):
    import datasets

    jl = tmp_path / "val.jsonl"
    jl.write_bytes(b"\n".join(orjson.dumps(r) for r in ROWS) + b"\n")
    pqf = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), pqf)
    ds = tmp_path / "val_ds"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(ds))
    splits = tmp_path / "splits_ds"
    datasets.DatasetDict(
        {"test": datasets.Dataset.from_list(ROWS), "train": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(splits))
    for path in (jl, pqf, ds, splits):
        assert load_val_rows(DataConfig(val_path=str(path)), seed=0, training=[]) == ROWS, path
    # the training data may be a datasets directory too; of a DatasetDict, training takes "train"
    assert load_rows(DataConfig(path=str(ds)), seed=0) == ROWS
    assert load_rows(DataConfig(path=str(splits)), seed=0) == ROWS[:1]
    only_train = tmp_path / "only_train"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(only_train))
    with pytest.raises(InputError, match="holds the splits train, none of validation, test"):
        load_val_rows(DataConfig(val_path=str(only_train)), seed=0, training=[])


def test_a_directory_that_is_not_a_dataset_is_one_sentence(tmp_path):
    with pytest.raises(ConfigError, match="not a `datasets` directory"):  # checked before a start, not by the schema
        check_config_names(validate_config({"data": {"val_path": str(tmp_path)}}))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "dataset_info.json").write_text("{}")
    (broken / "state.json").write_text('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')
    with pytest.raises(InputError, match=r"'data.val_path' .*broken is not a readable `datasets` directory"):
        read_prompt_file(broken, "prompt", "data.val_path")


def test_the_builtin_held_out_split_is_fixed_and_never_a_training_prompt():
    cfg = DataConfig(builtin_size=4096, builtin_val_size=64)
    rows = load_rows(cfg, seed=3)
    train = {r["prompt"] for r in rows}
    val = load_val_rows(cfg, seed=3, training=rows)
    assert len(val) == 64 and len({r["prompt"] for r in val}) == 64
    assert not train & {r["prompt"] for r in val}
    assert load_val_rows(cfg, seed=3, training=rows) == val
    assert load_val_rows(cfg, seed=4, training=load_rows(cfg, seed=4)) != val


def test_a_held_out_split_larger_than_the_words_left_is_one_sentence_not_a_hang():
    from itertools import product

    from rlctl.engine.reward.builtin import LETTERS, make_held_out_prompts

    every = [{"prompt": "".join(w) + "="} for n in (3, 4) for w in product(LETTERS, repeat=n)]
    assert len(make_held_out_prompts(5, 0, every[5:])) == 5
    with pytest.raises(InputError, match=r"'data.builtin_val_size' \(6\) asks for more .* \(5 words"):
        make_held_out_prompts(6, 0, every[5:])


def test_temperature_zero_is_greedy_and_draws_no_noise():
    logits = torch.randn(3, 11)
    sampler = SeededGumbelSampler([1, 2, 3], temperature=0.0)
    assert torch.equal(sampler(None, logits).argmax(-1), logits.argmax(-1))
    assert sampler._noise is None


class EchoBackend:
    """A rollout backend whose answer to a prompt is fixed by its sample index: sample 0 echoes the
    target, sample 1 answers 'zz'. Records the seeds' step and the temperature it was asked for."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, keys, step, temperature=None, columns=None):
        self.calls.append((len(prompts), step, temperature))
        B = len(prompts)
        length = torch.tensor([2 + s for _, s in keys])
        mask = (torch.arange(4)[None, :] < length[:, None]).long()
        seqs = Sequences(torch.zeros(B, 5, dtype=torch.long), torch.ones(B, 5, dtype=torch.long), mask, 1, None)
        seqs.answers = [p[:-1] if s == 0 else "zz" for p, (_, s) in zip(prompts, keys)]
        return seqs

    def decode(self, seqs):
        return seqs.answers

    def sync_weights(self):
        pass

    def forget_cache(self):
        self.forgot = True

    def reward_columns(self):
        return {}

    def turn_ends(self):
        return None

    reductions: dict = {}

    def take_metrics(self):
        self.taken = True  # validation's generations leave no metrics for the next training step
        return {}


def _cfg(**rollout):
    return validate_config(
        {
            "trainer": {"val_every": 2, "total_steps": 5, "prompts_per_step": 1},
            "algorithm": {"group_size": 2},
            "rollout": rollout,
        },
        {},
    )


def test_validator_metrics_mean_best_at_n_lengths_and_per_source():
    from rlctl.engine.reward.builtin import echo_reward

    backend = EchoBackend()
    cfg = _cfg(val_samples=2, val_temperature=0.7)
    v = Validator(cfg, ROWS, backend, echo_reward, Dist(torch.device("cpu")))
    m = v.run()
    # sample 0 echoes the prompt's letters: 1.0 for ab, cd; for xy (target yx) the letters are right, the
    # order wrong: 0.5. Sample 1 ('zz') scores 0. Lengths: 2 and 3 tokens.
    assert m["val/score/mean"] == pytest.approx((1 + 1 + 0.5) / 6)
    assert m["val/score/mean@2"] == pytest.approx((0.5 + 0.5 + 0.25) / 3)
    assert m["val/score/best@2"] == pytest.approx((1 + 1 + 0.5) / 3)
    assert m["val/response_length/mean"] == pytest.approx(2.5)
    assert m["val/echo/score/mean"] == pytest.approx(0.5)
    assert m["val/reverse/score/mean"] == pytest.approx(0.25)
    # two chunks of one prompt x 2 samples (a training batch is 1 x 2 sequences); validation's own seeds
    # and temperature
    assert backend.calls == [(2, VAL_STEP, 0.7)] * 3
    assert v.run() == m and backend.forgot and backend.taken
    assert [s for s in range(1, 6) if v.due(s)] == [2, 4, 5]  # every 2 steps, and the last


def test_validation_config_rules(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a"}\n')
    with pytest.raises(ConfigError, match="val_samples > 1 needs val_temperature > 0"):
        validate_config({"rollout": {"val_samples": 4}}, {})
    with pytest.raises(ConfigError, match="need held-out prompts: set data.val_path"):
        validate_config({"trainer": {"val_every": 5}, "data": {"path": str(data)}}, {})
    with pytest.raises(ConfigError, match="tensorboard is listed more than once"):
        validate_config({"trainer": {"loggers": ["tensorboard", "tensorboard"]}}, {})
    assert validate_config({"trainer": {"val_every": 5}}, {}).validates  # the built-in task has its split
    with pytest.raises(ConfigError, match="keep_best ranks snapshots by a validation metric, but this run never"):
        validate_config({"checkpoint": {"keep_best": {"k": 2}}}, {})
    with pytest.raises(ConfigError, match="snapshots record validation metrics only"):
        validate_config({"trainer": {"val_every": 5}, "checkpoint": {"keep_best": {"metric": "critic/score/mean"}}}, {})
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "rules:\n  - name: r\n    trigger: {kind: drop, metric: critic/score/mean, amount: 0.1}\n"
        "    actions: [{type: rollback, to: best}]\n"
    )
    with pytest.raises(ConfigError, match="rolls back to the best snapshot by critic/score/mean, but snapshots"):
        load_config(None, ["checkpoint.every=2", f"policies=[{policy}]"])


def test_trainer_state_keeps_the_last_validation_and_reads_version_1():
    a = TrainerState()
    a.step, a.last_val = 4, {"step": 4, "metrics": {"val/score/mean": 0.5}}
    b = TrainerState()
    b.load_state_dict(orjson.loads(orjson.dumps(a.state_dict())))
    assert (b.step, b.last_val) == (4, a.last_val)
    old = {"version": 1, "step": 3, "tokens_seen": 10, "prompts_seen": 2}
    c = TrainerState()
    c.load_state_dict(old)
    assert (c.step, c.last_val) == (3, None)
    with pytest.raises(ValueError, match="version 4"):
        c.load_state_dict({**old, "version": 4})


def test_an_empty_validation_is_nan_not_a_crash():
    from rlctl.engine.reward.builtin import echo_reward

    v = Validator(_cfg(), ROWS, EchoBackend(), echo_reward, Dist(torch.device("cpu")))
    assert math.isnan(v._metrics(v._empty_sums())["val/score/mean"])
