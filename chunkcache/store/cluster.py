"""Cluster mode of the remote tier: entries spread over the primaries of a Valkey or Redis Cluster.

`store.remote_url: redis+cluster://[[user]:password@]host:port[,host:port...]` (`rediss+cluster://` with TLS): the
hosts are seeds, any one answering is enough to find the others; a cluster has database 0 only.

Contract (remote.py's, with each primary in the place of the one server, and):
- An entry's key is `cc:v1:{fingerprint}:{<chunk key>}`: the braces make the chunk key its hash tag, so every key of
  an entry lives on the slot of its chunk key, and chunk keys (content hashes) spread entries evenly over the slots
  and so over the primaries.
- The slot map is redis-py's (RedisCluster), read from the seeds on first use (a seed that does not answer is passed
  over). get_many groups a request's keys by the primary holding their slot and sends each primary one pipeline of
  GETs (keys of different slots cannot share an MGET), the pipelines in parallel: one round trip per node touched,
  the request waiting for the slowest. A MOVED reply moves the slot in the map and the key is asked again of the
  node named; an ASK reply asks the node named once, with ASKING; a key still redirected after REDIRECTS rounds is
  a miss.
- Each primary has its own breaker and counters (endpoint.py; `RemoteStats.nodes`): a node down or stalled costs its
  own keys (not found: at most one timeout, then skipped for `retry_s`) and the puts bound for it, never another node's
  keys, never an exception.
- Topology: a command failing on a node, or a command due to retry a node still down, makes a background thread read
  the slot map again (CLUSTER SLOTS from a node that answers); no request waits for it. So after a replica is
  promoted in place of a failed primary, gets and puts reach it from the first request after that read, without a
  restart; entries the replica had not received (replication is asynchronous) are misses.
- Fetch or compute (remote.py) is decided per primary: each node's link is measured on its own pipelines.
- Puts go through RedisCluster: one SET (NX but for an entry grown by features, sealed with the key name as the
  primary stores it, braces included: remote.py), MOVED and ASK followed (at most 16 redirections), no retry after a
  connection error (which also makes it read the slot map again).
- A purge (remote.py) searches each primary of the slot map with a client of its own (SCAN sees one node's keys);
  a primary that cannot be reached, or a slot migrating meanwhile, fails it (purge again).
- No seed answering is an outage of the cluster as a whole, on the seeds' own breaker: for `retry_s` every get
  misses and every put is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, MovedError, RedisClusterException, SlotNotCoveredError
from redis.retry import Retry

from .endpoint import Endpoint, NodeStats
from .remote import RemoteTier

log = logging.getLogger("chunkcache.store.remote")

SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}  # cluster URL scheme -> its nodes' scheme
REDIRECTS = 2  # rounds after the first in which a get follows MOVED and ASK replies
NODE_THREADS = 16  # per-node pipelines of one get_many sent at once


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0] in SCHEMES


def seeds(url: str) -> list[tuple[str, int]]:
    """The (host, port) seeds of a cluster URL; ValueError if one is not host:port."""
    found = []
    for seed in urlsplit(url).netloc.rpartition("@")[2].split(","):
        host, colon, port = seed.rpartition(":")
        if not (host and colon and port.isdigit()):
            raise ValueError(f"cluster seed {seed!r} is not host:port")
        found.append((host.strip("[]"), int(port)))
    return found


def redacted_cluster(url: str) -> str:
    return f"{urlsplit(url).scheme}://" + ",".join(f"{host}:{port}" for host, port in seeds(url))


class ClusterTier(RemoteTier):
    def _open(self, url: str, timeout_s: float) -> None:
        self.server = redacted_cluster(url)
        parts = urlsplit(url)
        auth, _, hosts = parts.netloc.rpartition("@")
        # the first seed as a node URL (credentials and options such as TLS certificates with it), the others bare
        first = hosts.split(",")[0]
        self._seed_url = urlunsplit((SCHEMES[parts.scheme], f"{auth}@{first}" if auth else first, parts.path,
                                     parts.query, ""))
        self._other_seeds = [ClusterNode(host, port) for host, port in seeds(url)[1:]]
        self._timeout_s = timeout_s
        self._seeds = Endpoint(self.server, self.retry_s)
        self._nodes: dict[str, Endpoint] = {}  # by node name, host:port; kept after a node leaves the map
        self._cluster: RedisCluster | None = None
        self._discovery = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=NODE_THREADS, thread_name_prefix="chunkcache-remote-node")
        self._refresh = threading.Event()
        threading.Thread(target=self._refresh_loop, name="chunkcache-remote-topology", daemon=True).start()

    def _name(self, key: str) -> str:
        return f"{self.prefix}{{{key}}}"

    def _discovered(self) -> RedisCluster | None:
        """The cluster client, its slot map read from the seeds on first use; None while no seed answers."""
        if self._cluster is not None:
            return self._cluster
        with self._discovery:
            if self._cluster is None and self._seeds.available():
                try:
                    # No retries (as for one endpoint): a node that fails costs one command, and its breaker decides.
                    self._cluster = RedisCluster(
                        url=self._seed_url, startup_nodes=list(self._other_seeds), require_full_coverage=False,
                        socket_timeout=self._timeout_s, socket_connect_timeout=self._timeout_s,
                        retry=Retry(NoBackoff(), 0))
                except (redis.RedisError, RedisClusterException) as e:
                    self._seeds.failed(e)
                    return None
                self._seeds.working()
        return self._cluster

    def _endpoint(self, node: str) -> Endpoint:
        with self._lock:
            endpoint = self._nodes.get(node)
            if endpoint is None:
                endpoint = self._nodes[node] = Endpoint(node, self.retry_s, label=f"{self.server} node {node}")
            return endpoint

    def _primary(self, cluster: RedisCluster, name: str) -> ClusterNode | None:
        """The node holding `name`'s slot in the map; None (and the map read again) if no node serves it."""
        try:
            return cluster.nodes_manager.get_node_from_slot(cluster.keyslot(name))
        except SlotNotCoveredError:
            self._refresh.set()
            return None

    def _reachable(self, node: ClusterNode) -> bool:
        """Whether a command may go to the node now; False (counted as skipped) while its breaker is open."""
        endpoint = self._endpoint(node.name)
        if endpoint.retrying():  # still down where the map says; it may have been failed over meanwhile
            self._refresh.set()
        if endpoint.available():
            return True
        endpoint.count("skipped")
        return False

    def _fetch(self, names: list[str]) -> list[tuple[Endpoint, dict[str, bytes | None]]]:
        cluster = self._discovered()
        if cluster is None:
            self._seeds.count("skipped", len(names))
            return []
        answered = []
        asks: dict[str, ClusterNode | None] = dict.fromkeys(names)  # name -> node to ask with ASKING, None: its slot's
        for _ in range(1 + REDIRECTS):
            batches: dict[ClusterNode, list[tuple[str, bool]]] = {}
            for name, target in asks.items():
                node = target or self._primary(cluster, name)
                if node is None:
                    self._seeds.count("skipped")
                elif self._reachable(node):
                    batches.setdefault(node, []).append((name, target is not None))
            asks = {}
            for node, replies in self._send(cluster, batches):
                endpoint = self._endpoint(node.name)
                if isinstance(replies, redis.RedisError):
                    endpoint.failed(replies)
                    self._refresh.set()
                    continue
                values, failure = {}, None
                for (name, _), reply in zip(batches[node], replies):
                    if isinstance(reply, MovedError):  # a subclass of AskError: first
                        self._moved(cluster, reply)
                        asks[name] = None
                    elif isinstance(reply, AskError):
                        asks[name] = cluster.get_node(reply.host, reply.port) or ClusterNode(reply.host, reply.port)
                    elif isinstance(reply, redis.RedisError):  # CLUSTERDOWN, LOADING, ...: a failing node
                        failure = failure or reply
                    else:
                        values[name] = reply
                if failure is None:
                    endpoint.working()
                else:
                    endpoint.failed(failure)
                    self._refresh.set()
                answered.append((endpoint, values))
            if not asks:
                break
        else:  # redirected round after round: the map is far behind; those keys are not asked again
            self._seeds.count("skipped", len(asks))
            self._refresh.set()
        return answered

    def _moved(self, cluster: RedisCluster, reply: MovedError) -> None:
        """Move the slot to the node a MOVED reply names, in the map the next command routes by."""
        try:
            cluster.nodes_manager.move_slot(reply)
        except KeyError:  # a refresh meanwhile found no node serving the slot: the next refresh decides
            self._refresh.set()

    def _send(self, cluster: RedisCluster, batches: dict[ClusterNode, list[tuple[str, bool]]]
              ) -> list[tuple[ClusterNode, list[Any] | redis.RedisError]]:
        """Each node's batch as one pipeline, all at once: its replies (an error reply in place), or the error that
        failed the whole pipeline (connection refused or reset, timeout). A pipeline answered is one round trip of
        the node's link (its bytes and seconds)."""
        def run(item: tuple[ClusterNode, list[tuple[str, bool]]]) -> tuple[ClusterNode, list[Any] | redis.RedisError]:
            node, batch = item
            t = time.perf_counter()
            try:
                pipe = cluster.get_redis_connection(node).pipeline(transaction=False)
                for name, asking in batch:
                    if asking:
                        pipe.execute_command("ASKING")
                    pipe.get(name)
                replies = pipe.execute(raise_on_error=False)
            except redis.RedisError as e:
                return node, e
            self._endpoint(node.name).link.observe(sum(len(r) for r in replies if isinstance(r, bytes)),
                                                   time.perf_counter() - t)
            is_get = [flag for _, asking in batch for flag in ((False, True) if asking else (True,))]  # not ASKING's
            return node, [reply for reply, get in zip(replies, is_get) if get]

        items = list(batches.items())
        if len(items) == 1:
            return [run(items[0])]
        return list(self._pool.map(run, items))

    def _route(self, name: str) -> Endpoint | None:
        cluster = self._cluster
        if cluster is None:
            return None if self._seeds.available() else self._seeds
        node = self._primary(cluster, name)
        return self._endpoint(node.name) if node is not None else None

    def _connect(self, name: str) -> tuple[Endpoint, Any]:
        cluster = self._discovered()
        node = self._primary(cluster, name) if cluster is not None else None
        if node is None:
            return self._seeds, None
        endpoint = self._endpoint(node.name)
        if endpoint.retrying():
            self._refresh.set()
        return endpoint, cluster if endpoint.available() else None

    def _server_limit(self, client: Any, name: str) -> int:
        node = self._primary(client, name)
        return int(client.config_get("proto-max-bulk-len", target_nodes=node)["proto-max-bulk-len"])

    def _servers(self) -> list[Any]:
        cluster = self._discovered()
        if cluster is None:
            raise redis.ConnectionError(f"no seed of {self.server} answers")
        return [cluster.get_redis_connection(node) for node in cluster.get_primaries()]

    def _serving(self) -> set[str]:
        cluster = self._cluster
        return {node.name for node in cluster.get_primaries()} if cluster is not None else set()

    def _endpoints(self) -> list[Endpoint]:
        with self._lock:
            return [self._seeds, *self._nodes.values()]

    def _up(self) -> bool:
        return self._seeds.up and all(self._endpoint(node).up for node in self._serving())

    def _link(self) -> None:
        return None  # per node, in _node_stats

    def _node_stats(self) -> tuple[NodeStats, ...]:
        serving = self._serving()
        for node in serving:
            self._endpoint(node)  # a primary not asked yet is listed too
        with self._lock:
            nodes = sorted(self._nodes.items())
        return tuple(endpoint.stats(serving=name in serving) for name, endpoint in nodes)

    def _refresh_loop(self) -> None:
        while True:
            self._refresh.wait()
            self._refresh.clear()
            cluster = self._cluster
            if cluster is None:
                continue
            try:
                cluster.nodes_manager.initialize()
            except (redis.RedisError, RedisClusterException) as e:  # every node down: the next failure asks again
                log.debug("chunkcache: reading the slot map of %s failed: %s: %s", self.server, type(e).__name__, e)
