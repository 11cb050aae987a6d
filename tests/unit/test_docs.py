"""The README is a short front door and docs/ holds the manual: the config reference is generated from
the schema, the run directory's tree from its layout, the commands' synopsis and options from the click
commands and the metric tables from the metric catalogue, and none drifts from its source; every relative
link leads somewhere, the README's command table lists every command and its exit-code table is the
codes rlctl exits with."""

import importlib.util
import re
import subprocess
import sys

import pytest
from pydantic import BaseModel

from rlctl.config import RunConfig
from rlctl.errors import ExitCode
from rlctl.inspect import CHECK_CODES
from rlctl.policies.catalogue import DESCRIPTIONS, PATTERNS, ROW_KEYS
from rlctl.rundir import layout

from helpers import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]


def generator(name: str = "gen_config_reference"):
    if str(DOCS) not in sys.path:
        sys.path.insert(0, str(DOCS))  # the generators import docs/_generated.py, as when run from docs/
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_reference_is_what_the_generator_writes():
    committed = (DOCS / "config-reference.md").read_text()
    assert generator().render() == committed, "run .venv/bin/python docs/gen_config_reference.py"


def test_the_generator_check_fails_on_drift(tmp_path, monkeypatch, capsys):
    gen = generator()
    page = tmp_path / "config-reference.md"
    monkeypatch.setattr(gen, "PAGE", page)
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
    page.write_text(page.read_text().replace("Number of RL steps", "Number of steps"))
    assert gen.main(["--check"]) == 1
    assert "-| `trainer.total_steps` | int, >= 1 | `200` | Number of steps" in capsys.readouterr().err


def test_the_run_directory_in_concepts_is_what_the_layout_draws():
    committed = (DOCS / "concepts.md").read_text()
    assert generator("gen_run_dir").render(committed) == committed, "run .venv/bin/python docs/gen_run_dir.py"
    assert f"```\n{layout.tree()}```" in committed


def test_the_run_dir_check_fails_on_drift(tmp_path, monkeypatch, capsys):
    gen = generator("gen_run_dir")
    page = tmp_path / "concepts.md"
    page.write_text(f"# Concepts\n\n{gen.BEGIN}\n{gen.END}\n\nmore\n")
    monkeypatch.setattr(gen, "PAGE", page)
    assert gen.main(["--check"]) == 1 and gen.main([]) == 0 and gen.main(["--check"]) == 0
    assert page.read_text().endswith(f"{layout.tree()}```\n{gen.END}\n\nmore\n")
    page.write_text(page.read_text().replace("  trackers.json", "  trackers.yaml"))
    assert gen.main(["--check"]) == 1
    assert "-  trackers.yaml" in capsys.readouterr().err


def test_the_commands_page_is_what_the_commands_write():
    committed = (DOCS / "commands.md").read_text()
    gen = generator("gen_commands")
    assert gen.render(committed) == committed, "run .venv/bin/python docs/gen_commands.py"
    paths = [path for path, _, _ in gen.commands()]
    assert {"trajectories", "runs", "policy check", "policy replay", "policy calibrate"} <= set(paths)
    for path in paths:  # a block of its own, and a line of the synopsis
        assert f"<!-- the options of rlctl {path}: written by docs/gen_commands.py" in committed, path
        assert re.search(rf"^rlctl {path} ", committed, flags=re.M), path
    assert "| `--timeout` | `SECONDS`, x>=0 | `10.0`, or `$RLCTL_RETRY_TIMEOUT` when set |" in committed


def test_the_commands_check_fails_on_drift(tmp_path, monkeypatch, capsys):
    gen = generator("gen_commands")
    page = tmp_path / "commands.md"
    page.write_text((DOCS / "commands.md").read_text())
    monkeypatch.setattr(gen, "PAGE", page)
    assert gen.main(["--check"]) == 0
    page.write_text(page.read_text().replace("Take over a lease whose heartbeat", "Take a lease whose heartbeat"))
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "-| `--force` | a flag | off | Take a lease whose heartbeat" in err
    assert "commands.md differs from the commands: run .venv/bin/python docs/gen_commands.py" in err
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0


def test_a_command_without_its_block_or_a_block_without_its_command_is_an_error(tmp_path, monkeypatch):
    gen = generator("gen_commands")
    committed = (DOCS / "commands.md").read_text()
    begin = "<!-- the options of rlctl runs: written by docs/gen_commands.py from rlctl/commands/ -->"
    with pytest.raises(SystemExit, match="lacks the markers .* add them where the options of rlctl runs belongs"):
        gen.render(committed.replace(begin, ""))
    stale = f"{begin.replace('rlctl runs', 'rlctl gone')}\n<!-- end of the options of rlctl gone -->\n"
    with pytest.raises(SystemExit, match="has blocks gen_commands.py does not write: the options of rlctl gone"):
        gen.render(committed + stale)


def test_the_metrics_page_is_what_the_catalogue_writes(tmp_path, monkeypatch, capsys):
    committed = (DOCS / "metrics.md").read_text()
    gen = generator("gen_metrics")
    assert gen.render(committed) == committed, "run .venv/bin/python docs/gen_metrics.py"
    for key in [*ROW_KEYS, *DESCRIPTIONS, *PATTERNS]:
        assert f"| `{key}` |" in committed, key
    page = tmp_path / "metrics.md"
    page.write_text(committed.replace("steps completed (1-based)", "steps done"))
    monkeypatch.setattr(gen, "PAGE", page)
    assert gen.main(["--check"]) == 1
    assert "-| `step` | steps done |" in capsys.readouterr().err


def test_the_generators_load_no_torch():
    """gen_commands loads every command module, gen_metrics the catalogue: neither imports torch, as
    `rlctl --help` does not."""
    code = (
        f"import sys; sys.path.insert(0, {str(DOCS)!r})\n"
        "import gen_commands, gen_metrics\n"
        "gen_commands.commands()\n"
        "heavy = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def readme_commands() -> list[str]:
    """The commands of the README's table under ``## Commands``, as written: ``rlctl runs ROOT``."""
    section = README.read_text().split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(rlctl [^`]+)` \|", section, flags=re.M)


def test_the_readme_command_table_lists_every_command():
    rows = readme_commands()
    paths = [path for path, _, _ in generator("gen_commands").commands()]
    missing = [p for p in paths if not any(r == f"rlctl {p}" or r.startswith(f"rlctl {p} ") for r in rows)]
    assert missing == [], "add a row to the README's command table for each"
    unknown = [r for r in rows if not any(r == f"rlctl {p}" or r.startswith(f"rlctl {p} ") for p in paths)]
    assert unknown == []
    assert "rlctl trajectories RUN --step N" in rows


def test_every_name_of_the_layout_is_in_its_tree():
    """A file named in the layout but left out of the drawing would be missing from the docs."""
    names = {k: v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str)}
    drawn = layout.tree()
    assert {k: v for k, v in names.items() if v not in drawn} == {}
    assert {"LEASE_FILE", "MODEL_COMPLETE", "TOOL_RESULTS", "TRAJECTORIES", "POLICY_STATE"} <= set(names)


def test_every_config_key_is_in_the_reference():
    """Walked apart from the generator: a key it skipped would be missing here."""
    reference = (DOCS / "config-reference.md").read_text()
    missing = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            if f"`{prefix}{name}` |" not in reference and f"## `{prefix}{name}`" not in reference:
                missing.append(prefix + name)
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                walk(field.annotation, f"{prefix}{name}.")

    walk(RunConfig, "")
    assert missing == []
    assert "| `reward.sources[i].weight` |" in reference and "| `checkpoint.keep_best.k` |" in reference
    assert "| `schedules.<knob>.mode` |" in reference


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def links(page) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_relative_link_leads_to_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_the_readme_is_a_front_door_and_the_package_description():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "make test" in text  # the test command CI runs
    assert "rlctl start" in text and "rlctl resume" in text and "make demo" in text
    pages = {target.partition("#")[0] for target in links(README) if target.startswith("docs/")}
    assert {f"docs/{p.name}" for p in DOCS.glob("*.md")} <= pages, "a docs page the README does not link"
    assert re.search(r'^readme = "README.md"$', (REPO / "pyproject.toml").read_text(), flags=re.M)


def exit_code_rows(page) -> dict[int, str]:
    """The rows ``| N | meaning |`` of the page's tables whose first column is a bare number."""
    return {int(m[0]): m[1] for m in re.findall(r"^\| (\d+) \| (.+) \|$", page.read_text(), flags=re.M)}


def test_one_exit_code_table_and_it_lists_every_code():
    rows = exit_code_rows(README)
    assert set(rows) == {int(c) for c in ExitCode} | set(CHECK_CODES.values())
    for outcome, code in CHECK_CODES.items():
        assert "inspect --check" in rows[code] or code == 0, (outcome, code)
    elsewhere = {page.name: sorted(exit_code_rows(page)) for page in PAGES[1:] if exit_code_rows(page)}
    assert elsewhere == {}, "exit codes are listed once, in the README"
