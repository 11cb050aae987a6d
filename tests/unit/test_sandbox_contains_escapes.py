"""The sandbox for a model's code (rlctl.sandbox): escapes tried for real, each contained (the run
directory and the home directory unseen, a socket to a server on the host's loopback, writes outside
/tmp, the /tmp quota, memory, a fork bomb, a daemonised child); the limits reported as the code's own;
a located error naming the fix when the jail cannot start. The unsafe mode is shown letting through what
the jail stops, so each escape test can fail."""

import os
import shutil
import socket
import subprocess
import threading
import uuid
from pathlib import Path

import pytest

from rlctl.sandbox import Limits, SandboxUnavailable, check, execute, version

JAIL = Limits(wall_time_s=5.0, cpu_time_s=2, memory_mb=512, processes=16, output_kb=64, tmp_mb=2)
UNSAFE = Limits(mode="unsafe", wall_time_s=5.0, cpu_time_s=2, memory_mb=512, processes=16)


def _jail_problem() -> str | None:
    try:
        check(JAIL, "sandbox")
    except SandboxUnavailable as exc:
        return str(exc)
    return None


problem = _jail_problem()
needs_jail = pytest.mark.skipif(problem is not None, reason=f"no bubblewrap jail on this machine: {problem}")


def _running(marker: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if marker in line and "ps -eo" not in line]


@needs_jail
def test_the_run_directory_and_the_home_directory_are_not_there(tmp_path):
    run_file = tmp_path / "metrics.jsonl"
    run_file.write_text("secret-run")
    home_file = Path.home() / f".rlctl-sandbox-test-{uuid.uuid4().hex}"
    home_file.write_text("secret-home")
    try:
        code = f"[open(p).read() for p in ({str(run_file)!r}, {str(home_file)!r}) if __import__('os').path.exists(p)]"
        jailed, plain = execute(code, JAIL), execute(code, UNSAFE)
    finally:
        home_file.unlink()
    assert jailed.ok and jailed.value == "[]"
    assert plain.value == "['secret-run', 'secret-home']"  # what a plain process reads
    listing = execute("import os; sorted(os.listdir('/'))", JAIL)
    assert "work" not in listing.value and "home" not in listing.value


@needs_jail
def test_no_socket_reaches_a_server_on_the_hosts_loopback():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    threading.Thread(target=lambda: server.accept()[0].close(), daemon=True).start()
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); 'connected'"
    jailed, plain = execute(code, JAIL), execute(code, UNSAFE)
    server.close()
    assert plain.value == "'connected'"
    assert jailed.value is None and "ConnectionRefusedError" in jailed.error
    assert "OSError" in execute("import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)", JAIL).error


@needs_jail
def test_writes_outside_tmp_fail_and_tmp_holds_its_quota_only():
    outside = execute("open('/usr/rlctl-escape', 'w')", JAIL)
    assert "Read-only file system" in outside.error or "Permission denied" in outside.error
    full = execute("open('/tmp/big', 'wb').write(b'x' * (8 << 20))", JAIL)  # 8 MB into a 2 MB /tmp
    assert "No space left on device" in full.error or "File too large" in full.error
    assert execute("open('/tmp/small', 'w').write('ok'); open('/tmp/small').read()", JAIL).value == "'ok'"


@needs_jail
def test_memory_past_the_limit_is_the_codes_error():
    result = execute("x = bytearray(2 << 30)", JAIL)
    assert result.limit == "memory" and not result.ok


@pytest.mark.slow
@needs_jail
def test_a_fork_bomb_is_stopped_and_leaves_nothing_running():
    marker = f"bomb{uuid.uuid4().hex[:8]}"
    code = f"""
import os, time
while True:
    try:
        if os.fork() == 0:
            os.execvp("sleep", ["sleep", "600", "{marker}"])
    except OSError:
        time.sleep(0.01)
"""
    result = execute(code, JAIL)
    assert result.limit in ("processes", "wall_time") and not result.ok
    assert _running(marker) == []


@needs_jail
def test_a_daemonised_child_is_gone_when_the_call_ends():
    marker = f"daemon{uuid.uuid4().hex[:8]}"
    code = f"import subprocess; subprocess.Popen(['sleep', '600', '{marker}'], start_new_session=True); 'left'"
    result = execute(code, JAIL)
    assert result.ok and result.value == "'left'"
    assert _running(marker) == []


@pytest.mark.slow
@needs_jail
def test_limits_are_the_codes_errors_not_failures_of_the_sandbox():
    spin = execute("while True: pass", Limits(cpu_time_s=1, wall_time_s=15))  # (room for a loaded machine)
    assert spin.limit == "cpu_time" and spin.seconds < 15
    sleep = execute("import time; time.sleep(30)", Limits(wall_time_s=1))
    assert sleep.limit == "wall_time" and sleep.seconds < 3
    loud = execute("print('x' * (100 << 20))", JAIL)  # 100 MB printed
    assert loud.limit == "output" and len(loud.stdout) <= 64 << 10


@needs_jail
def test_output_value_traceback_stdin_and_earlier_cells():
    r = execute("print('hi')\nx = 6\nx * 7", JAIL)
    assert (r.stdout, r.value, r.error, r.ok) == ("hi\n", "42", None, True)
    r = execute("def f():\n    return 1 / 0\nf()", JAIL)
    assert r.error.startswith("Traceback") and "ZeroDivisionError: division by zero" in r.error
    assert "runner" not in r.error and 'File "<cell>", line 2, in f' in r.error
    assert execute("print(input()[::-1])", JAIL, stdin="abc\n").stdout == "cba\n"
    assert execute("y + 1", JAIL, cells=("y = 1", "print('not shown')", "y += 1")).value == "3"


def test_a_missing_binary_is_a_located_error_naming_the_fix():
    with pytest.raises(SandboxUnavailable) as exc:
        check(Limits(binary="bwrap-not-installed"), "rollout.multi_turn.sandbox")
    text = str(exc.value)
    assert text.startswith("'rollout.multi_turn.sandbox.binary': 'bwrap-not-installed' is not on PATH")
    assert "apt-get install bubblewrap" in text and "mode: unsafe" in text
    check(Limits(mode="unsafe", binary="bwrap-not-installed"), "x")  # unsafe asks for no jail


@needs_jail
def test_a_jail_that_cannot_make_its_namespaces_is_a_located_error(tmp_path):
    fake = tmp_path / "bwrap"  # what bwrap says where user namespaces are refused
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable) as exc:
        check(Limits(binary=str(fake)), "rollout.multi_turn.sandbox")
    assert "cannot start on this machine (bwrap: No permissions to creating new namespace)" in str(exc.value)
    assert shutil.which("bwrap") and (version() or "").startswith("bubblewrap")


@pytest.mark.slow
def test_unsafe_mode_still_holds_the_limits():
    assert execute("while True: pass", Limits(mode="unsafe", cpu_time_s=1, wall_time_s=4)).limit == "cpu_time"
    assert execute("x = bytearray(2 << 30)", UNSAFE).limit == "memory"
    assert os.environ.get("HOME") not in execute("import os; os.environ.get('HOME')", UNSAFE).value
