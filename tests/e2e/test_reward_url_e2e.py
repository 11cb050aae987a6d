"""An HTTP reward drives a real run: `rlctl start` with `reward.sources` = the built-in echo reward and
a scorer this test serves on 127.0.0.1 (the same echo reward over HTTP); the rows carry each source's
mean, and the step's score is their weighted sum."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlctl.engine.reward.builtin import echo_reward

from helpers import metrics_of, run_cli, start_args


class EchoScorer(BaseHTTPRequestHandler):
    """POST {"prompts", "completions", "target"?, ...} -> {"scores": echo_reward(...)}."""

    calls = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        EchoScorer.calls += 1
        scores = echo_reward(body["prompts"], body["completions"], body.get("target"))
        data = json.dumps({"scores": scores}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_url_and_function_sources_drive_a_run(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), EchoScorer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    cfg = {
        "trainer": {"total_steps": 3, "prompts_per_step": 4},
        "algorithm": {"group_size": 2},
        "rollout": {"max_new_tokens": 4},
        "reward": {
            "sources": [
                {"function": "rlctl.engine.reward.builtin:echo_reward", "weight": 0.25},
                {"url": url, "name": "judge", "weight": 0.75, "timeout": 10, "retries": 2},
            ]
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(cfg))
    run = tmp_path / "run"
    try:
        done = run_cli("start", *start_args(run, config=path), timeout=600)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr
    rows = metrics_of(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert EchoScorer.calls >= 3
    for row in rows:
        echo, judge = row["critic/score/echo_reward/mean"], row["critic/score/judge/mean"]
        assert echo == pytest.approx(judge)  # the same scorer, in-process and over HTTP
        assert row["critic/score/mean"] == pytest.approx(0.25 * echo + 0.75 * judge, abs=1e-5)
