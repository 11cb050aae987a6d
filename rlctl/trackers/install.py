"""Which trackers are installed, and the pip command of each that is not (nothing is imported here)."""

from __future__ import annotations

import importlib.util

# the extra of each tracker, as the command that installs it
PIP: dict[str, str] = {
    "tensorboard": "pip install 'rlctl[tensorboard]'",
    "wandb": "pip install 'rlctl[wandb]'",
    "mlflow": "pip install 'rlctl[mlflow]'",
}

# the modules each tracker imports (MLflow's local store in the run directory is SQLite, through
# SQLAlchemy and Alembic, which mlflow-skinny does not bring)
REQUIRES: dict[str, tuple[str, ...]] = {
    "tensorboard": ("tensorboard",),
    "wandb": ("wandb",),
    "mlflow": ("mlflow", "sqlalchemy", "alembic"),
}


def missing(names: list[str]) -> list[str]:
    """Sentences for configured trackers that are not installed, each naming the pip command
    (``importlib.util.find_spec`` only; nothing is imported)."""
    found = []
    for name in dict.fromkeys(names):
        if name not in REQUIRES:
            found.append(f"there is no tracker named {name!r} (known: {', '.join(REQUIRES)})")
            continue
        absent = [m for m in REQUIRES[name] if importlib.util.find_spec(m) is None]
        if absent:
            what = ", ".join(absent)
            found.append(f"the {name} tracker needs {what}, which is not installed: {PIP[name]}")
    return found
