"""Object-store clients for rlctl: told to fail fast (our retry budget governs, not theirs), and
fenced off the run's global ``random`` stream (their retry jitter draws from a private generator)."""

from __future__ import annotations

import copy
import difflib
import os
import random
import re
import sys
import threading
import types
from typing import Any

import fsspec
from fsspec.core import split_protocol

from rlctl.errors import ConfigError

_FENCED_PACKAGES = {
    "botocore",
    "aiobotocore",
    "boto3",
    "s3transfer",
    "s3fs",
    "gcsfs",
    "adlfs",
    "google",
    "azure",
}
_FENCED_PACKAGES |= {"aiohttp", "urllib3", "requests", "fsspec"}
_fence_lock = threading.Lock()
_fenced_modules = 0


def private_random_module(owner: str = "rlctl.storage") -> types.ModuleType:
    """A stand-in for the ``random`` module whose functions draw from a generator of their own (for
    third-party packages whose module-level ``random`` must stay off the run's RNG state)."""
    mod = types.ModuleType("random", f"the random module over a private generator ({owner})")
    mod.__dict__.update({k: v for k, v in vars(random).items() if not k.startswith("__")})
    rng = random.Random()
    for name, value in vars(random).items():
        if isinstance(getattr(value, "__self__", None), random.Random):
            setattr(mod, name, getattr(rng, name))
    return mod


_PRIVATE_RANDOM = private_random_module()


def fence_third_party_random() -> None:
    """Point the ``random`` that storage clients use (botocore's retry jitter in ``retryhandler`` and
    ``retries.standard``, aiohttp's connection pool, urllib3's backoff) at a private generator, so that
    a retry during an outage cannot change the run's saved RNG state. Idempotent and cheap; it runs
    again only when modules were imported since."""
    global _fenced_modules
    if len(sys.modules) == _fenced_modules:
        return
    with _fence_lock:
        for name, mod in list(sys.modules.items()):
            # the module's own dict: a module-level __getattr__ (lazy imports) is never triggered
            if name.partition(".")[0] in _FENCED_PACKAGES and getattr(mod, "__dict__", {}).get("random") is random:
                mod.random = _PRIVATE_RANDOM
        backoff = getattr(sys.modules.get("botocore.retries.standard"), "ExponentialBackoff", None)
        init = getattr(backoff, "__init__", None) if backoff is not None else None
        if getattr(init, "__defaults__", None):
            # ExponentialBackoff(random=random.random) bound the global generator at definition time
            glob = random.random.__self__
            init.__defaults__ = tuple(
                _PRIVATE_RANDOM.random if getattr(d, "__self__", None) is glob else d for d in init.__defaults__
            )
        _fenced_modules = len(sys.modules)


# -- object store clients that fail fast -------------------------------------------------------------

# the extra of rlctl that installs a protocol's fsspec filesystem (pyproject.toml)
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
S3, GCS, AZURE = ({p for p, extra in EXTRAS.items() if extra == name} for name in ("s3", "gcs", "azure"))
# gcsfs (2026.10) reads this once, as it is imported, and takes it for on: its experimental client then
# asks each bucket's type over gRPC before its first use, with a 60 s deadline and retries of its own that
# neither rlctl's retry budget nor a read-only command's --timeout governs (a read with --timeout 2 from a
# paused GCS emulator took 43 s). rlctl uses none of the hierarchical-namespace or zonal features it
# serves: off, unless the variable is set.
GCS_NAMESPACES = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
if "gcsfs" not in sys.modules:  # (set as rlctl's storage is imported: before fsspec can import gcsfs for it)
    os.environ.setdefault(GCS_NAMESPACES, "false")

S3_CLIENT_DEFAULTS = {
    "connect_timeout": 5,
    "read_timeout": 60,
    "retries": {"total_max_attempts": 1},
}


def _fast_failing(protocol: str, options: dict[str, Any], request_timeout: float | None = None) -> dict[str, Any]:
    """For S3, botocore's timeouts and retries set short (where neither the caller nor fsspec's config
    chose them), so that a dead endpoint fails in seconds and our retry budget governs; a reader's
    ``request_timeout`` (seconds, > 0) caps the connect and read timeouts, whoever chose them. For GCS
    and Azure, the same connect and read timeouts on their requests (``_gcs_timeouts``,
    ``_azure_timeouts``)."""
    if protocol in GCS:
        return _gcs_timeouts(protocol, options, request_timeout)
    if protocol in AZURE:
        return _azure_timeouts(protocol, options, request_timeout)
    if protocol not in S3:
        return options
    configured = fsspec.config.conf.get(protocol, {}).get("config_kwargs") or {}
    chosen = {
        **S3_CLIENT_DEFAULTS,
        **configured,
        **(options.get("config_kwargs") or {}),
    }
    if request_timeout:  # (0: a reader that retries nothing; its requests keep their own timeouts)
        for key in ("connect_timeout", "read_timeout"):
            chosen[key] = min(float(chosen.get(key) or request_timeout), request_timeout)
    return {
        **options,
        "config_kwargs": copy.deepcopy(chosen),
    }  # botocore writes into the retries dict


def _gcs_timeouts(protocol: str, options: dict[str, Any], request_timeout: float | None) -> dict[str, Any]:
    """gcsfs gives each request its ``requests_timeout``, None by default, which aiohttp takes for no
    timeout at all: a request that gets no answer waits for ever. S3's 5 s to connect and 60 s between
    reads instead, where neither the caller nor fsspec's config chose one; a reader's
    ``request_timeout`` caps both, whoever chose them."""
    import aiohttp  # (gcsfs's own dependency)

    timeout = {**fsspec.config.conf.get(protocol, {}), **options}.get("requests_timeout")
    if timeout is None:
        connect, read = S3_CLIENT_DEFAULTS["connect_timeout"], S3_CLIENT_DEFAULTS["read_timeout"]
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect, sock_read=read)
    elif not isinstance(timeout, aiohttp.ClientTimeout):
        timeout = aiohttp.ClientTimeout(total=float(timeout))  # (a number is the whole request's)
    if request_timeout:
        caps = {
            k: min(float(getattr(timeout, k) or request_timeout), request_timeout)
            for k in ("sock_connect", "sock_read")
        }
        timeout = aiohttp.ClientTimeout(total=timeout.total, connect=timeout.connect, **caps)
    return {**options, "requests_timeout": timeout}


def _azure_timeouts(protocol: str, options: dict[str, Any], request_timeout: float | None) -> dict[str, Any]:
    """The Azure SDK waits 20 s to connect and 60 s between reads (its own defaults, not adlfs's):
    S3's 5 s and 60 s instead, where neither the caller nor fsspec's config chose them (adlfs's
    ``connection_timeout`` and ``read_timeout``), a reader's ``request_timeout`` capping both. adlfs
    passes them to its uploads and downloads only; ``open_fs`` puts them on the client's transport, for
    every request (a listing, a blob's properties)."""
    chosen = {**fsspec.config.conf.get(protocol, {}), **options}
    timeouts = {
        "connection_timeout": chosen.get("connection_timeout") or S3_CLIENT_DEFAULTS["connect_timeout"],
        "read_timeout": chosen.get("read_timeout") or S3_CLIENT_DEFAULTS["read_timeout"],
    }
    if request_timeout:
        timeouts = {k: min(float(v), request_timeout) for k, v in timeouts.items()}
    return {**options, **timeouts}  # (constructor arguments: a reader's client is not training's)


def _azure_transport_timeouts(fs: Any) -> None:
    """Every request of adlfs's client within its ``connection_timeout`` and ``read_timeout`` (azure-core's
    aiohttp transport reads them from its connection configuration for each request)."""
    timeouts = getattr(fs, "_timeout_kwargs", {})
    transport = getattr(getattr(getattr(fs, "service_client", None), "_pipeline", None), "_transport", None)
    connection = getattr(transport, "connection_config", None)
    if connection is None:
        return
    if timeouts.get("connection_timeout"):
        connection.timeout = timeouts["connection_timeout"]
    if timeouts.get("read_timeout"):
        connection.read_timeout = timeouts["read_timeout"]


# a bucket (an Azure container) as every store names one: 3 to 63 letters, digits, dots, dashes or
# underscores (S3's and GCS's rules are stricter, and a legacy S3 bucket may hold capitals)
BUCKET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]")


def url_problem(url: str) -> str | None:
    """What makes ``url`` no storage location, before any request: a protocol fsspec does not know (with
    the nearest known ones), in any link of a chained ``simplecache::s3://b``, or an object-store URL
    without a well-formed bucket. None when there is nothing to say. Only fsspec's registry is read:
    nothing is imported."""
    known = fsspec.available_protocols()
    for part in str(url).split("::"):
        protocol, rest = split_protocol(part)
        if protocol is not None and protocol not in known:
            close = difflib.get_close_matches(protocol, known, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(f'{c}://' for c in close)}?" if close else ""
            return f"unknown storage protocol '{protocol}://' in {url!r}{hint}"
        if protocol in EXTRAS:
            if not part.startswith(f"{protocol}://"):
                return f"{url!r} is not a storage URL: expected {protocol}://BUCKET/PATH"
            bucket = rest.split("/", 1)[0].split("@", 1)[0]  # (abfs://container@account.dfs.core.windows.net)
            if not bucket:
                return f"{url!r} names no bucket: expected {protocol}://BUCKET/PATH"
            if not BUCKET_NAME.fullmatch(bucket):
                return (
                    f"'{bucket}' in {url!r} is not a bucket name (3 to 63 letters, digits, '.', '-' or '_', "
                    "beginning and ending with a letter or a digit)"
                )
    return None


def install_hint(protocol: str) -> str:
    """What to install for ``protocol``'s filesystem: rlctl's extra where it has one."""
    extra = EXTRAS.get(protocol)
    return f"pip install 'rlctl[{extra}]'" if extra else f"install the fsspec filesystem for {protocol}://"


def open_fs(url: str, options: dict[str, Any], request_timeout: float | None = None) -> tuple[Any, str]:
    """The filesystem and root path of ``url``; object-store clients set to fail fast (``_fast_failing``).
    A protocol whose filesystem package is not installed is a ConfigError naming the extra to install
    (an installation to change, not a store to wait for), and so is a protocol that does not exist or an
    object-store URL without a well-formed bucket (``url_problem``)."""
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    if (problem := url_problem(url)) is not None:
        raise ConfigError(problem)
    try:
        fs, root = fsspec.core.url_to_fs(url, **_fast_failing(protocol, options, request_timeout))
    except ImportError as exc:
        raise ConfigError(
            f"{url}: {protocol}:// storage is not installed here: {install_hint(protocol)} ({exc})"
        ) from None
    if protocol in S3 and hasattr(fs, "retries"):
        fs.retries = 1  # s3fs's own retry loop (5 tries by default): ours governs
    if protocol in GCS | AZURE:
        _one_try(fs)
    if protocol in AZURE:
        _azure_transport_timeouts(fs)
    loop = getattr(fs, "loop", None) if getattr(fs, "async_impl", False) else None
    if loop is not None:
        loop.set_exception_handler(_unless_a_dropped_connection)
    return fs, root


def _unless_a_dropped_connection(loop: Any, context: dict[str, Any]) -> None:
    """The exception handler of the object-store clients' event loop (fsspec's): asyncio's default, but
    for a connection error of a task whose result nobody awaits (aiohttp writes a request's body in a
    task of its own; when the server dies mid-request the request fails, and our retry budget takes that
    failure, while the writer task's own "Cannot write to closing transport" would print a traceback
    among the run's one-sentence errors)."""
    if isinstance(context.get("exception"), ConnectionError) and "never retrieved" in context.get("message", ""):
        return
    loop.default_exception_handler(context)


def _one_try(fs: Any) -> None:
    """One try per request, so that our retry budget governs (as S3's total_max_attempts 1). gcsfs tries
    each request up to 6 times (about 31 s of backoff), a count fixed when its class was defined; the
    Azure SDK's client, 4 times (15 s, then 18 and 24 s of backoff: 85 s to fail against a dead endpoint)."""
    request = getattr(type(fs)._request, "__wrapped__", None) if hasattr(type(fs), "_request") else None
    if request is not None:  # gcsfs (its retry decorator keeps the function)
        fs._request = types.MethodType(request, fs)
    policy = getattr(getattr(getattr(fs, "service_client", None), "_config", None), "retry_policy", None)
    for name in ("total_retries", "connect_retries", "read_retries", "status_retries"):
        if isinstance(getattr(policy, name, None), int):  # adlfs: the policy its clients share
            setattr(policy, name, 0)
