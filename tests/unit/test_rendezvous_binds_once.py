"""The ranks' rendezvous (rlctl.engine.rendezvous): a store server bound once and handed on, a bind that
fails tried again on a fresh port a bounded number of times, and a MASTER_PORT that the user set and
another process holds refused in one sentence naming it."""

import socket

import pytest
import torch.distributed as dist

from rlctl.engine import rendezvous
from rlctl.errors import ConfigError, ExitCode


def test_the_store_is_bound_once_on_a_port_the_system_chose_and_ranks_connect_to_it():
    server = rendezvous.bind_rendezvous(2)
    client = dist.TCPStore("127.0.0.1", server.port, 2, is_master=False)
    client.set("rank-1", "here")
    assert server.port > 0 and server.get("rank-1") == b"here"


def test_a_taken_master_port_is_a_sentence_naming_it():
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            rendezvous.bind_rendezvous(2, port)
    assert caught.value.exit_code == ExitCode.CONFIG
    assert caught.value.message.startswith(f"MASTER_PORT is {port} (set in the environment), but another process")


def test_a_failed_bind_is_tried_again_on_a_fresh_port_a_bounded_number_of_times(monkeypatch):
    real, tries = rendezvous._store_server, []

    def failing(times):
        def bind(world, port):
            tries.append(port)
            if len(tries) <= times:
                raise dist.DistNetworkError("The server socket has failed to listen: EADDRINUSE")
            return real(world, port)

        return bind

    monkeypatch.setattr(rendezvous, "_store_server", failing(rendezvous.BIND_TRIES - 1))
    assert rendezvous.bind_rendezvous(2).port > 0 and tries == [0] * rendezvous.BIND_TRIES

    tries.clear()
    monkeypatch.setattr(rendezvous, "_store_server", failing(rendezvous.BIND_TRIES))
    with pytest.raises(dist.DistNetworkError):
        rendezvous.bind_rendezvous(2)
    assert tries == [0] * rendezvous.BIND_TRIES


def test_a_master_port_is_the_users_only_without_a_launchers_variables(monkeypatch):
    for var in ("MASTER_PORT", *rendezvous.LAUNCHER_VARS):
        monkeypatch.delenv(var, raising=False)
    assert rendezvous.user_master_port() is None
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert rendezvous.user_master_port() == 29500
    monkeypatch.setenv("RANK", "0")  # a launcher's: its rendezvous, not rlctl's store
    assert rendezvous.user_master_port() is None
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(ConfigError, match="MASTER_PORT is 'http'"):
        rendezvous.user_master_port()
