"""benchmarks/gpu_check.py, the one command that proves rlctl on a GPU, run as its CPU dry run (--device cpu
--tiny): it runs whole while no GPU is lent, its report holds every check in order, the checks a CPU can
run pass (the killed and resumed run bit for bit the uninterrupted one among them), and those it cannot
are skipped with their reason."""

import json
import subprocess
import sys

from helpers import REPO

ORDER = ["1", "2", "3", "4", "5a", "5b", "5c", "6", "7"]
PASS_ON_CPU = {"1": "env", "2": "build", "3": "grpo", "4": "resume", "5a": "lora", "5c": "ckpt", "6": "writer"}
SKIPPED_ON_CPU = {"5b": "fp16", "7": "gpu_tests"}


def test_the_gpu_check_runs_whole_on_the_cpu(tmp_path):
    out = tmp_path / "report"
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(out), "--device", "cpu", "--tiny"]
    done = subprocess.run([*cmd, "--work", str(tmp_path)], capture_output=True, text=True, timeout=480, cwd=REPO)
    report = json.loads((out / "report.json").read_text())
    checks = {c["number"]: c for c in report["checks"]}
    assert done.returncode == 0, (done.stdout, done.stderr[-4000:])
    assert report["passed"] is True and report["mode"] == "tiny" and report["device"] == "cpu"
    assert list(checks) == ORDER
    for check in checks.values():
        assert check["status"] in ("pass", "fail", "skipped") and check["budget_s"] > 0
        assert 0 <= check["wall_s"] <= check["budget_s"] + 5 and isinstance(check["figures"], dict)
    for number, name in PASS_ON_CPU.items():
        assert (checks[number]["name"], checks[number]["status"]) == (name, "pass"), checks[number]
    for number, name in SKIPPED_ON_CPU.items():
        assert (checks[number]["name"], checks[number]["status"]) == (name, "skipped") and checks[number]["reason"]

    resume = checks["4"]["figures"]
    assert resume["killed"]["rc"] == -9 and resume["resumed_from_step"] == 2  # SIGKILL after step 3; snapshot 2
    assert resume["rows_compared"] == 4 and resume["cells_differing"] == 0 and resume["differences"] == []
    sha = resume["weights_sha256"]
    assert len(sha["reference"]) == 64 and sha["resumed"] == sha["reference"]
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in resume["settings"]

    grpo = checks["3"]["figures"]
    assert grpo["tokens_per_s"] > 0 and grpo["update_tflops"] > 0 and grpo["jit_builds"] == []
    assert set(grpo["phases_s"]) == {"gen", "old_log_prob", "ref", "update_actor", "step"}
    assert checks["2"]["figures"]["tokenizer_vocab"] == 500 and checks["2"]["figures"]["logits_ok"] is True
    assert checks["1"]["figures"]["outside_rlctl_bounds"] == []
    sizes = checks["5a"]["figures"]["snapshot_bytes"]
    assert 0 < sizes["lora"] < sizes["full"]
    writer = checks["6"]["figures"]
    assert writer["writer_process_seen"] is True and writer["fallbacks"] == []
    assert writer["asynchronous"] and writer["synchronous_save_s"] > 0

    summary = (out / "summary.txt").read_text().splitlines()
    assert "PASSED" in summary[0] and len(summary) == 1 + len(ORDER)
    assert done.stdout.splitlines() == summary  # the summary is printed too
    assert not list(tmp_path.glob("rlctl-gpu-check-*"))  # the temporary folder is removed
