"""How the tests of a module that share a module-scoped fixture stay on one pytest-xdist worker under
``--dist loadgroup``, through pytest-xdist's public interfaces only (tests/conftest.py has the hooks;
docs/development.md the rule).

pytest-xdist's controller schedules node ids; it never collects, so it sees no mark and no fixture. Its
own ``loadgroup`` learns a test's group from an ``@group`` suffix its workers add to the node id, which
pytest 9 ignores (pytest-xdist 3.8 writes it where pytest no longer reads it). So the workers tell the
controller instead: each writes the groups of the tests it collected, ``{node id: group}``, into a
folder the controller named in its ``workerinput`` (``pytest_configure_node``), before it reports its
collection; the scheduler (``pytest_xdist_make_scheduler``), pytest-xdist's ``LoadGroupScheduling`` from
``xdist.scheduler``, reads them when every worker has reported and makes each group one unit of work,
every other test a unit of its own, as ``loadgroup`` is documented to do."""

from __future__ import annotations

import json
import os
from pathlib import Path

from xdist.scheduler import LoadGroupScheduling


def group_of(item) -> str | None:
    """The group of a test's ``xdist_group`` marks, named as pytest-xdist names it (its marks' names,
    sorted, joined by ``_``); None without one."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    return "_".join(sorted(names)) or None


def write_groups(folder: str, worker: str, items) -> None:
    """The worker's ``{node id: group}``, as ``folder/<worker>.json``: whole or not there (written aside,
    then renamed), so the controller never reads half a file."""
    groups = {item.nodeid: group for item in items if (group := group_of(item))}
    path = Path(folder, f"{worker}.json")
    aside = path.with_suffix(".part")
    aside.write_text(json.dumps(groups))
    os.replace(aside, path)


def read_groups(folder: str) -> dict[str, str]:
    """The groups every worker wrote (all workers collect the same tests: the controller checks that)."""
    groups: dict[str, str] = {}
    for path in sorted(Path(folder).glob("*.json")):
        groups.update(json.loads(path.read_text()))
    return groups


class SharedModuleScheduling(LoadGroupScheduling):
    """``--dist loadgroup`` with the groups the workers wrote: a test with a group runs in that group's
    unit of work (one worker), any other in a unit of its own. A node id the workers wrote nothing for
    (none wrote, e.g. a worker on another machine) falls back to pytest-xdist's own rule, its
    ``@group`` suffix or else the node id: correct, only a shared fixture is then made on each worker."""

    def __init__(self, config, log, folder: str) -> None:
        super().__init__(config, log)
        self.folder = folder
        self.groups: dict[str, str] = {}

    def schedule(self) -> None:
        # called once every worker has reported its collection, each after writing its groups
        self.groups = read_groups(self.folder)
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        # the step by which pytest-xdist's scope schedulers group node ids (LoadFile and LoadGroup override it)
        return self.groups.get(nodeid) or super()._split_scope(nodeid)
