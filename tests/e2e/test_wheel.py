"""The package as users install it: a wheel built from the source tree, installed (non-editable) into a
scratch virtualenv, names a ready-made policy from a folder that is not the repository.

Offline and quick: the wheel is built without build isolation, installed without dependencies, and the
scratch environment sees this environment's packages through a plain path in a .pth file (a plain
path: this environment's editable install of rlctl is not picked up, only the wheel's copy).
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from helpers import REPO


def run(*cmd, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, env=env, **kw)


def build_wheel(tmp_path: Path) -> Path:
    """A wheel of a copy of the sources (building in place would leave build/ in the checkout)."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "rlctl", src / "rlctl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    r = run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        tmp_path / "dist",
        src,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("rlctl-*.whl")
    return wheel


def scratch_env(tmp_path: Path, wheel: Path) -> Path:
    """A virtualenv holding only the wheel, with this environment's site-packages on its path."""
    venv = tmp_path / "venv"
    r = run(sys.executable, "-m", "venv", "--without-pip", venv)
    assert r.returncode == 0, r.stderr
    python = venv / "bin" / "python"
    r = run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel)
    assert r.returncode == 0, r.stdout + r.stderr
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    (Path(purelib) / "rlctl_test_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv


def test_the_wheel_ships_the_ready_made_policies(tmp_path):
    wheel = build_wheel(tmp_path)
    shipped = {Path(n).name for n in zipfile.ZipFile(wheel).namelist() if n.startswith("rlctl/policies/ready/")}
    assert {"default.yaml", "conservative.yaml", "warn-only.yaml"} <= shipped

    venv = scratch_env(tmp_path, wheel)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run(venv / "bin" / "python", "-c", "import rlctl; print(rlctl.__file__)", cwd=elsewhere).stdout
    assert Path(where.strip()).is_relative_to(venv), where  # the wheel's copy, not the source tree

    r = run(venv / "bin" / "rlctl", "policy", "check", "default", cwd=elsewhere)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("default: valid, 8 rules."), r.stdout
