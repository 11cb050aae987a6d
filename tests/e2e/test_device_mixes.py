"""rlctl's runs on the CPU under the watch for device mixes (tests/support/device_mix.py): no call of rlctl's takes
a tensor that would be on the GPU beside a CPU tensor of one or more dimensions. The first GPU check
stopped at step 0 on two such mixes that every CPU test had run through (docs/gpu-check.md); this
finds both on the code before their fixes. The runs cover the paths the GPU check takes and more."""

import json
import subprocess
import sys

import pytest
from test_tool_conversations_train_and_resume import task  # noqa: F401 (the model taught to call a tool, the tool, the config)

from helpers import REPO, SMALL, child_env

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("task",)

RUNS = {
    # the GPU check's: bf16, RLOO, several optimizer steps a step, gradient checkpointing, overlong
    "grpo": ["--set", "model.dtype=bf16", "--set", "algorithm.adv_estimator=rloo", "--set", "actor.mini_batch_size=8",
             "--set", "actor.gradient_checkpointing=true", "--set", "algorithm.overlong.enabled=true"],
    "ppo": ["--set", "algorithm.name=ppo", "--set", "algorithm.kl_in_reward=true", "--set", "algorithm.kl_coef=0.1"],
    "lora_one_step_off": ["--set", "actor.lora.rank=4", "--set", "rollout.mode=one_step_off",
                          "--set", "algorithm.dynamic_sampling.enabled=true", "--set", "actor.zero_stage=3"],
}  # fmt: skip


def watched(report, *args: str, cwd=REPO, env=None) -> list[dict]:
    cmd = [sys.executable, str(REPO / "tests" / "support" / "device_mix.py"), str(report), "--", *args]
    done = subprocess.run(cmd, cwd=cwd, env=child_env(**(env or {})), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(report.read_text())


@pytest.mark.parametrize("name", list(RUNS))
def test_a_run_and_its_resume_mix_no_devices(name, tmp_path):
    run = tmp_path / "run"
    steps = ["--set", "trainer.total_steps=2", "--set", "checkpoint.every=1"]
    assert watched(tmp_path / "start.json", "start", "--run-dir", str(run), *SMALL, *RUNS[name], *steps) == []
    if name == "grpo":
        assert watched(tmp_path / "resume.json", "resume", str(run), "--from", "step-1") == []


def test_conversations_with_tool_calls_generated_a_step_ahead_mix_no_devices(task, tmp_path):  # noqa: F811
    config = json.loads((task / "run.yaml").read_text())
    config["rollout"]["mode"], config["trainer"]["total_steps"] = "one_step_off", 2
    (tmp_path / "run.yaml").write_text(json.dumps(config))
    run, env = tmp_path / "run", {"CAPITALS_COUNTER": str(tmp_path / "counter")}
    assert (
        watched(tmp_path / "start.json", "start", str(tmp_path / "run.yaml"), "--run-dir", str(run), cwd=task, env=env)
        == []
    )
    calls = [json.loads(line).get("tool/lookup/calls", 0) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(calls) > 0  # (the model did call its tool)
