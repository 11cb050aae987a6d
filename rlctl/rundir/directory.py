"""Creating and loading a run directory (its snapshots: ``rundir.snapshots``; its summary: ``rundir.summary``).

Every file read back here may be malformed: a ``config.yaml`` that is not YAML or not a valid config
is a ConfigError naming the file; unreadable metric rows are skipped."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlctl.errors import ConfigError, RlctlError
from rlctl.metrics import read_rows
from rlctl.rundir.layout import CONFIG, METRICS, MODEL, not_a_run
from rlctl.rundir.snapshots import snapshot_catalog
from rlctl.storage import Storage
from rlctl.yamlsrc import SAVED, NotYaml, load_yaml

if TYPE_CHECKING:  # (imported where used: `rlctl inspect --check` reads a run without them)
    from rlctl.config import RunConfig


def run_storage(url: str, cfg: RunConfig | None = None) -> Storage:
    """The run directory's storage, with the run's retry budget for transient failures once its config
    is known (``checkpoint.retry_timeout``)."""
    if cfg is None:
        return Storage(url)
    return Storage(url, retry_timeout=cfg.checkpoint.retry_timeout)


# -- a new run, or a start that never trained -----------------------------------------------------------
def refuse_used_run_dir(run: Storage) -> bool:
    """Whether ``run`` holds an earlier start of a run that never trained (it may be started again:
    True), or nothing (False). A directory holding a run that trained a step, or has a committed
    snapshot, is a ConfigError: it is resumed, never started over."""
    if not (run.exists(CONFIG) or run.exists(METRICS)):
        return False
    used = f"--run-dir {run.url} already holds a run"
    hint = f"choose a new directory (or rlctl resume {run.url})"
    trained = last_step(run)
    if trained:
        raise ConfigError(f"{used} that trained {trained} step(s); {hint}")
    if run.exists(METRICS) and run.read_bytes(METRICS).strip():
        raise ConfigError(f"{used}: its {METRICS} holds lines that are not metric rows; {hint}")
    if not run.exists(CONFIG):
        return True
    try:
        old = load_run_config(run)
    except ConfigError as exc:
        raise ConfigError(f"{used} whose config cannot be read ({exc.message}); {hint}") from None
    committed = [i.name for i in snapshot_catalog(run, old).scan() if i.committed or i.unreadable]
    if committed:  # (a manifest that cannot be read may be a damaged commit: never started over either)
        raise ConfigError(f"{used} with a committed snapshot ({committed[-1]}); {hint}")
    return True


def claim_run_dir(run: Storage, cfg: RunConfig) -> bool:
    """Under the run's lease: check the directory again (``refuse_used_run_dir``), write ``cfg`` as its
    config, and, when an earlier start that never trained is reused, drop the built-in model it built
    from other settings (rlctl's own product, rebuilt from the new config). Whether it was reused."""
    reused = refuse_used_run_dir(run)
    if reused and run.exists(CONFIG) and run.exists(MODEL):
        old = load_run_config(run)
        if old.model.path is None and (old.model.builtin, old.seed) != (cfg.model.builtin, cfg.seed):
            run.rm(MODEL, recursive=True)
    run.write_bytes(CONFIG, cfg.to_yaml().encode())
    return reused


# -- reading a run back --------------------------------------------------------------------------------
def read_config_data(run: Storage) -> dict[str, Any]:
    """The parsed ``config.yaml`` of a run (a mapping), or a ConfigError naming the file: missing, not
    YAML (or not UTF-8), a key given twice, not a mapping."""
    where = run.url_of(CONFIG)
    try:
        raw = run.read_bytes(CONFIG)
    except FileNotFoundError:
        raise not_a_run(run.url) from None
    except IsADirectoryError:
        raise ConfigError(f"{where} is a directory, not a run's config") from None
    try:  # (rlctl wrote it with PyYAML's emitter: read as that YAML 1.1, strictly)
        data = load_yaml(raw.decode("utf-8"), where, SAVED)[0]
    except UnicodeDecodeError as exc:
        cause = f"byte 0x{raw[exc.start]:02x} at offset {exc.start} is not UTF-8"
        raise ConfigError(f"{where} is not valid YAML: {cause}; was it edited by hand?") from None
    except NotYaml as exc:
        line = f" (line {exc.line})" if exc.line is not None else ""
        raise ConfigError(f"{where} is not valid YAML{line}: {exc.problem}; was it edited by hand?") from None
    except ConfigError as exc:  # a key given twice
        raise ConfigError(f"{exc.message}; was it edited by hand?") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} holds a {type(data).__name__}, not a config mapping; was it edited by hand?")
    return data


def load_run_config(run: Storage) -> RunConfig:
    """The run's validated config; a ConfigError naming ``config.yaml`` when it is malformed."""
    return validate_run_config(run, read_config_data(run))


def validate_run_config(run: Storage, data: dict[str, Any]) -> RunConfig:
    """``data`` (read from the run's config.yaml) as a RunConfig; a ConfigError naming the file. Only
    its shape and values are checked: the data, models and storage it names may be absent here (the
    preflight of a resume checks them, naming the file too)."""
    from rlctl.config import Provenance, validate_config

    try:
        cfg = validate_config(with_legacy_sampler(data), {})
    except RlctlError as exc:
        raise ConfigError(f"{run.url_of(CONFIG)}: {exc.message}") from None
    return cfg.read_from(Provenance(f"{run.url_of(CONFIG)}: invalid config"))


def with_legacy_sampler(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config without ``rollout.sampler`` was written before the key existed, by an rlctl whose
    only sampler was the per-sequence CPU generator: it resumes with that one (bit for bit)."""
    rollout = data.get("rollout")
    if rollout is None or (isinstance(rollout, dict) and "sampler" not in rollout):
        return {**data, "rollout": {**(rollout or {}), "sampler": "generator"}}
    return data


def last_step(run: Storage) -> int:
    """The highest step the run's metrics record (0: it never trained a step)."""
    return max((r["step"] for r in read_rows(run, METRICS, require_step=True)), default=0)
