"""Storage errors classed by cause (issue 41). An unknown protocol or a malformed URL is a config error
(exit 3) before any request; a refusal (a bucket that does not exist, access denied, bad credentials) is
StorageRefused (exit 13), never retried, and a bucket is never created; only what may pass (refused or
reset connections, timeouts, 5xx, throttling, a full disk) is exit 12. And the bounds: no Azure request
waits longer than a reader's timeout, and no attempt made during an outage outlasts its budget. On real
stores: moto (S3, its authentication on where the test needs it), the GCS emulator, Azurite (which
checks the account key)."""

import errno
import json
import os
import signal
import sys
import time
import uuid

import pytest
from conftest import AZURITE_ACCOUNT, AZURITE_KEY, _pause, _server, _stop, gcs_server, refused_port

from rlctl.config import load_config
from rlctl.errors import ConfigError, ExitCode, StorageError
from rlctl.preflight import check_config_names
from rlctl.storage import Storage
from rlctl.storage.deadline import RECHECK
from rlctl.storage.failures import guarded, is_refusal, is_transient

from helpers import child_env, invoke, run_cli

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("s3_with_auth",)

AZURITE = "azurite/node_modules/.bin/azurite-blob"


def _expect(code: ExitCode, fn):
    with pytest.raises(StorageError) as info:
        fn()
    assert info.value.exit_code == code, info.value.message
    assert "\n" not in info.value.message
    return info.value.message


# -- what the URL says, before any request ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("nosuchproto://x/y", "unknown storage protocol 'nosuchproto://' in 'nosuchproto://x/y'"),
        ("s3://", "'s3://' names no bucket: expected s3://BUCKET/PATH"),
        ("gs:///runs/a", "'gs:///runs/a' names no bucket: expected gs://BUCKET/PATH"),
        ("s3://my bucket/run", "'my bucket' in 's3://my bucket/run' is not a bucket name"),
    ],
)
def test_an_unknown_protocol_or_a_malformed_url_is_exit_3_before_any_request(url, said):
    with pytest.raises(ConfigError) as info:
        Storage(url)
    assert info.value.exit_code == ExitCode.CONFIG and info.value.message.startswith(said), info.value.message


def test_a_malformed_checkpoint_dir_is_named_with_its_key_and_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("checkpoint:\n  dir: s3:///ckpt\n")
    with pytest.raises(ConfigError) as info:
        check_config_names(load_config(path))
    assert info.value.message == (
        "invalid config: 'checkpoint.dir' (run.yaml line 2): 's3:///ckpt' names no bucket: expected s3://BUCKET/PATH."
    )


def test_start_with_a_run_dir_of_an_unknown_protocol_is_exit_3():
    """Before: exit 12 ("cannot open nosuchproto://x/y: Protocol not known"), which Slurm requeues."""
    done = invoke("start", "--run-dir", "nosuchproto://x/y", "--set", "trainer.total_steps=1")
    assert done.returncode == ExitCode.CONFIG, done.stderr[-2000:]
    assert done.stderr.strip() == "Error: unknown storage protocol 'nosuchproto://' in 'nosuchproto://x/y'"


# -- the classes, from the exceptions each client raises ----------------------------------------------------


def test_refusals_are_told_from_what_may_pass():
    from azure.core.exceptions import ClientAuthenticationError, HttpResponseError
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError
    from s3fs.errors import translate_boto_error

    def client_error(code: str, status: int) -> ClientError:
        return ClientError(
            {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "op"
        )

    def azure(status: int, code: str, kind=HttpResponseError):
        exc = kind(message=f"{code} said")
        exc.status_code, exc.error_code = status, code
        return exc

    refusals = [
        translate_boto_error(client_error("AccessDenied", 403)),
        translate_boto_error(client_error("NoSuchBucket", 404)),
        client_error("InvalidAccessKeyId", 403),
        client_error("SignatureDoesNotMatch", 403),
        NoCredentialsError(),
        azure(403, "AuthorizationFailure"),
        azure(404, "ContainerNotFound"),
        azure(401, "InvalidAuthenticationInfo", ClientAuthenticationError),
        PermissionError(errno.EACCES, "Permission denied"),
        OSError(errno.EROFS, "Read-only file system"),
    ]
    may_pass = [
        EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
        TimeoutError(),
        client_error("SlowDown", 503),
        azure(503, "ServerBusy"),
        azure(500, "InternalError"),
    ]
    assert [is_refusal(e) for e in refusals] == [True] * len(refusals)
    assert [is_refusal(e) or not is_transient(e) for e in may_pass] == [False] * len(may_pass)
    full = OSError(errno.ENOSPC, "No space left on device")  # may pass too (a purge, another job ending)
    assert not is_refusal(full) and not is_transient(full)
    _expect(ExitCode.STORAGE, lambda: guarded("write", "/x/y", lambda: (_ for _ in ()).throw(full), 5))
    calls = []

    def denied():
        calls.append(1)
        raise refusals[0]

    text = _expect(ExitCode.STORAGE_REFUSED, lambda: guarded("write", "s3://bkt/k", denied, 5))
    assert calls == [1], "a refusal is never retried"
    assert text.startswith("cannot write s3://bkt/k: AccessDenied (AccessDenied, HTTP 403); a refusal, not an outage")


# -- missing buckets, denied access and bad credentials on real stores -------------------------------------


@pytest.fixture(params=["s3", "gs", "az"])
def store_options(request):
    env, opts = request.getfixturevalue({"s3": "s3_env", "gs": "gcs_env", "az": "azure_env"}[request.param])
    return request.param, opts


def test_a_missing_bucket_is_refused_before_any_work_and_never_created(store_options):
    """Before: s3fs and adlfs created the bucket on the first write (a typo made a bucket), gcsfs's
    write failed with exit 12, and nothing looked before the run began."""
    protocol, opts = store_options
    bucket = f"rlctl-missing-{uuid.uuid4().hex[:8]}"
    store = Storage(f"{protocol}://{bucket}/run", opts, retry_timeout=5)
    text = _expect(ExitCode.STORAGE_REFUSED, store.check_reachable)
    assert text.startswith(f"cannot open {protocol}://{bucket}/run: {protocol}://{bucket} does not exist ("), text
    _expect(ExitCode.STORAGE_REFUSED, lambda: store.write_bytes("lease.json", b"{}"))
    _expect(ExitCode.STORAGE_REFUSED, lambda: store.append_bytes("metrics.jsonl", b"{}\n"))
    assert not store.fs.exists(bucket), "rlctl created the bucket"
    Storage(f"{protocol}://rlctl-runs/run-{uuid.uuid4().hex[:8]}", opts).check_reachable()  # a bucket that is there


@pytest.mark.slow
def test_start_on_a_missing_bucket_is_exit_13_before_the_run_directory_exists(s3_env, tmp_path):
    bucket = f"rlctl-missing-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "run.yaml"
    config.write_text(f"checkpoint:\n  dir: s3://{bucket}/ckpt\ntrainer:\n  total_steps: 1\n")
    done = run_cli("start", str(config), "--run-dir", str(tmp_path / "run"), env=child_env(**s3_env[0]), timeout=300)
    assert done.returncode == ExitCode.STORAGE_REFUSED, done.stderr[-2000:]
    assert (
        f"Error: 'checkpoint.dir' (run.yaml line 2): cannot open s3://{bucket}/ckpt: s3://{bucket} does not exist"
        in (done.stderr)
    )
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def s3_with_auth():
    """A moto server that checks credentials: its first three requests (a bucket, an IAM user and that
    user's key) are let through, every later one must be signed by a key it knows, with a policy."""
    import boto3

    server = os.path.join(os.path.dirname(sys.executable), "moto_server")
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
    proc, url = _server([server, "-H", "127.0.0.1", "-p", "{port}"], "moto_server", env)
    kw = {"endpoint_url": url, "aws_access_key_id": "x", "aws_secret_access_key": "x", "region_name": "us-east-1"}
    boto3.client("s3", **kw).create_bucket(Bucket="rlctl-guarded")
    iam = boto3.client("iam", **kw)
    iam.create_user(UserName="nobody")
    key = iam.create_access_key(UserName="nobody")["AccessKey"]
    yield url, key["AccessKeyId"], key["SecretAccessKey"]
    _stop(proc)


@pytest.mark.parametrize(
    ("who", "said"),
    [
        ("no policy", "Access Denied (AccessDenied, HTTP 403)"),
        ("a wrong secret", "(SignatureDoesNotMatch, HTTP 403)"),
        ("an unknown key", "(InvalidAccessKeyId, HTTP 403)"),
    ],
)
@pytest.mark.slow
def test_s3_access_denied_and_bad_credentials_are_refused(s3_with_auth, who, said):
    """Before: exit 12, which the Slurm example requeued five times."""
    url, key, secret = s3_with_auth
    key, secret = {
        "no policy": (key, secret),
        "a wrong secret": (key, "w" * 40),
        "an unknown key": ("AKIAUNKNOWN", secret),
    }[who]
    store = Storage("s3://rlctl-guarded/run", {"client_kwargs": {"endpoint_url": url}, "key": key, "secret": secret})
    assert said in _expect(ExitCode.STORAGE_REFUSED, store.check_reachable)
    # a write asks for the bucket first (a HEAD, whose 403 carries no code: storage's _makedirs)
    assert "HTTP 403" in _expect(ExitCode.STORAGE_REFUSED, lambda: store.write_bytes("metrics.jsonl", b"{}\n"))
    _expect(ExitCode.STORAGE_REFUSED, lambda: store.read_bytes("config.yaml"))


def test_an_azure_account_key_that_is_wrong_is_refused(azure_env):
    """Azurite checks the shared-key signature. Before: exit 12."""
    wrong = AZURITE_KEY[:-12] + "AAAAAAAAAAA="
    opts = {"connection_string": azure_env[1]["connection_string"].replace(AZURITE_KEY, wrong)}
    store = Storage("az://rlctl-runs/run", opts, retry_timeout=5)
    text = _expect(ExitCode.STORAGE_REFUSED, lambda: store.write_bytes("metrics.jsonl", b"{}\n"))
    assert "(AuthorizationFailure, HTTP 403)" in text, text
    _expect(ExitCode.STORAGE_REFUSED, store.check_reachable)


# -- bounds -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_paused_azure_server_is_given_up_on_within_a_readers_timeout_and_a_writers_deadline():
    """The Azure SDK waits 20 s to connect and 60 s for a read of its own; a reader's --timeout (2 s
    here) bounds both. Before: the read waited 60 s. Then a writer with the 60 s read timeout and a 3 s
    budget meets the outage the reader opened: its request is cut at the outage's deadline
    (``rlctl.storage.deadline``). Before: it waited its read timeout, 60 s."""
    server = os.path.join(os.path.dirname(os.path.dirname(sys.executable)), AZURITE)
    if not os.path.exists(server):
        pytest.skip("Azurite is not installed (`make venv` installs it)")
    args = ["--inMemoryPersistence", "--blobHost", "127.0.0.1", "--blobPort", "{port}", "--skipApiVersionCheck"]
    proc, url = _server([server, *args, "--loose", "--silent"], "Azurite")
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint={url}/{AZURITE_ACCOUNT};"
    )
    try:
        store = Storage("az://rlctl-paused/run", {"connection_string": connection})
        store.fs.mkdir("rlctl-paused")
        store.write_bytes("config.yaml", b"trainer: {}\n")
        writer = Storage("az://rlctl-paused/run", {"connection_string": connection}, retry_timeout=3)
        assert writer.read_bytes("config.yaml") == b"trainer: {}\n"
        _reader_then_writer_on_a_paused_server(proc, writer, {"connection_string": connection})
    finally:
        proc.send_signal(signal.SIGCONT)
        _stop(proc)


@pytest.mark.slow
def test_a_writer_on_a_paused_gcs_server_is_given_up_on_at_the_outages_deadline():
    """gcsfs waits 60 s for a read; a writer with a 3 s budget that meets the outage a reader opened on a
    paused gcp-storage-emulator is given up within the deadline (``rlctl.storage.deadline``). Before: 60 s."""
    proc, url = gcs_server("--default-bucket", "rlctl-paused")
    opts = {"endpoint_url": url, "token": "anon", "project": "rlctl-tests"}
    try:
        writer = Storage("gs://rlctl-paused/run", opts, retry_timeout=3)
        writer.write_bytes("config.yaml", b"trainer: {}\n")
        _reader_then_writer_on_a_paused_server(proc, writer, opts)
    finally:
        proc.send_signal(signal.SIGCONT)
        _stop(proc)


def _reader_then_writer_on_a_paused_server(proc, writer: Storage, options: dict) -> None:
    """Pause the server: a reader with a 2 s --timeout gives up within it and opens the store's outage;
    ``writer`` (its client's own read timeout, a 3 s budget) meets that outage and is cut at its deadline."""
    reader = Storage.for_reading(writer.url, 2, options)
    _pause(proc)
    began = time.monotonic()
    with pytest.raises(StorageError, match="gave up after"):
        reader.read_bytes("config.yaml")
    assert time.monotonic() - began < 2 + 4, time.monotonic() - began
    with pytest.raises(StorageError, match="had no answer by the deadline; gave up after"):
        writer.write_bytes("metrics.jsonl", b'{"step": 1}\n')
    assert time.monotonic() - began < 3 + RECHECK + 3, time.monotonic() - began


# -- --timeout on every read-only command -----------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["export", "{run}", "{out}"], ["policy", "replay", "{run}"], ["policy", "calibrate", "{run}"]],
    ids=["export", "policy replay", "policy calibrate"],
)
@pytest.mark.slow
def test_the_commands_that_read_a_run_take_a_timeout(args, tmp_path):
    """Before: no --timeout (exit 2), and 60 s of retries on an unreachable store."""
    opts = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{refused_port()}"}, "key": "k", "secret": "s"}
    env = child_env(FSSPEC_S3=json.dumps(opts), AWS_DEFAULT_REGION="us-east-1")
    run = f"s3://rlctl-unreachable-{uuid.uuid4().hex[:8]}/run"
    argv = [a.format(run=run, out=tmp_path / "out") for a in args]
    began = time.monotonic()
    done = run_cli(*argv, "--timeout", "1", env=env, timeout=120)
    seconds = time.monotonic() - began
    assert done.returncode == ExitCode.STORAGE, done.stderr[-2000:]
    assert "unreachable" in done.stderr and "gave up after" in done.stderr, done.stderr[-2000:]
    assert seconds < 20, seconds  # (the interpreter's start included; the retries took about 1 s)
