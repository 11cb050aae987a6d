"""TensorBoard: event files in RUN_DIR/tensorboard/, written with TensorBoard's own record format and
protos (no torch, no TensorFlow), synchronously: a failing disk raises in the call that wrote, where
the fan-out turns it into one warning, and every row is handed to the OS before the call returns.

A turn (rollback, resume) closes the file and opens a new one that starts with a SessionLog START at
``N + 1`` (torch's ``SummaryWriter(purge_step=N + 1)`` does the same): TensorBoard's readers then drop
every earlier event of the steps from N + 1 on, so the steps trained again show their new values
only. Events are the scalar ``events/<kind>`` and a line of text under the tag "events".
"""

from __future__ import annotations

import itertools
import os
import socket
import time

from rlctl.trackers.base import History

_SEQ = itertools.count()  # files opened in one second by one process sort in the order they were opened


class EventFile:
    """One TensorBoard event file, opened for appending; ``purge_step``: the steps from it on that came
    before this file are dropped by readers."""

    def __init__(self, directory: str, purge_step: int | None):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.plugins.text import metadata as text_metadata
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._pb, self._summary = event_pb2, summary_pb2
        self._tensor, self._shape, self._text = TensorProto, TensorShapeProto, text_metadata
        os.makedirs(directory, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_SEQ):06d}"
        self._fh = open(os.path.join(directory, name), "ab")  # noqa: SIM115 (held open until close())
        self._records = RecordWriter(self._fh)
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._write(event_pb2.Event(wall_time=time.time(), step=purge_step, session_log=start))
        self._fh.flush()

    def _write(self, event) -> None:
        self._records.write(event.SerializeToString())

    def scalars(self, step: int, values: dict[str, float], wall: float | None) -> None:
        summary = self._summary.Summary(
            value=[self._summary.Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
        )
        self._write(self._pb.Event(wall_time=wall or time.time(), step=step, summary=summary))

    def text(self, step: int, tag: str, text: str) -> None:
        tensor = self._tensor(
            dtype="DT_STRING",
            string_val=[text.encode()],
            tensor_shape=self._shape(dim=[self._shape.Dim(size=1)]),
        )
        meta = self._text.create_summary_metadata(display_name=tag, description="rlctl run events")
        value = self._summary.Summary.Value(tag=tag, metadata=meta, tensor=tensor)
        self._write(self._pb.Event(wall_time=time.time(), step=step, summary=self._summary.Summary(value=[value])))

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class TensorBoardTracker:
    name = "TensorBoard"

    def __init__(self, run_dir: str, history: History):
        self.dir = os.path.join(run_dir, "tensorboard")
        self.history = history
        self.file: EventFile | None = None

    def _open(self, purge_step: int | None = None) -> EventFile:
        """The event file (a new one with ``purge_step``); a directory without event files yet gets the
        settled history first, so curves start at step 1 even when TensorBoard was turned on later."""
        if self.file is not None and purge_step is None:
            return self.file
        self._close_file()
        fresh = not os.path.isdir(self.dir) or not any(".tfevents." in n for n in os.listdir(self.dir))
        self.file = EventFile(self.dir, purge_step)
        if fresh:
            for step, values, wall in self.history.rows():
                self.file.scalars(step, values, wall)
        return self.file

    def log(self, step: int, values: dict[str, float], wall: float | None) -> None:
        events = self._open()
        events.scalars(step, values, wall)
        events.flush()

    def event(self, step: int, kind: str, text: str) -> None:
        events = self._open()
        events.scalars(step, {f"events/{kind}": 1.0}, None)
        events.text(step, "events", text)
        events.flush()

    def turn(self, step: int, *, branch: bool, why: str) -> None:
        self._open(purge_step=step + 1).flush()

    def close(self, ok: bool) -> None:
        self._close_file()

    def _close_file(self) -> None:
        events, self.file = self.file, None
        if events is not None:
            events.close()
