"""The house rules that code can check (docs/development.md, "Layout"): floors read
top-down (no upward import, no import cycle), the floors are folders, `checkpoint/` knows no model, the
engine knows no tracker and reaches the run directory only through its handle, packages only re-export,
commands load light, no function over 60 lines, no file over 500 lines, a file name used twice names one
idea; test files are named after what they check, and the end-to-end ones drive the CLI as a user does."""

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "rlctl"

# Floors, top first. A module imports only from its own room or from a lower floor; rooms that share a
# floor do not import each other. A module belongs to the room of its longest matching prefix.
FLOORS = [
    ("rlctl.__main__",),
    ("rlctl.cli",),
    ("rlctl.commands",),
    ("rlctl.run", "rlctl.inspect", "rlctl.export", "rlctl.calibrate"),
    ("rlctl.ranks", "rlctl.preflight"),
    ("rlctl.trackers",),
    ("rlctl.engine",),
    ("rlctl.rundir",),
    ("rlctl.config",),
    ("rlctl.policies", "rlctl.checkpoint", "rlctl.metrics"),
    ("rlctl.algos", "rlctl.tools"),
    ("rlctl.storage", "rlctl.yamlsrc", "rlctl.faults", "rlctl.stateful", "rlctl.usercode"),
    ("rlctl.errors", "rlctl.events", "rlctl.numbers", "rlctl"),
]
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """rlctl modules that ``name`` imports anywhere in its file (in functions and TYPE_CHECKING too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m == "rlctl" or m.startswith("rlctl.")}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) - {name} for name, path in known.items()}


def room_of(module: str) -> tuple[int, str]:
    best = None
    for floor, rooms in enumerate(FLOORS):
        for room in rooms:
            if (module == room or module.startswith(room + ".")) and (best is None or len(room) > len(best[1])):
                best = (floor, room)
    assert best is not None, f"{module} is on no floor: add it to FLOORS"
    return best


def test_every_import_goes_down_the_floors():
    upward = []
    for importer, imported in import_graph().items():
        floor, room = room_of(importer)
        for target in imported:
            to_floor, to_room = room_of(target)
            if to_room != room and to_floor <= floor:
                upward.append(f"{importer} ({room}) imports {target} ({to_room})")
    assert upward == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_checks_catch_a_cycle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert room_of("rlctl.algos.losses")[1] == "rlctl.algos"
    assert room_of("rlctl.checkpoint.snapshots")[0] > room_of("rlctl.engine.trainer")[0]
    assert room_of("rlctl.trackers.fanout")[0] < room_of("rlctl.engine.trainer")[0]
    assert imports_between(
        {"rlctl.engine.x": {"rlctl.trackers.y", "rlctl.metrics"}}, "rlctl.engine", "rlctl.trackers"
    ) == {"rlctl.engine.x": ["rlctl.trackers.y"]}


def in_room(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def imports_between(graph: dict[str, set[str]], importer: str, imported: str) -> dict[str, list[str]]:
    """The modules of room ``importer`` that import a module of room ``imported``, with what they import."""
    found = {m: sorted(t for t in graph[m] if in_room(t, imported)) for m in graph if in_room(m, importer)}
    return {m: targets for m, targets in found.items() if targets}


def test_checkpoint_never_imports_engine():
    assert imports_between(import_graph(), "rlctl.checkpoint", "rlctl.engine") == {}


def test_engine_never_imports_trackers():
    """The engine produces metric rows; which trackers receive them, and whether they are installed, is
    the business of the floors above (the rank's session, the preflight)."""
    assert imports_between(import_graph(), "rlctl.engine", "rlctl.trackers") == {}


def test_the_engine_reaches_the_run_directory_only_through_its_handle():
    """The engine is handed the run as one handle (``rlctl.rundir.handle.RunDir``): it opens no storage
    and imports no other module of ``rundir/``, so every file of a run is named and written on that floor."""
    graph = import_graph()
    assert imports_between(graph, "rlctl.engine", "rlctl.storage") == {}
    reached = {t for targets in imports_between(graph, "rlctl.engine", "rlctl.rundir").values() for t in targets}
    assert reached == {"rlctl.rundir.handle"}
    behind = [  # nor does it reach behind the handle: no `run.storage` (self.run, h.run, ...)
        f"{path.relative_to(PKG.parent)}:{node.lineno}"
        for path in sorted((PKG / "engine").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr == "storage"
        and (getattr(node.value, "id", None) == "run" or getattr(node.value, "attr", None) == "run")
    ]
    assert behind == []


def test_packages_only_re_export():
    """A package's ``__init__.py`` names what the package offers and where it lives; the code lives in its
    modules (a module-level ``__getattr__``/``__dir__`` that loads names lazily is a re-export too)."""
    lazy = {"__getattr__", "__dir__"}
    holding = {
        str(path.relative_to(PKG.parent)): names
        for path in PKG.rglob("__init__.py")
        if (
            names := [
                node.name
                for node in ast.parse(path.read_text()).body
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name not in lazy
            ]
        )
    }
    assert holding == {}


def test_no_function_over_60_lines():
    long = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({length} lines)")
    assert long == []


def test_no_file_over_500_lines():
    """In rlctl/ and in benchmarks/ (a benchmark is a product: its figures are quoted and its dry runs tested)."""
    files = sorted(PKG.rglob("*.py")) + sorted((PKG.parent / "benchmarks").rglob("*.py"))
    long = [
        f"{path.relative_to(PKG.parent)} ({n} lines)"
        for path in files
        if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert long == []


def test_floors_are_folders():
    """The floor table and the folder tree say the same: every room of FLOORS is a module or a package
    of rlctl, and no room nests inside another room of a different floor (a package whose part lives on
    another floor is a floor kept in this table, not in the folders)."""
    known = modules()
    rooms = [(floor, room) for floor, names in enumerate(FLOORS) for room in names]
    assert [room for _, room in rooms if room not in known] == []
    nested = [
        f"{inner} (floor {f_in}) inside {outer} (floor {f_out})"
        for f_out, outer in rooms
        for f_in, inner in rooms
        if outer != "rlctl" and inner.startswith(outer + ".") and f_in != f_out
    ]
    assert nested == []


def test_command_modules_load_without_heavy_imports():
    code = (
        "import sys, importlib, pkgutil, rlctl.commands as c\n"
        "for m in pkgutil.iter_modules(c.__path__): importlib.import_module(f'rlctl.commands.{m.name}')\n"
        "heavy = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# A file name used in two packages of rlctl/ is one idea in each, never two ideas under one word.
SAME_NAME_SAME_IDEA = {
    "base": "what a package's models share (policies, trackers)",
    "layout": "the file names, once (of a run directory, of a snapshot)",
    "loader": "reading what the config names (rewards, tools, policies)",
    "schema": "the strict shape of what a user writes (the config, a policy, a tool's arguments)",
    "snapshots": "a run's snapshots (rundir: where and with which settings; checkpoint: the manager)",
    "model": "a model the run loads (the actor's, the reward model)",
    "multi_turn": "the multi-turn rollout (its config section, its code)",
    "export": "a verb: commands/<verb>.py parses and renders, the module below does it",
    "inspect": "a verb, as export",
    "trajectories": "a verb, as export (the command reads the run's trajectories/)",
    "lookup": "the built-in tools task (its tool, its reward: module paths its config names)",
    "reward": "the reward (its config section, the engine's package)",
    "sandbox": "the sandbox of a model's code (its config section, the package)",
}


def test_a_file_name_used_twice_is_one_idea():
    """Modules and packages alike (a second ``tools`` package would fail it); a name listed that is no
    longer used twice is taken off the list."""
    names = [p.stem for p in PKG.rglob("*.py") if p.name != "__init__.py"]
    names += [p.name for p in PKG.rglob("*") if p.is_dir() and p.name != "__pycache__"]
    twice = {name for name in names if names.count(name) > 1}
    assert sorted(twice) == sorted(SAME_NAME_SAME_IDEA)


# -- the test house ----------------------------------------------------------------------------------
TESTS = PKG.parent / "tests"
RUNNERS = {"run_cli", "spawn", "invoke", "kill_and_resume"}  # tests/support/helpers.py: the CLI, as a user runs it
STARTERS = {"subprocess", "slurm_cluster"}  # a script, a benchmark or an installed wheel in a process of its own


def test_test_files_are_named_after_a_behaviour_not_a_module():
    """``tests/unit/test_storage.py`` says where, not what: a test file names what it checks, and no test
    file takes the name of a module or package of rlctl/ or benchmarks/."""
    products = {p.stem for root in (PKG, PKG.parent / "benchmarks") for p in root.rglob("*.py")}
    products |= {p.name for root in (PKG, PKG.parent / "benchmarks") for p in root.rglob("*") if p.is_dir()}
    named = sorted(
        str(p.relative_to(TESTS))
        for p in TESTS.rglob("test_*.py")
        if p.stem[len("test_") :].removesuffix("_e2e") in products
    )
    assert named == []


def test_end_to_end_tests_drive_the_cli_or_a_process():
    """A file in tests/e2e runs rlctl as a user does: its entry point (``invoke``, in this process) or the
    installed command in a process of its own (``run_cli``, ``spawn``), or a script or wheel in a process;
    tests that call rlctl's own functions in this process, real engines included, are in tests/unit."""
    drives = []
    for path in sorted((TESTS / "e2e").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                imported |= {alias.name for alias in node.names} | {node.module or ""}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        if not imported & (RUNNERS | STARTERS):
            drives.append(path.name)
    assert drives == []
