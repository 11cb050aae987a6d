"""The one strict YAML reader (rlctl.yamlsrc.load_yaml): a key given twice is refused with its dotted
path and both lines; people's files are YAML 1.2; a run's config.yaml, written by rlctl's PyYAML
emitter, reads back as the YAML 1.1 that wrote it, so an older run loads as it did."""

import pytest
import yaml

from rlctl.config import RunConfig
from rlctl.errors import ConfigError
from rlctl.rundir.directory import load_run_config, read_config_data
from rlctl.storage import Storage
from rlctl.yamlsrc import PEOPLE, SAVED, NotYaml, load_yaml

# Plain words that YAML 1.1 and YAML 1.2 read differently, or that look like numbers
AMBIGUOUS = ["yes", "no", "on", "off", "Yes", "OFF", "y", "n", "1e-3", "1e5", "12e03", "0o17", "017", "0x1F"]


@pytest.mark.parametrize("dialect", [PEOPLE, SAVED])
def test_a_key_given_twice_names_its_dotted_path_and_both_lines(dialect):
    text = "seed: 1\nactor:\n  lr: 1.0e-3\n  betas: [0.9, 0.95]\n  lr: 5.0\n"
    with pytest.raises(ConfigError) as err:
        load_yaml(text, "run.yaml", dialect)
    assert err.value.message == (
        "run.yaml: 'actor.lr' is given twice: line 3 and line 5; a key is written once in a mapping: keep one"
    )
    with pytest.raises(ConfigError, match="run.yaml: 'trainer' is given twice: line 1 and line 3"):
        load_yaml("trainer: {total_steps: 3}\nseed: 1\ntrainer: {total_steps: 9}\n", "run.yaml", dialect)
    with pytest.raises(ConfigError, match=r"'rules.1.when' is given twice on line 3;"):
        load_yaml("rules:\n  - {name: a}\n  - {when: x > 1, when: x > 5}\n", "p.yaml", dialect)[0]
    with pytest.raises(ConfigError, match="'a' is given twice: line 1 and line 2"):  # quoted or not: one key
        load_yaml("a: 1\n'a': 2\n", "q.yaml", dialect)


def test_origins_keep_every_key_and_list_item_and_a_syntax_error_is_located():
    data, origins = load_yaml("actor:\n  lr: 0.1\nrules:\n  - name: a\n    when: x\n", "f.yaml")
    assert data == {"actor": {"lr": 0.1}, "rules": [{"name": "a", "when": "x"}]}
    assert origins[("actor", "lr")] == "f.yaml line 2" and origins[("rules", "0", "when")] == "f.yaml line 5"
    assert load_yaml("", "f.yaml") == (None, {})
    with pytest.raises(NotYaml) as err:
        load_yaml("actor: {lr: [1, 2\n", "f.yaml")
    assert err.value.line == 2 and err.value.message.startswith("f.yaml line 2 is not valid YAML: ")


def test_people_write_yaml_1_2_and_rlctl_reads_its_own_yaml_1_1():
    text = "".join(f"k{i}: {word}\n" for i, word in enumerate(AMBIGUOUS))
    people = load_yaml(text, "f.yaml", PEOPLE)[0]
    assert [people[f"k{i}"] for i in range(4)] == ["yes", "no", "on", "off"]  # YAML 1.2: words
    assert people["k8"] == 0.001 and people["k9"] == 1e5  # and numbers without a dot are numbers
    assert load_yaml(text, "config.yaml", SAVED)[0] == yaml.safe_load(text)  # exactly what PyYAML read


def test_an_older_runs_config_yaml_reads_as_it_did(tmp_path):
    """A config.yaml written by an older rlctl (the same PyYAML emitter, no rollout.sampler): strings
    that YAML 1.2 would read as numbers or booleans come back as the strings they were."""
    cfg = RunConfig.model_validate({"name": "0o17", "rollout": {"stop": AMBIGUOUS}})
    older = yaml.safe_load(cfg.to_yaml())
    del older["rollout"]["sampler"]
    older_text = yaml.safe_dump(older, sort_keys=False)  # PyYAML's emitter, as an older rlctl used it
    assert "- 1e5\n" in older_text and "- 0o17\n" in older_text  # (plain: strings in YAML 1.1, not in 1.2)
    run = Storage(str(tmp_path / "r"))
    run.makedirs()
    run.write_bytes("config.yaml", older_text.encode())
    loaded = load_run_config(run)
    assert loaded.rollout.stop == AMBIGUOUS and loaded.name == "0o17"
    assert loaded.rollout.sampler == "generator"  # (an older run resumes with the sampler it started with)
    assert read_config_data(run) == older


def test_a_config_yaml_with_a_key_given_twice_is_refused(tmp_path):
    run = Storage(str(tmp_path / "r"))
    run.makedirs()
    run.write_bytes("config.yaml", b"seed: 1\nactor:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(run)
    assert err.value.message == (
        f"{run.url_of('config.yaml')}: 'actor.lr' is given twice: line 3 and line 4; a key is written once "
        "in a mapping: keep one; was it edited by hand?"
    )


def test_a_saved_config_reads_the_same_as_yaml_1_1_and_as_yaml_1_2():
    """rlctl's config.yaml also quotes what YAML 1.2 reads as a number, so it can be a CONFIG file too."""
    cfg = RunConfig.model_validate({"name": "0o17", "rollout": {"stop": AMBIGUOUS}, "actor": {"lr": 1e-5}})
    text = cfg.to_yaml()
    assert "- '1e5'\n" in text and "name: '0o17'\n" in text and "lr: 1.0e-05\n" in text
    assert load_yaml(text, "config.yaml", PEOPLE)[0] == load_yaml(text, "config.yaml", SAVED)[0] == yaml.safe_load(text)
