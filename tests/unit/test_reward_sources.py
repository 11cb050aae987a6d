"""Remote rewards against a real HTTP server on 127.0.0.1, and weighted reward sources."""

import json
import math
import os
import signal
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlctl.config.load import load_config
from rlctl.config.reward import RewardConfig
from rlctl.engine.reward import score_completions
from rlctl.engine.reward.builtin import echo_reward
from rlctl.engine.reward.remote import RemoteReward, retry_after
from rlctl.engine.reward.sources import load_reward, metrics_of, recording
from rlctl.errors import ConfigError, InputError, Stopped


class Scorer:
    """A scripted endpoint: each request takes the next (status, headers, body) of ``replies`` (the
    last one repeats); a body of None answers the echo reward's scores."""

    def __init__(self, replies=((200, {}, None),), delay=0.0):
        self.replies, self.delay, self.requests = list(replies), delay, []
        scorer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                scorer.requests.append(body)
                time.sleep(scorer.delay)
                status, headers, reply = scorer.replies[min(len(scorer.requests), len(scorer.replies)) - 1]
                if reply is None:
                    reply = json.dumps({"scores": echo_reward(body["prompts"], body["completions"])})
                data = reply.encode() if isinstance(reply, str) else json.dumps(reply).encode()
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    made = []

    def make(*replies, delay=0.0):
        made.append(Scorer(replies or ((200, {}, None),), delay))
        return made[-1]

    yield make
    for s in made:
        s.close()


PROMPTS, COMPLETIONS = ["ab", "cd"], ["ab", "xx"]


def test_scores_returned_and_the_body_holds_columns_and_kwargs(serve):
    s = serve()
    remote = RemoteReward(s.url, kwargs={"k": 1})
    scores = score_completions(load_reward(RewardConfig(url=s.url, kwargs={"k": 1})), "x", PROMPTS, COMPLETIONS, {}, {})
    assert scores == echo_reward(PROMPTS, COMPLETIONS)
    assert remote(PROMPTS, COMPLETIONS, target=["ab", "cd"]) == echo_reward(PROMPTS, COMPLETIONS)
    assert s.requests[-1] == {
        "prompts": PROMPTS,
        "completions": COMPLETIONS,
        "target": ["ab", "cd"],
        "kwargs": {"k": 1},
    }


def test_a_nan_in_a_column_is_a_located_error_before_any_request(serve):
    """The body is strict JSON: json.dumps would have sent a bare NaN, which a strict server refuses."""
    import numpy as np

    s = serve()
    with pytest.raises(InputError) as err:
        RemoteReward(s.url)(PROMPTS, COMPLETIONS, target=["ab", "cd"], weight=[0.5, math.nan])
    assert err.value.message == (
        f"reward URL {s.url}: column 'weight' row 1 (nan) is not a finite number, and strict JSON has no NaN or "
        "Infinity; clean that column of the dataset (or drop it) before training"
    )
    with pytest.raises(InputError, match=r"column 'meta' row 0\['scores'\]\[1\] \(inf\) is not a finite number"):
        RemoteReward(s.url)(PROMPTS, COMPLETIONS, meta=[{"scores": np.array([1.0, np.inf])}, {}])
    with pytest.raises(InputError, match=r"kwargs\['floor'\] \(-inf\) is not a finite number"):
        RemoteReward(s.url, kwargs={"floor": -math.inf})(PROMPTS, COMPLETIONS)
    assert s.requests == []  # nothing was sent
    RemoteReward(s.url)(PROMPTS, COMPLETIONS, weight=np.array([0.5, 1.0]))  # finite numpy columns still go
    assert s.requests[-1]["weight"] == [0.5, 1.0]


def test_retries_then_succeeds(serve):
    s = serve((503, {}, "busy"), (503, {}, "busy"), (200, {}, None))
    assert RemoteReward(s.url, retries=2, backoff=0.01)(PROMPTS, COMPLETIONS) == echo_reward(PROMPTS, COMPLETIONS)
    assert len(s.requests) == 3


@pytest.mark.slow
def test_retry_after_is_honoured(serve):
    s = serve((429, {"Retry-After": "1"}, "slow down"), (200, {}, None))
    start = time.monotonic()
    RemoteReward(s.url, retries=1, backoff=0.01)(PROMPTS, COMPLETIONS)
    assert time.monotonic() - start >= 0.95
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0 and retry_after("x") is None


def test_stays_down_names_the_url_attempts_and_last_error(serve):
    s = serve((503, {}, "overloaded"))
    with pytest.raises(InputError, match=r"did not answer after 3 attempts .*last error: HTTP 503 .*overloaded") as e:
        RemoteReward(s.url, retries=2, backoff=0.01)(PROMPTS, COMPLETIONS)
    assert s.url in e.value.message and len(s.requests) == 3
    s.close()
    with pytest.raises(InputError, match="after 1 attempt .*cannot connect"):
        RemoteReward(s.url, retries=0)(PROMPTS, COMPLETIONS)


def test_a_client_error_is_not_retried(serve):
    s = serve((400, {}, "bad field"))
    with pytest.raises(InputError, match=r"answered HTTP 400 Bad Request: bad field"):
        RemoteReward(s.url, retries=3, backoff=0.01)(PROMPTS, COMPLETIONS)
    assert len(s.requests) == 1


@pytest.mark.parametrize(
    "body, message",
    [
        ({"scores": [1.0]}, "returned 1 scores for 2 completions"),
        ('{"scores": [1.0, NaN]}', "returned nan for completion 1"),
        ([1.0, 2.0], "expected a JSON object"),
        ("<html>", "not JSON: <html>"),
    ],
)
@pytest.mark.slow
def test_a_malformed_answer_is_an_input_error(serve, body, message):
    s = serve((200, {}, body))
    reward = load_reward(RewardConfig(url=s.url))
    with pytest.raises(InputError, match=message):
        score_completions(reward, "x", PROMPTS, COMPLETIONS, {}, {})
    assert len(s.requests) == 1


def test_timeout_is_retried_then_reported(serve):
    s = serve(delay=0.5)
    with pytest.raises(InputError, match=r"after 2 attempts .*no answer within 0.1s"):
        RemoteReward(s.url, timeout=0.1, retries=1, backoff=0.01)(PROMPTS, COMPLETIONS)


def test_a_stop_signal_cuts_the_backoff_short(serve):
    s = serve((503, {}, "down"))
    seen = []

    def ours(signum, frame):
        seen.append(signum)

    def stop_in_the_backoff():  # once the backoff watches (a fixed delay could land while the POST runs)
        end = time.monotonic() + 30
        while signal.getsignal(signal.SIGTERM) is ours and time.monotonic() < end:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        threading.Thread(target=stop_in_the_backoff, daemon=True).start()
        start = time.monotonic()
        with pytest.raises(Stopped):
            RemoteReward(s.url, retries=1, backoff=20)(PROMPTS, COMPLETIONS)
        assert time.monotonic() - start < 5 and seen == [signal.SIGTERM]  # the handler before still ran
        assert signal.getsignal(signal.SIGTERM) is not previous  # ours, restored
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow
def test_a_stop_signal_during_a_request_cuts_the_backoff_after_it_short(serve):
    """A preemption that lands while the endpoint takes its time to answer 503: the run's handler runs
    then, and the backoff that follows is not waited out."""
    s = serve((503, {}, "down"), delay=1.0)
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))

    def stop_during_the_request():
        end = time.monotonic() + 30
        while not s.requests and time.monotonic() < end:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        threading.Thread(target=stop_during_the_request, daemon=True).start()
        start = time.monotonic()
        with pytest.raises(Stopped):
            RemoteReward(s.url, retries=1, backoff=20)(PROMPTS, COMPLETIONS)
        assert time.monotonic() - start < 10 and seen == [signal.SIGTERM] and len(s.requests) == 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sources_sum_with_weights_and_record_each_mean(serve):
    s = serve((200, {}, {"scores": [2.0, 4.0]}))
    cfg = RewardConfig(
        sources=[
            {"function": "rlctl.engine.reward.builtin:echo_reward", "weight": 0.5},
            {"url": s.url, "weight": 2.0, "name": "judge"},
        ]
    )
    reward = load_reward(cfg)
    echo = echo_reward(PROMPTS, COMPLETIONS)
    assert metrics_of(reward) == {"critic/score/echo_reward/mean": "mean", "critic/score/judge/mean": "mean"}
    with recording(reward) as means:
        scores = score_completions(reward, "ignored", PROMPTS, COMPLETIONS, {}, {})
    assert scores == pytest.approx([0.5 * echo[0] + 4.0, 0.5 * echo[1] + 8.0])
    assert means == pytest.approx({"critic/score/echo_reward/mean": sum(echo) / 2, "critic/score/judge/mean": 3.0})
    score_completions(reward, "ignored", PROMPTS, COMPLETIONS, {}, {})  # outside a recording: not counted
    with recording(reward) as again:
        pass
    assert again == {"critic/score/echo_reward/mean": 0.0, "critic/score/judge/mean": 0.0}


def test_a_shorthand_logs_no_per_source_metric_and_keeps_its_errors():
    reward = load_reward(RewardConfig())
    assert metrics_of(reward) == {} and metrics_of(echo_reward) == {}
    with recording(reward) as means:
        assert reward(PROMPTS, COMPLETIONS) == echo_reward(PROMPTS, COMPLETIONS)
    assert means == {}
    with pytest.raises(InputError, match="reward function 'math:sqrt' raised TypeError"):
        load_reward(RewardConfig(function="math:sqrt"))(PROMPTS, COMPLETIONS)


def test_a_url_is_not_contacted_when_loaded(serve):
    s = serve()
    load_reward(RewardConfig(sources=[{"url": s.url}, {"function": "rlctl.engine.reward.builtin:echo_reward"}]))
    assert s.requests == []


@pytest.mark.parametrize(
    "reward, message",
    [
        ("function: a:b\n  sources: [{function: c:d}]", "'reward' .*line 1.*'sources' or 'function', not both"),
        ("url: ftp://host/x", "'reward.url'.*http:// or https://"),
        (
            "sources: [{function: a:b, url: 'http://h'}]",
            "'reward.sources.0'.*exactly one of 'function', 'url' and 'model'",
        ),
        ("sources: [{url: 'http://h/a'}, {url: 'http://h/b'}]", r"unique \(repeated: h\)"),
        ("sources: [{function: a:b, timeout: 3}]", "'reward.sources.0'.*'url' source only"),
        ("sources: [{function: a:b, name: 'a b'}]", "'reward.sources.0.name'"),
        ("timeout: 3", "apply with 'url' only"),
        ("sources: [{function: a:b, wieght: 2}]", "wieght"),
    ],
)
def test_config_errors_are_located(tmp_path, reward, message):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(f"reward:\n  {reward}\n"))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_non_finite_weight_is_refused():
    with pytest.raises(ValueError, match="finite"):
        RewardConfig(sources=[{"function": "a:b", "weight": math.inf}])
