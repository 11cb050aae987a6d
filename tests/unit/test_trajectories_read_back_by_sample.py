"""The trajectories of a multi-turn run's conversations: tokens cut into the model's runs and the others',
one file per step and rank, read back by prompt and sample whatever the ranks, a torn line skipped, a
step trained again replacing its file."""

from rlctl.engine.rollout.trajectory import TrajectoryLog, segments
from rlctl.rundir.handle import RunDir
from rlctl.rundir.trajectories import read_step, recorded_steps
from rlctl.storage import Storage


def test_segments_are_the_runs_of_the_models_tokens_and_the_others():
    decode = lambda ids: ",".join(map(str, ids))  # noqa: E731
    got = segments([1, 2, 3, 4, 5, 6], [True, True, False, False, False, True], True, decode)
    assert got == [
        {"by": "model", "trained": True, "tokens": 2, "text": "1,2"},
        {"by": "tools", "trained": False, "tokens": 3, "text": "3,4,5"},
        {"by": "model", "trained": True, "tokens": 1, "text": "6"},
    ]
    assert [s["trained"] for s in segments([1, 2], [True, False], False, decode)] == [False, False]  # masked
    assert segments([], [], True, decode) == []


def _conv(prompt_index: int, sample_index: int, score: float) -> dict:
    return {"prompt_index": prompt_index, "sample_index": sample_index, "score": score, "segments": []}


def test_ranks_files_are_read_by_prompt_and_sample_and_a_step_trained_again_replaces_its_own(tmp_path):
    run = Storage(str(tmp_path))
    zero, one = TrajectoryLog(RunDir(run), 0), TrajectoryLog(RunDir(run), 1)
    zero.add(3, _conv(2, 0, 1.0))
    zero.add(3, _conv(0, 1, 0.0))
    one.add(3, _conv(0, 0, 0.5))
    zero.write()
    one.write()
    zero.add(4, _conv(5, 0, 0.0))
    zero.write()
    assert recorded_steps(run) == [3, 4]
    assert [(r["prompt_index"], r["sample_index"], r["rank"]) for r in read_step(run, 3)] == [
        (0, 0, 1),
        (0, 1, 0),
        (2, 0, 0),
    ]
    zero.add(3, _conv(2, 0, 0.25))  # step 3 trained again (a resume, a rollback)
    zero.write()
    assert [r["score"] for r in read_step(run, 3)] == [0.5, 0.25]
    path = tmp_path / "trajectories" / "step-000003.rank-1.jsonl"
    path.write_bytes(path.read_bytes() + b'{"prompt_index": 9, "segm')  # torn by a kill mid-write
    path.write_bytes(path.read_bytes() + b'\n{"segments": [3], "calls": []}\n{"segments": [], "calls": "x"}\n')
    (tmp_path / "trajectories" / "notes.txt").write_text("not a trajectory")
    assert len(read_step(run, 3)) == 2 and read_step(run, 7) == []
