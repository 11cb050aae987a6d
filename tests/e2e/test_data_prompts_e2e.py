"""data.system_prompt and data.filter_overlong_prompts through the real CLI: a model whose tokenizer has a
chat template, prompts dropped and counted at start, the system prompt in every prompt the model sees."""

import orjson
import pytest
import yaml

from rlctl.config import BuiltinModelConfig
from rlctl.engine.model import build_char_tokenizer, build_tiny_model

from helpers import REPO, events_of, invoke, metrics_of, start_args

TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}.{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def test_a_run_with_a_system_prompt_drops_and_counts_overlong_prompts(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    build_tiny_model(BuiltinModelConfig(), tok, 0).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    # "w=" becomes "s:sys.u:w=.a:": len(w) + 12 tokens; the limit 16 keeps words of up to 4 letters
    words = ["ab", "abcdef", "cd", "xyzxyzxyz", "efg", "hijk", "klmnopq", "rs"]
    train = tmp_path / "train.jsonl"
    train.write_bytes(b"".join(orjson.dumps({"prompt": f"{w}=", "target": w}) + b"\n" for w in words))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(tmp_path / "model")},
                "data": {
                    "path": str(train),
                    "system_prompt": "sys",
                    "filter_overlong_prompts": True,
                    "max_prompt_length": 16,
                },
                "trainer": {"total_steps": 2, "prompts_per_step": 5},
                "algorithm": {"group_size": 2},
                "rollout": {"max_new_tokens": 4},
            }
        )
    )
    run = tmp_path / "run"
    r = invoke("start", *start_args(run, config=cfg), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert f"'data.path' {train}: dropped 3 of 8 prompts longer than 16 tokens" in r.stderr
    filtered = [e for e in events_of(run) if e["event"] == "prompts_filtered"]
    assert [(e["data"], e["prompts"], e["dropped"], e["kept"], e["longest"]) for e in filtered] == [
        ("data.path", 8, 3, 5, 21)
    ]
    # every step draws the 5 kept prompts once (an epoch): lengths 14, 14, 15, 16, 14 with the system prompt
    assert [row["prompt_length/mean"] for row in metrics_of(run)] == pytest.approx([14.6, 14.6])
