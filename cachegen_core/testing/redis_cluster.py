"""A real Redis Cluster on loopback: ``redis-server`` nodes in cluster mode, joined by ``redis-cli --cluster create``.

3 masters with one replica each by default, every node on its own free port (and a free
cluster-bus port), no persistence but each node's ``nodes.conf`` in its own directory, so a killed
node restarted on its port rejoins. ``node_timeout_ms`` is short (500 ms) so that a killed master
fails over in a second or two: tests of failover stay fast. TLS (``tls``: the paths a
:class:`RedisServer` takes) covers clients, the cluster bus and replication.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .redis_server import INSTALL_HINT, RedisServer, find_redis_server, free_port

SLOTS = 16384


class ClusterNode(RedisServer):
    """One ``redis-server`` with ``cluster-enabled yes`` (see the module doc)."""

    def __init__(self, binary: str, *, node_timeout_ms: int, **kwargs: Any) -> None:
        super().__init__(binary, **kwargs)
        self.node_timeout_ms = node_timeout_ms
        self.new_ports()

    def new_ports(self) -> None:
        """New free ports for the node and its cluster bus (before a first start)."""
        super().new_ports()
        self.bus_port = free_port()
        self.extra_args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                           "--cluster-port", str(self.bus_port), "--cluster-node-timeout", str(self.node_timeout_ms),
                           "--cluster-replica-validity-factor", "0"]  # fmt: skip
        if self.tls:
            self.extra_args += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        if self.password:
            self.extra_args += ["--masterauth", self.password]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each (see the module doc); ``start`` creates it, ``close`` ends it."""

    def __init__(self, binary: str, *, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 500,
                 password: str | None = None, tls: dict[str, str] | None = None) -> None:  # fmt: skip
        self.binary = binary
        self.replicas = replicas
        self.password = password
        self.tls = tls
        self.nodes = [ClusterNode(binary, node_timeout_ms=node_timeout_ms, password=password, tls=tls)
                      for _ in range(masters * (1 + replicas))]  # fmt: skip

    @property
    def url(self) -> str:
        """A ``redis-cluster://`` URL naming one node (the client finds the others)."""
        return f"{'rediss' if self.tls else 'redis'}-cluster://{self.nodes[0].address}"

    def _cli(self, *args: str, timeout: float = 60.0) -> str:
        cli = shutil.which("redis-cli") or str(self.binary).replace("redis-server", "redis-cli")
        opts = ["--tls", "--cacert", self.tls["ca"]] if self.tls else []
        opts += ["--no-auth-warning", "-a", self.password] if self.password else []
        proc = subprocess.run([cli, *opts, *args], capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode:
            raise RuntimeError(f"redis-cli {' '.join(args[:2])} failed: {proc.stdout[-1500:]} {proc.stderr[-1500:]}")
        return proc.stdout

    def start(self) -> None:
        """Start every node, join them into one cluster and wait until it serves every slot."""
        for node in self.nodes:
            node.start()
        self._cli("--cluster", "create", *(n.address for n in self.nodes), "--cluster-replicas", str(self.replicas),
                  "--cluster-yes")  # fmt: skip
        self.wait_ok()

    def info(self, node: ClusterNode, section: str = "cluster") -> dict[str, str]:
        """``CLUSTER INFO`` (or ``INFO <section>``) of ``node`` as a dict."""
        c = node.client(socket_timeout=1.0)
        try:
            text = c.execute_command("CLUSTER", "INFO") if section == "cluster" else c.execute_command("INFO", section)
        finally:
            c.close()
        if isinstance(text, dict):  # redis-py parses INFO itself
            return {k: str(v) for k, v in text.items()}
        text = text.decode() if isinstance(text, bytes) else str(text)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def roles(self) -> dict[str, str]:
        """``{address: "master" | "replica" | "fail"}`` as a live node sees them."""
        node = next(n for n in self.nodes if n.alive)
        c = node.client(socket_timeout=1.0)
        try:
            text = c.execute_command("CLUSTER", "NODES")
        finally:
            c.close()
        text = text.decode() if isinstance(text, bytes) else str(text)
        out = {}
        for line in text.splitlines():
            parts = line.split()
            address, flags = parts[1].split("@")[0], parts[2].split(",")
            out[address] = "fail" if "fail" in flags else "master" if "master" in flags else "replica"
        return out

    def masters(self) -> list[ClusterNode]:
        roles = self.roles()
        return [n for n in self.nodes if roles.get(n.address) == "master" and n.alive]

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports ``cluster_state:ok`` with every slot served and every live replica has
        synced with its master (after a create or a failover)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                infos = [self.info(n) for n in self.nodes if n.alive]
                links = [self.info(n, "replication") for n in self.nodes if n.alive]
                if all(i.get("cluster_state") == "ok" and i.get("cluster_slots_ok") == str(SLOTS) for i in infos) and all(
                    r.get("role") != "slave" or r.get("master_link_status") == "up" for r in links
                ):
                    return
            except Exception:  # noqa: BLE001  (a node still starting: ask again)
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not reach state ok in {timeout} s")
            time.sleep(0.05)

    def kill_master(self) -> ClusterNode:
        """SIGKILL a master (the first one), as in a crash; returns it (``wait_failover`` waits for its replica)."""
        node = self.masters()[0]
        node.stop(kill=True)
        return node

    def wait_failover(self, dead: ClusterNode, timeout: float = 30.0) -> None:
        """Until the live nodes have marked ``dead`` failed and a replica serves its slots."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.roles().get(dead.address) == "fail":
                    break
            except Exception:  # noqa: BLE001
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{dead.address} was not marked failed in {timeout} s")
            time.sleep(0.05)
        self.wait_ok(max(0.1, deadline - time.monotonic()))

    def close(self) -> None:
        for node in self.nodes:
            node.close()


@contextmanager
def running_redis_cluster(binary: str | None = None, **kwargs: Any) -> Iterator[LocalCluster]:
    """A started :class:`LocalCluster` (options as its constructor's), closed on exit."""
    binary = binary or find_redis_server()
    if binary is None:
        raise RuntimeError(f"redis-server not found on PATH ({INSTALL_HINT})")
    cluster = LocalCluster(binary, **kwargs)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
