"""Which Ray a run's ranks go to: ``--ray-address local`` (no ``cluster.address``) is a Ray of the run's
own, even on a machine where ``ray start`` ran or RAY_ADDRESS names a cluster (a bare ``ray.init()``
would join that one); an address is that cluster's."""

import pytest

from rlctl.config import validate_config
from rlctl.ranks.ray import launch_ray
from rlctl.ranks.report import SilentReporter
from rlctl.storage import Storage


class Asked(Exception):
    pass


@pytest.mark.parametrize(("address", "asked"), [(None, "local"), ("10.0.0.1:6379", "10.0.0.1:6379")])
def test_a_local_ray_is_the_runs_own_and_an_address_is_that_clusters(tmp_path, monkeypatch, address, asked):
    ray = pytest.importorskip("ray")
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise Asked

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # what a bare ray.init() would join
    cfg = validate_config({"trainer": {"nproc": 2}, "cluster": {"backend": "ray", "address": address}})
    with pytest.raises(Asked):
        launch_ray(Storage(str(tmp_path / "run")), cfg, None, SilentReporter())
    assert calls[0]["address"] == asked
    assert ("_system_config" in calls[0]) == (address is None)  # only a Ray of its own is configured
