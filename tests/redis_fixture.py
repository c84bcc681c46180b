"""pytest fixtures running a real ``redis-server`` (``cachegen_core.testing.redis_server``).

``redis_server`` is shared by a whole session (tests flush it or use their own
namespace); ``fresh_redis_server`` is private to one test, for tests that stop,
kill, pause or restart it; ``redis_cluster`` is a Redis Cluster (3 masters, 3
replicas) shared by a module, ``fresh_redis_cluster`` one of a test's own. Without a
``redis-server`` binary the tests are skipped, except under ``CI`` (set and not
``0``/``false``), where that is a failure.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import NoReturn

import pytest

from cachegen_core.testing.redis_cluster import LocalCluster, running_redis_cluster
from cachegen_core.testing.redis_server import INSTALL_HINT, RedisServer, find_redis_server, in_ci, running_redis_server


def redis_server_binary() -> str:
    """Path of ``redis-server``; skips the test (fails it under CI) when missing."""
    path = find_redis_server()
    if path is None:
        _missing("redis-server")
    return path


def _missing(program: str) -> NoReturn:
    """Skip the test for lack of ``program``; fail it under CI, where it is required."""
    msg = f"{program} not found on PATH ({INSTALL_HINT})"
    if in_ci():
        pytest.fail(msg + "; it is required when CI is set", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server shared by the session; flushed before each use by the tests' stores."""
    with running_redis_server(redis_server_binary()) as server:
        yield server


@pytest.fixture
def fresh_redis_server() -> Iterator[RedisServer]:
    """A redis-server of this test alone, free to be stopped, killed, paused or restarted."""
    with running_redis_server(redis_server_binary()) as server:
        yield server


def redis_cluster_binary() -> str:
    """Path of ``redis-server``, with ``redis-cli`` beside it on PATH (it creates the cluster); skips (fails under CI) without."""
    path = redis_server_binary()
    if shutil.which("redis-cli") is None:
        _missing("redis-cli")
    return path


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalCluster]:
    """A Redis Cluster (3 masters with a replica each) shared by a test module; tests use their own namespace."""
    with running_redis_cluster(redis_cluster_binary()) as cluster:
        yield cluster


@pytest.fixture
def fresh_redis_cluster() -> Iterator[LocalCluster]:
    """A Redis Cluster of this test alone, free to lose a master."""
    with running_redis_cluster(redis_cluster_binary()) as cluster:
        yield cluster
