"""What a storage failure is: transient (worth retrying) or permanent, the cause in a few words, and
the retry loop that turns any backend's failure into one ``StorageError`` sentence.

A permanent failure is either a refusal (``is_refusal``: the bucket does not exist, access is denied, the
credentials are bad; ``StorageRefused``, exit 13, which no requeue mends) or another failure that may
pass (a full disk: ``StorageError``, exit 12, as is an outage that outlasts its budget).

Every retry loop gives up once its budget has passed since its store's outage began (the clock every
writer of the process shares: ``rlctl.storage.outages``), so writers that meet the same outage one
after another (a heartbeat, a metrics flush, a snapshot commit, the flushes on the way out) never add
up their budgets.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar
from urllib.parse import urlsplit

from rlctl.errors import RlctlError, StorageError, StorageRefused
from rlctl.storage.deadline import AttemptCut, attempt
from rlctl.storage.outages import OUTAGES, Outage, store_of

T = TypeVar("T")
_JITTER = random.Random()  # our own backoff jitter, never the global stream

# -- the taxonomy: transient or permanent, and the cause in words ------------------------------------

TRANSIENT_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EAGAIN,
    errno.EPIPE,
    errno.EINTR,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ENETDOWN,
}
# class names (anywhere in an exception's MRO) of network failures in botocore, aiohttp, requests,
# google-auth, http.client, fsspec and the builtins; matched by name so none of them must be importable
TRANSIENT_NAMES = {
    "ConnectionError",  # builtin (refused, reset, aborted, broken pipe), botocore's and requests'
    "TimeoutError",
    "FSTimeoutError",
    "HTTPClientError",  # botocore: ReadTimeoutError, ConnectionClosedError, ...
    "IncompleteReadError",
    "ResponseStreamingError",
    "ResponseParserError",
    "IncompleteRead",
    "ClientConnectionError",  # aiohttp: ServerDisconnectedError, ClientOSError, ...
    "ClientPayloadError",  # aiohttp: a response body cut short ...
    "ContentLengthError",  # ... and what it wraps (aiohttp's parser), also when raised bare
    "TransferEncodingError",
    "ServerTimeoutError",
    "Timeout",  # requests
    "ChunkedEncodingError",
    "TransportError",  # google-auth
}
TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "OperationAborted",
}


# the store answered and refused: its bucket does not exist, or access or the credentials are refused
REFUSED_CODES = {
    "NoSuchBucket",  # S3
    "AccessDenied",
    "AllAccessDisabled",
    "AccountProblem",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "InvalidSecurity",
    "ContainerNotFound",  # Azure
    "AuthorizationFailure",
    "AuthenticationFailed",
    "AuthorizationPermissionMismatch",
    "InsufficientAccountPermissions",
    "InvalidAuthenticationInfo",
    "AccountIsDisabled",
}
MISSING_BUCKET_CODES = {"NoSuchBucket", "ContainerNotFound"}
# credentials that cannot even be made: matched by class name, as TRANSIENT_NAMES
REFUSED_NAMES = {
    "NoCredentialsError",  # botocore
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "DefaultCredentialsError",  # google-auth
    "RefreshError",
    "ClientAuthenticationError",  # azure-core (a 401 or 403)
    "CredentialUnavailableError",  # azure-identity
}
REFUSED_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}


def causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception and what caused it (s3fs re-raises a botocore ClientError as an OSError)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen and len(seen) < 16:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _service_error(exc: BaseException) -> tuple[str, str, int | None] | None:
    """(code, message, HTTP status) of the first service response in the chain (botocore ClientError,
    aiohttp ClientResponseError, gcsfs HttpError), or None. aiohttp's HttpProcessingError is no answer:
    its ``code`` 400 is what aiohttp says of a response it could not parse (a body cut short)."""
    for e in causes(exc):
        if "HttpProcessingError" in {c.__name__ for c in type(e).__mro__}:
            continue
        response = getattr(e, "response", None)
        if isinstance(response, dict) and isinstance(response.get("Error"), dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            err = response["Error"]
            return str(err.get("Code", "")), str(err.get("Message", "") or e), status
        status = getattr(e, "status", None) if not isinstance(e, OSError) else None
        status = status if isinstance(status, int) else getattr(e, "code", None)
        status = status if isinstance(status, int) else getattr(e, "status_code", None)  # (azure-core's)
        if isinstance(status, int) and not isinstance(status, bool) and 100 <= status < 600:
            code = getattr(e, "error_code", None)  # (the Azure SDK's StorageErrorCode, a str enum)
            message = str(getattr(e, "reason", "") or "") if code is not None else ""
            message = message or str(getattr(e, "message", "") or e).split("\n")[0]
            return str(getattr(code, "value", code) or ""), " ".join(message.split()), status
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether trying again later may succeed: the network, a timeout, throttling or a 5xx answer."""
    service = _service_error(exc)
    if service is not None:
        code, _, status = service
        return code in TRANSIENT_CODES or status == 429 or (status is not None and status >= 500 and status != 501)
    for e in causes(exc):
        if {c.__name__ for c in type(e).__mro__} & TRANSIENT_NAMES:
            return True
        if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
            return True
    return False


def not_found(exc: BaseException) -> bool:
    """Whether the store answered 404 (a HEAD's answer has no error code of its own)."""
    service = _service_error(exc)
    return service is not None and (service[2] == 404 or service[0] in MISSING_BUCKET_CODES)


def missing_bucket(exc: BaseException) -> bool:
    """Whether the store said that the bucket (an Azure container) does not exist."""
    service = _service_error(exc)
    return service is not None and service[0] in MISSING_BUCKET_CODES


def is_refusal(exc: BaseException, url: str = "", writing: bool = False) -> bool:
    """Whether the store answered and refused for good (no retry, no requeue mends it): a bucket that
    does not exist, access denied (HTTP 401 or 403, a local EACCES, EPERM or EROFS), credentials that are
    bad or cannot be made. ``writing``: ``exc`` is the failure of a write to ``url``, where a missing
    object on an object store can only be its bucket (gcsfs says a bucket's 404 with the URL alone)."""
    if is_transient(exc):
        return False
    service = _service_error(exc)
    if service is not None:
        code, _, status = service
        return code in REFUSED_CODES or status in (401, 403)
    for e in causes(exc):
        if {c.__name__ for c in type(e).__mro__} & REFUSED_NAMES:
            return True
        if isinstance(e, OSError) and e.errno in REFUSED_ERRNOS:
            return True
        if writing and type(e) is FileNotFoundError and e.errno is None and store_of(url) is not None:
            return True
    return False


REFUSAL_HINT = "a refusal, not an outage: no retry mends it; check the location, its permissions and the credentials"


def refused(action: str, url: str, exc: BaseException) -> StorageRefused:
    """The sentence of a refusal: what was refused, why, and that no retry mends it."""
    cause = describe(exc)
    if missing_bucket(exc) or (type(exc) is FileNotFoundError and exc.errno is None):
        cause = f"{store_of(url) or url} does not exist ({cause})"
    return StorageRefused(f"cannot {action} {url}: {cause}; {REFUSAL_HINT}")


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else url


def describe(exc: BaseException) -> str:
    """The cause of a storage failure in a few words, on one line."""
    name = type(exc).__name__
    if isinstance(exc, AttemptCut):
        return exc.strerror
    service = _service_error(exc)
    if service is not None:
        code, message, status = service
        tags = ", ".join(t for t in (code, f"HTTP {status}" if status else "") if t)
        return f"{message.rstrip('.')} ({tags or name})"
    for e in causes(exc):
        endpoint = (getattr(e, "kwargs", None) or {}).get("endpoint_url") if hasattr(e, "fmt") else None
        if endpoint:
            what = "timed out" if "Timeout" in type(e).__name__ else "unreachable"
            what = "closed the connection" if type(e).__name__ == "ConnectionClosedError" else what
            return f"endpoint {_origin(str(endpoint))} {what} ({type(e).__name__})"
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror[:1].lower() + exc.strerror[1:]
        return text if type(exc).__module__ == "builtins" else f"{text} ({name})"
    text = " ".join(str(exc).split())
    return f"{text[:300]} ({name})" if text else name


# -- the retry loop ----------------------------------------------------------------------------------

BACKOFF_FIRST = 0.25
BACKOFF_CAP = 8.0
ABSENCE = (FileNotFoundError, FileExistsError)


CLIENT_PACKAGES = {"fsspec", "s3fs", "gcsfs", "adlfs", "botocore", "aiobotocore", "boto3", "s3transfer"}
CLIENT_PACKAGES |= {"aiohttp", "requests", "urllib3", "google", "azure", "http", "ssl", "socket"}


def is_storage_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the storage's failure (an OSError, a service's answer, an error raised inside a
    filesystem or its client), not a bug in the calling code."""
    if is_transient(exc) or _service_error(exc) is not None:
        return True
    for e in causes(exc):
        if isinstance(e, OSError):
            return True
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        raised_in = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
        if type(e).__module__.partition(".")[0] in CLIENT_PACKAGES or raised_in.partition(".")[0] in CLIENT_PACKAGES:
            return True
    return False


def guarded(action: str, url: str, fn: Callable[[], T], budget: float, passthrough=ABSENCE) -> T:
    """``fn()``; a transient failure is retried with capped exponential backoff (jittered) until
    ``budget`` seconds after its store's outage began (``OUTAGES``: one clock for every writer of the
    process; on a local path, this call's start); a refusal (``is_refusal``) becomes a StorageRefused,
    any other failure, or the last one, a StorageError "cannot ACTION URL: cause". ``passthrough`` and
    rlctl's own errors (a nested call's StorageError, ``open_fs``'s ConfigError for a filesystem that
    is not installed) are raised as they are, but for a missing file whose bucket is missing."""
    start = time.monotonic()
    tries = 0
    while True:
        tries += 1
        tried = time.monotonic()
        try:
            result = attempt(url, fn, budget, (start, tried))  # (cut short at the outage's deadline)
        except RlctlError:  # already a sentence: a nested call's StorageError, a filesystem not installed
            raise
        except passthrough as exc:
            OUTAGES.answered(url)  # (a missing file is an answer: the store is there)
            if missing_bucket(exc):  # (s3fs and adlfs say a missing bucket as a missing file)
                raise refused(action, url, exc) from exc
            raise
        except Exception as exc:
            if not is_storage_failure(exc):
                raise  # a bug in rlctl (a TypeError in a storage call...): exit 1 with its traceback
            disarm_files(exc)
            if not is_transient(exc):
                if _service_error(exc) is not None:
                    OUTAGES.answered(url)
                if is_refusal(exc, url, writing=True):  # (a missing file the caller passes through came above)
                    raise refused(action, url, exc) from exc
                raise StorageError(f"cannot {action} {url}: {describe(exc)}") from exc
            _wait_or_give_up(action, url, exc, budget, (start, tried), tries)
        else:
            OUTAGES.answered(url)
            return result


WRITE_MODES = {"wb", "ab", "xb"}


def disarm_files(exc: BaseException) -> None:
    """Mark closed the files for writing that a failed attempt left open (fsspec's, found in the frames
    of its traceback). s3fs's append file fails in its constructor when the store is out, and fsspec's
    finalizer would commit the half-built file whenever it is collected, from any thread: an empty
    object over the real one, or, in the filesystem's event loop, a traceback on stderr."""
    for e in causes(exc):
        tb = e.__traceback__
        while tb is not None:
            for value in list(tb.tb_frame.f_locals.values()):
                if _open_for_writing(value):
                    value.closed = True
            tb = tb.tb_next


def _open_for_writing(value: object) -> bool:
    names = {c.__name__ for c in type(value).__mro__}
    return (
        "AbstractBufferedFile" in names
        and getattr(value, "mode", None) in WRITE_MODES
        and not getattr(value, "closed", True)
    )


def _wait_or_give_up(action: str, url: str, exc: Exception, budget: float, times: tuple, tries: int) -> None:
    """After a transient failure of the attempt begun at ``times[1]`` of a call begun at ``times[0]``:
    sleep the backoff, or raise the StorageError that gives up (with ``outage``, the store's outage, for
    a process that did not see it)."""
    start, tried = times
    cause = exc.cause if isinstance(exc, AttemptCut) and exc.cause else describe(exc)  # (the outage's own)
    outage = OUTAGES.failed(url, action, cause, tried)
    left = (outage.since if outage is not None else start) + budget - time.monotonic()
    if left > 0:
        delay = min(BACKOFF_CAP, BACKOFF_FIRST * 2 ** (tries - 1)) * (0.5 + 0.5 * _JITTER.random())
        time.sleep(min(delay, left))
        return
    count = f"{tries} attempt{'s' if tries > 1 else ''} in {time.monotonic() - start:.0f} s"
    earlier = f", {outage.store} having failed since {outage.began()}" if outage and outage.since < start else ""
    error = StorageError(f"cannot {action} {url}: {describe(exc)}; gave up after {count}{earlier}")
    error.outage = outage
    raise error from exc


def note_outage(exc: BaseException) -> None:
    """Count the outage an error carries (a StorageError that gave up in another process) as this
    process's own."""
    for e in causes(exc):
        outage = getattr(e, "outage", None)
        if isinstance(outage, Outage):
            OUTAGES.note(outage)
            return
