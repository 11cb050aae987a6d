"""The house rules of STYLE.md that code can check."""

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "rlctl"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_checkpoint_never_imports_engine():
    offenders = {
        str(p.relative_to(PKG)): sorted(m for m in imported_modules(p) if m.startswith("rlctl.engine"))
        for p in (PKG / "checkpoint").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_command_modules_load_without_heavy_imports():
    code = (
        "import sys, importlib, pkgutil, rlctl.commands as c\n"
        "for m in pkgutil.iter_modules(c.__path__): importlib.import_module(f'rlctl.commands.{m.name}')\n"
        "heavy = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
