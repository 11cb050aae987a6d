"""Objects kept for one conversation in the tool workers: a stateful tool (create / call / release) and
an environment (reset / step / close). Each call of a conversation reaches the worker holding its object;
a worker that does not hold it (replaced after a timeout, or the earlier calls answered from the run's
record) makes it and repeats the earlier calls first; release() and close() run when the rollout ends."""

import json

import pytest

from rlctl.engine.tool_workers.pool import ERROR, OK, TIMEOUT, Session, ToolPool


def counter(instance: str, history=(), start: int = 0) -> Session:
    return Session("tool", "toolbox:Counter", instance, {"start": start}, tuple(history))


def test_a_stateful_tool_keeps_its_state_per_conversation_in_its_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCTL_TEST_RELEASED", str(tmp_path / "released"))
    with ToolPool(workers=2, timeout_s=5.0) as pool:
        first = pool.run([(counter("a", start=10), {"by": 1}), (counter("b"), {"by": 5})], slots=[0, 1])
        assert [r.text.split(" in ")[0] for r in first] == ["total 11", "total 5"]
        second = pool.run(
            [(counter("a", [{"by": 1}], start=10), {"by": 2}), (counter("b", [{"by": 5}]), {"by": 13})],
            slots=[0, 1],
        )
        assert second[0].outcome == OK and second[0].text.split(" in ")[0] == "total 13"  # create ran once
        assert second[0].text.split(" in ")[1] == first[0].text.split(" in ")[1]  # the same worker process
        assert second[1].outcome == ERROR and "ValueError: 13 is unlucky" in second[1].text
        pool.release()
        assert sorted((tmp_path / "released").read_text().split("\n")[:-1]) == ["counter 13", "counter 5"]
        # released: the same name is a new object now, made from its history (its calls repeated)
        (again,) = pool.run([(counter("a", [{"by": 1}, {"by": 2}], start=10), {"by": 3})], slots=[0])
        assert again.text.split(" in ")[0] == "total 16"


@pytest.mark.slow
def test_a_worker_that_does_not_hold_the_object_rebuilds_it_from_the_earlier_calls():
    with ToolPool(workers=1, timeout_s=3.0) as pool:
        # the earlier calls were answered from the record (a step run again): never asked of this worker
        (r,) = pool.run([(counter("c", [{"by": 4}, {"by": 13}, {"by": 4}], start=1), {"by": 1})], slots=[0])
        assert r.text.split(" in ")[0] == "total 10"  # 1 + 4 + 4 + 1: the call that raised changed nothing
        # a timeout kills the worker and the objects it held; the next call rebuilds in a fresh one
        (slow,) = pool.run([(counter("c", [{"by": 4}, {"by": 13}, {"by": 4}, {"by": 1}], start=1), {"by": 99})])
        assert slow.outcome == TIMEOUT
        (after,) = pool.run([(counter("c", [{"by": 4}, {"by": 4}, {"by": 1}], start=1), {"by": 2})], slots=[0])
        assert after.text.split(" in ")[0] == "total 12" and after.text.split(" in ")[1] != r.text.split(" in ")[1]


def test_an_environment_steps_and_answers_observation_reward_done(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCTL_TEST_RELEASED", str(tmp_path / "released"))
    game = lambda history: Session("environment", "toolbox:Guess", "g", {"secret": 3}, tuple(history))  # noqa: E731
    with ToolPool(workers=1, timeout_s=5.0) as pool:
        answers = []
        for turn, guess in enumerate(["1", "five", "I say 3"]):
            history = [[g] for g in ["1", "five", "I say 3"][:turn]]
            (r,) = pool.run([(game(history), [guess])])
            assert r.outcome == OK
            answers.append(json.loads(r.text))
        assert answers == [
            {"observation": "higher (1)", "reward": 0.1, "done": False},
            {"observation": "say a number", "reward": 0.0, "done": False},
            {"observation": "right after 3", "reward": 1.0, "done": True},
        ]
        (bad,) = pool.run([(Session("environment", "toolbox:BadStep", "x"), ["1"])])
        assert bad.outcome == ERROR and "step() must return (observation, reward, done)" in bad.text
        pool.release()
    assert (tmp_path / "released").read_text() == "guess 3\n"
