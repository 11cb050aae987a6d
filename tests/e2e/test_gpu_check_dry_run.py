"""benchmarks/gpu_check.py, the one command that proves rlctl on a GPU, run as its CPU dry run (--device cpu
--tiny): it runs whole while no GPU is lent, every check's code path runs on tiny shapes, its report holds
every check in order, the checks a CPU can run pass (the killed and resumed run bit for bit the
uninterrupted one among them), those it cannot are skipped with their reason, and a run or a probe stopped
at its budget still reports what it measured."""

import json
import subprocess
import sys

import pytest

from helpers import REPO

ORDER = ["1", "2", "3", "4", "5", "6", "7a", "7b", "7c", "8", "9"]
PASS_ON_CPU = {
    "1": "env",
    "2": "build",
    "3": "probe",
    "4": "identity",
    "5": "throughput",
    "6": "resume",
    "7a": "lora",
    "7c": "ckpt",
    "8": "writer",
}
SKIPPED_ON_CPU = {"7b": "fp16", "9": "gpu_tests"}


def test_the_gpu_check_runs_whole_on_the_cpu(tmp_path):
    out = tmp_path / "report"
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(out), "--device", "cpu", "--tiny"]
    done = subprocess.run([*cmd, "--work", str(tmp_path)], capture_output=True, text=True, timeout=480, cwd=REPO)
    report = json.loads((out / "report.json").read_text())
    checks = {c["number"]: c for c in report["checks"]}
    assert done.returncode == 0, (done.stdout, done.stderr[-4000:])
    assert report["passed"] is True and report["finished"] is True
    assert report["mode"] == "tiny" and report["device"] == "cpu"
    assert list(checks) == ORDER
    for check in checks.values():
        assert check["status"] in ("pass", "fail", "skipped") and check["budget_s"] > 0
        assert 0 <= check["wall_s"] <= check["budget_s"] + 5 and isinstance(check["figures"], dict)
    for number, name in PASS_ON_CPU.items():
        assert (checks[number]["name"], checks[number]["status"]) == (name, "pass"), checks[number]
    for number, name in SKIPPED_ON_CPU.items():
        assert (checks[number]["name"], checks[number]["status"]) == (name, "skipped") and checks[number]["reason"]

    host = checks["1"]["figures"]["host"]
    assert checks["1"]["figures"]["outside_rlctl_bounds"] == [] and checks["1"]["figures"]["matmul_tflops"] > 0
    assert host["dev_shm_gib"] > 0 and host["disk_write"]["gib_per_s"] > 0 and host["dev_shm_write"]["gib_per_s"] > 0
    assert checks["2"]["figures"]["tokenizer_vocab"] == 500 and checks["2"]["figures"]["logits_ok"] is True

    probe = checks["3"]["figures"]
    assert set(probe["methods"]) == {"rlctl", "generate", "rlctl_graphs", "generate_batch"}  # (this transformers)
    for name, method in probe["methods"].items():
        assert method["error"] is None and method["rounds"], name
        assert all(r["tokens"] == 4 * 8 or name != "rlctl" for r in method["rounds"])  # no eos drawn here
    assert probe["tokens_per_s"]["rlctl"] > 0 and probe["rlctl_over"]["generate"] > 0

    identity = checks["4"]["figures"]
    assert identity["compared"].startswith("cpu against cpu")
    assert {n: (r["steps"], r["tokens_differing"]) for n, r in identity["runs"].items()} == {
        "plain": (4, 0),
        "top_k": (4, 0),
        "top_p_min_p": (4, 0),
    }

    throughput = checks["5"]["figures"]  # T sleeps after step 2 and is stopped as at its budget: rows read
    assert throughput["stopped_at_budget"] is True and throughput["rc"] == -9 and throughput["steady_steps"] == [2]
    assert throughput["prompt_length"] == 48 and throughput["response_length"] == 16
    assert throughput["tokens_per_s"] > 0 and throughput["update_tflops"] > 0 and throughput["update_mfu"] > 0
    assert 0 < throughput["gen_share_of_step"] < 1 and throughput["jit_builds"] == []
    assert set(throughput["phases_s"]) == {"gen", "old_log_prob", "ref", "update_actor", "step"}
    so_far = report["runs_so_far"]  # what a kill of the check itself during a phase would have left
    assert set(so_far) == {"T", "R", "K", "K+", "L", "S"} and so_far["T"]["last_row"]["step"] == 2
    assert so_far["T"]["last_row"]["timing_s/gen"] > 0 and so_far["K+"]["steps"] == 4

    resume = checks["6"]["figures"]
    assert resume["killed"]["rc"] == -9 and resume["resumed_from_step"] == 2  # SIGKILL after step 3; snapshot 2
    assert resume["rows_compared"] == 4 and resume["cells_differing"] == 0 and resume["differences"] == []
    sha = resume["weights_sha256"]
    assert len(sha["reference"]) == 64 and sha["resumed"] == sha["reference"]
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in resume["settings"]

    sizes = checks["7a"]["figures"]["snapshot_bytes"]
    assert 0 < sizes["lora"] < sizes["full"]
    writer = checks["8"]["figures"]
    assert writer["writer_process_seen"] is True and writer["fallbacks"] == []
    assert writer["asynchronous"] and writer["synchronous_save_s"] > 0
    assert writer["writers"]["R"].startswith("process") and writer["writers"]["K"].startswith("thread")

    summary = (out / "summary.txt").read_text().splitlines()
    assert "PASSED" in summary[0] and len(summary) == 1 + len(ORDER)
    assert done.stdout.splitlines() == summary  # the summary is printed too
    assert not list(tmp_path.glob("rlctl-gpu-check-*"))  # the temporary folder is removed


@pytest.fixture
def gpucheck(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from gpucheck import build, context, decode, report

    return build, context, decode, report


def test_a_probe_stopped_at_its_budget_reports_what_it_measured(gpucheck, tmp_path):
    """With no time left after the warm-ups, the probe measures no round: it fails, and its report still
    holds the warm-ups' figures and says it stopped at its budget."""
    build, context, decode, report = gpucheck
    out = report.Report(tmp_path / "out", {"mode": "tiny", "device": "cpu"}, total=60)
    ctx = context.Ctx("cpu", context.TINY, True, tmp_path, out)
    tiny = context.TINY
    ctx.tokenizer = build.train_tokenizer(tiny.vocab, tiny.words, tiny.model["max_position_embeddings"])
    ctx.model = build.build_model(tiny.model, ctx.tokenizer, "cpu")

    out.run("3", "probe", "tiny budget", 30, lambda fig, clock: decode.check_probe(ctx, fig, report.Clock(0.01)))
    check = json.loads((tmp_path / "out" / "report.json").read_text())["checks"][0]
    assert check["status"] == "fail" and "budget ran out" in check["reason"]
    figures = check["figures"]
    assert figures["stopped_at_budget"] is True and figures["summary"]
    assert figures["methods"]["rlctl"]["warmup"]["tokens_per_s"] > 0 and figures["methods"]["rlctl"]["rounds"] == []
    assert figures["methods"]["generate"]["warmup"]["tokens"] == 4 * 8


def test_the_full_checks_run_configs_pass_rlctls_schema(gpucheck, tmp_path):
    """The configs of the GPU's runs (the full size, which only a GPU runs) are valid rlctl configs: a
    wrong key would otherwise be found on the lent machine. T's prompts are read back at their length."""
    from gpucheck import plan

    from rlctl.config import validate_config

    build, context, _, report = gpucheck
    ctx = context.Ctx("cuda", context.FULL, False, tmp_path, report.Report(tmp_path / "out", {}, total=60))
    tiny = context.TINY  # (the full tokenizer takes a minute to train)
    ctx.tokenizer = build.train_tokenizer(tiny.vocab, tiny.words, tiny.model["max_position_embeddings"])
    ctx.model_dir, ctx.params, ctx.shm_free, ctx.fp16 = tmp_path / "model", 494_032_768, 8 << 30, True
    ctx.plan = plan.Plan(ctx)
    configs = {name: plan.run_config(ctx, name)[0] for name in ("T", "R", "K", "L", "F", "S")}
    for name, cfg in configs.items():
        run = validate_config(cfg)
        assert run.trainer.total_steps == cfg["trainer"]["total_steps"], name
    t = validate_config(configs["T"])
    assert (t.rollout.max_new_tokens, t.data.max_prompt_length, t.algorithm.group_size) == (512, 512, 4)
    assert t.trainer.prompts_per_step * t.algorithm.group_size == 256 and t.checkpoint.every == 0
    assert ctx.plan.writers["R"].startswith("process")  # 8 GiB of /dev/shm: too little for four runs' snapshots
    assert all(ctx.plan.writers[n].startswith("thread: /dev/shm has 8.0 GiB free") for n in ("K", "L", "S"))
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    lengths = [len(ctx.tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
    assert len(prompts) == 128 and min(lengths) > 512  # truncated from the left to 512 by the run
