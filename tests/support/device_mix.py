"""rlctl's CPU run, watched for the device mixes a GPU would refuse: `python tests/support/device_mix.py REPORT --
ARGS` runs `rlctl ARGS` in this process (one rank: it trains here) and writes REPORT, a JSON list of the
places in rlctl's code where one torch call took a tensor that would be on the accelerator and a CPU
tensor of one or more dimensions ("Expected all tensors to be on the same device" on CUDA). Exit: rlctl's.

How a tensor is known to be on the device: rlctl's device here is ``torch.device("cpu", 0)``, which
computes as the CPU but is spelled apart from ``torch.device("cpu")``; a tensor is on the device when it
was made or moved there (``device=``, ``.to(...)``), is a model's parameter, or came out of a call that
took one; its ``.device`` says ``cpu:0``. Every thread's calls are watched (generation ahead runs in one). ``.cpu()``, ``.to("cpu")`` and a factory without a device give CPU tensors, as on a GPU. A
0-dimensional CPU tensor mixes freely, as on CUDA, and so do indexing, item assignment and copies.
Only calls made from rlctl's own code are reported: the libraries' are their own business (DeepSpeed
keeps its buffers on its CPU accelerator here), but their results carry the device on."""

import json
import sys
import threading
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

RLCTL = str(Path(__file__).resolve().parents[2] / "rlctl")
HERE = str(Path(__file__).resolve())
DEVICE = torch.device("cpu", 0)
DEVICE_OF = torch._C.TensorBase.__dict__["device"]  # (``t.device``: the device's spelling for a tensor on it)
# copies and moves, attribute access, and calls that compute nothing (a deep copy's memo holds every tensor)
MIXING_ALLOWED = {
    "copy_",
    "to",
    "type_as",
    "cpu",
    "__get__",
    "__set__",
    "_has_compatible_shallow_copy_type",
    "__deepcopy__",
}
INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}  # (a device tensor takes CPU indices)
OWN_BUFFERS = "/deepspeed/"  # a library that keeps real CPU buffers here (its CPU accelerator's)


def _named(func) -> str:
    return getattr(func, "__name__", str(func))


def _is_device(where) -> bool | None:
    """Whether a ``device=`` or ``.to(...)`` target is the device (True), the CPU (False), or neither."""
    if isinstance(where, str):
        where = torch.device(where)
    if isinstance(where, torch.device):
        return where.index is not None
    return None


class DeviceMix(TorchFunctionMode):
    def __init__(self, root: str = RLCTL) -> None:
        """``root``: the code whose calls are reported (a folder, or one file)."""
        super().__init__()
        self.root = root
        self.on_device = WeakIdKeyDictionary()
        self.mixes: dict[str, dict] = {}

    def _on(self, t: torch.Tensor) -> bool:
        return isinstance(t, torch.nn.Parameter) or t in self.on_device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if getattr(func, "__self__", None) is DEVICE_OF:
            return DEVICE if self._on(args[0]) else result
        name = _named(func)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        target = self._target(name, args, kwargs)
        on = target if target is not None else any(self._on(t) for t in tensors)
        if result is (args[0] if args else None) and isinstance(result, torch.Tensor) and on != self._on(result):
            result = result.view_as(result)  # a move here is none (the same tensor): a tensor of its own
        if on:
            for out in tree_flatten(result)[0]:
                if isinstance(out, torch.Tensor):
                    self.on_device[out] = True
        if name in INDEXING:
            self._indexing(name, args)
        elif name not in MIXING_ALLOWED and any(self._on(t) for t in tensors):
            cpu = [tuple(t.shape) for t in tensors if not self._on(t) and t.dim() > 0]
            if cpu:
                self._report(name, cpu)
        return result

    def _indexing(self, name: str, args) -> None:
        """A tensor on the device takes CPU indices (and values); a CPU tensor refuses device indices."""
        cpu = len(args) > 1 and isinstance(args[0], torch.Tensor) and not self._on(args[0])
        if cpu and any(isinstance(t, torch.Tensor) and self._on(t) for t in tree_flatten(args[1])[0]):
            self._report(name, [tuple(args[0].shape)])

    def _target(self, name: str, args, kwargs) -> bool | None:
        if name == "cpu":
            return False
        if "device" in kwargs:
            return _is_device(kwargs["device"])
        if name == "to":
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    return self._on(a)
                if (is_device := _is_device(a)) is not None:
                    return is_device
        return None

    def _report(self, name: str, cpu_shapes: list) -> None:
        """At the innermost frame of the watched code: the call's own, or, for a call in a library (a model
        given a CPU input), the watched code's that called into it; none for DeepSpeed's own buffers."""
        frames = [f for f in reversed(traceback.extract_stack()) if f.filename != HERE and "/torch/" not in f.filename]
        if not frames or OWN_BUFFERS in frames[0].filename:
            return
        ours = next((f for f in frames if f.filename.startswith(self.root)), None)
        if ours is None:
            return
        where = f"{Path(ours.filename).relative_to(Path(self.root).parent)}:{ours.lineno}"
        seen = self.mixes.setdefault(where, {"where": where, "code": ours.line, "call": name, "count": 0})
        seen["count"] += 1
        seen["cpu_shapes"] = cpu_shapes
        if frames[0] is not ours:
            seen["in"] = f"{frames[0].filename}:{frames[0].lineno}"


def main(argv: list[str]) -> int:
    report, args = Path(argv[0]), argv[argv.index("--") + 1 :]
    import rlctl.engine.runtime as runtime
    from rlctl.cli import main as rlctl_main

    bind = runtime.bind_device
    runtime.bind_device = lambda kind: DEVICE if kind == "cpu" else bind(kind)
    mode = DeviceMix()
    run = threading.Thread.run

    def watched(thread: threading.Thread) -> None:  # (a mode is a thread's: generation ahead has its own)
        with mode:
            run(thread)

    threading.Thread.run = watched
    code = 0
    with mode:
        try:
            rlctl_main(args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    report.write_text(json.dumps(list(mode.mixes.values()), indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
