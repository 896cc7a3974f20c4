"""A local Ray cluster on loopback, shared by the tests of this folder (started once)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="module")
def ray_local():
    """ray.init on loopback with 4 logical CPUs; shut down after the module. Always a fresh cluster
    (``address="local"``): without it ray.init joins any `ray start` cluster on the machine, and
    then refuses num_cpus."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
             runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}})
    yield ray
    ray.shutdown()
