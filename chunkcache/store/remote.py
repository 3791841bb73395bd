"""Remote tier: entries in a Redis-protocol server (Valkey, Redis) that every chunkcache server shares.

Contract:
- One key per entry, `cc:v1:{model fingerprint}:{chunk key}` (on a cluster the chunk key is a hash tag,
  `{chunk key}`: cluster.py). Its value is `VALUE_TAG | MAC | encoding`: the 4-byte tag `CCA1` (this layout's
  version), then HMAC-SHA256 under the fleet's secret (`store.remote_secret_env`, StoreConfig.remote_secret) over the
  tag, the key name (length-prefixed) and the encoding, then the checksummed wire format (`wire.encode`;
  K and V compressed when `codec` is given, `store.compress`; its header carries the entry's tenant and context
  digests, from which decode recomputes the key). The chunk key hashes the model, the tenant, the context and the
  tokens, so tenants and models never share an entry across servers; the fingerprint in the name lets an operator
  find or drop one model's entries (`SCAN MATCH cc:v1:{fingerprint}:*`). `v1` names the key space, not the
  encoding: a value's header says whether it is compressed, and every server reads both, whatever its own
  `store.compress` (a server older than compression counts a compressed value as corrupt: a miss, and deletes it).
  Values are authenticated, not encrypted.
- get and get_many are one MGET (get_many: all of a request's keys; on a cluster, one pipeline per node). A value
  whose MAC does not verify (none, as a server older than authentication writes; another secret's; a byte altered;
  a value copied under another key name; anything planted by a client without the secret) is a miss, counted in
  `forged`, never decoded. An authentic value that fails the encoding's own checks (checksum, its key against its
  header's digests and tokens, the key it was asked for) or does not fit the serving model (`layout`: fingerprint,
  layers, KV heads, head_dim) is a miss counted in `corrupt`. Either is deleted, so that the next put can store a
  good one. get never raises.
- put never blocks and never raises: the entry as it is at the put (its feature dict copied: a selector may add
  features to it while the writer encodes) is queued for one writer thread, which encodes and seals it and stores it
  with SET NX: where the key already holds a value the put changes nothing (`already_stored`). Every writer computes
  the same bits for a key (entry.py's invariant; the value differs only by the writer's `store.compress`), so the
  first writer's value is the one every other would write; no server missing an entry overwrites the fleet's copy
  with its own. A put that follows a get which found a value
  failing verification stores its entry, since that value was deleted. One that follows a value the blend refused
  after it verified (an authentic value holding other tokens than its chunk: only a holder of the secret can write
  one) does not replace it: every server that fetches it computes the chunk again. The one put that replaces is
  the entry grown by selector features (ChunkStore.add_features: `put(..., replace_value=True)`, a plain SET, sealed
  like any other): servers adding different features race, the last write wins, and a feature it lacks is
  recomputed by the next server that asks for it; its K and V are this server's copy, the same bits by the
  invariant. A put finding the queue full is dropped
  (`dropped`). An encoding larger than the server accepts (`max_value_bytes`, lowered to the server's
  `proto-max-bulk-len` when `CONFIG GET` answers) is not sent (`oversize`); where CONFIG is renamed away, a value
  over the server's limit is refused by the server, as `oversize` when its reply arrives or, when it resets the
  connection mid-send, as an outage. A server refusing writes because it is
  full (maxmemory with `noeviction`: OutOfMemoryError) costs only the put (`full`, logged once until a write
  succeeds). No TTL: eviction is the server's (`maxmemory-policy allkeys-lru`).
- A down or stalled server costs one command at most `timeout_s` (connect and each socket read or write; no
  retries). Any other failure opens the server's breaker (endpoint.py): for `retry_s` every get is a miss and every
  put is dropped without touching the network (`skipped`), then the next command tries again. `errors` counts failed
  commands, `outages` the outages; one WARNING when an outage starts and one INFO when it ends, whatever the request
  rate.
- Fetch or compute (`fetch`, `store.remote_fetch`): "always" asks the servers for every key the local tiers lack;
  "never" asks for none (the tier is written, not read); "auto" asks `choose` first, which keeps per server only the
  keys whose fetch and decode are predicted faster than computing them here (link.py's rule, from each server's
  measured round trips, the bytes per token of the entries fetched so far, and the seconds per byte their decoding
  took: a compressed entry's dequantisation can cost more than its transfer; a key without a compute cost, or before
  anything was measured, is fetched). Keys not asked count in `computed_instead`, probes of a link judged slow in
  `probes`.
- Thread-safe (redis-py's client keeps a connection pool; the counters are locked): the scheduler reads while the
  writer thread writes.
- purge(tenant) deletes the values of every model's entries of one tenant (its digest does not depend on the model),
  found without reading any KV: SCAN MATCH over the key space on each server (each primary of a cluster), then the
  header at the start of each value (GETRANGE of its first HEADER_PEEK bytes, the whole header when it is longer),
  whose `tenant` names the entry's. A value whose header claims the tenant is deleted whether or not it is authentic
  (deleting is never wrong: a miss); an authentic value of the tenant always says so (decode recomputes the key from
  the header's tenant). Puts of the tenant's entries made before the purge and still queued are not written, and a
  write under way finishes before the search. It costs one round trip per page of PURGE_PAGE keys per server,
  whatever the values' size; an error (a server down, a slot moving) raises, and whatever it deleted stays deleted.
- How keys reach servers is the subclass's: this class speaks to one endpoint (one MGET per get_many); cluster.py's
  to the primaries of a cluster, with a breaker per node.
- What whoever administers (or can write to) the Valkey server can still do, the secret not known: delete or evict
  entries, flush the store, fill it or stop it (misses: each chunk computed again, never a wrong answer); read every
  tenant's KV, token ids and selector features (values are not encrypted; keep the store on a private network, with
  AUTH and TLS); replay an older authentic value of the same key name, which by the invariant holds the same K, V
  and tokens (up to its writer's `store.compress`), so it matters little: only its selector features may be older or
  fewer (recomputed when asked for). Planting, altering or moving a value is a counted miss. A holder of the secret
  (any server of the fleet) can write anything under any key: the secret is the trust boundary, as the invariant
  holds only for servers that keep it.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import queue
import struct
import threading
import time
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..config import REMOTE_SECRET_MIN_BYTES
from .codec import Codec
from .endpoint import Endpoint, NodeStats
from .entry import ChunkEntry, EntryLayout
from .link import LinkEstimate, worth_fetching
from .wire import HEAD, CorruptEntry, decode, encode, header_length, read_header

log = logging.getLogger(__name__)

FETCH = ("auto", "always", "never")  # store.remote_fetch
KEY_SPACE = "cc:v1"  # the servers' key names, shared by both wire format versions (above)
VALUE_TAG = b"CCA1"  # an authenticated value's prefix, version 1: HMAC-SHA256 over the tag, key name and encoding
MAC_BYTES = 32
SEALED = len(VALUE_TAG) + MAC_BYTES  # bytes before the wire encoding in a value
PURGE_PAGE = 512  # keys a purge asks per SCAN page, their headers read in one pipeline
HEADER_PEEK = 1024  # bytes of a value's header a purge reads first: a typical header is ~400-600


class Forged(ValueError):
    """A value that is not what a server holding the secret wrote under this key name."""


@dataclass(frozen=True)
class RemoteStats:
    server: str  # scheme://host:port/db (a cluster: scheme://host:port,... of its seeds), password left out
    up: bool  # False while an outage is in progress (in cluster mode: of any node serving slots)
    hits: int
    misses: int  # the server had no value for the key
    corrupt: int  # values that failed verification (authentic but unreadable, or not fitting the model; counted
    # misses, deleted)
    errors: int  # commands that failed (connection refused or reset, timeout, auth, ...)
    outages: int  # times the tier (in cluster mode: a node) went from working to failing
    skipped: int  # gets and puts not sent because an outage was in progress
    writes: int  # entries stored
    bytes_written: int
    oversize: int  # entries larger than the server accepts, not sent
    full: int  # writes the server refused because it was full
    dropped: int  # puts dropped because the writer's queue was full
    pending: int  # puts queued or being written
    forged: int = 0  # values without a valid authenticator (other secret, altered, moved, planted; counted misses,
    # deleted)
    already_stored: int = 0  # puts of a new entry that found its key already holding a value (SET NX: kept)
    computed_instead: int = 0  # keys not fetched: computing them was predicted faster (fetch "auto") or "never"
    probes: int = 0  # fetches from a link judged too slow, to measure it again
    bytes_per_token: float | None = None  # of the entries fetched so far (what a fetch is predicted to carry)
    decode_s_per_mb: float | None = None  # decoding them (verify, dequantise) per MB fetched, moving average
    link: LinkEstimate | None = None  # one endpoint's measured gets (cluster mode: per node, in `nodes`)
    nodes: tuple[NodeStats, ...] = ()  # cluster mode: each primary seen since the start; empty for one endpoint


def key_prefix(model_fingerprint: str | None) -> str:
    return f"{KEY_SPACE}:{model_fingerprint or 'any'}:"


def redacted(url: str) -> str:
    u = urlsplit(url)
    return f"{u.scheme}://{u.hostname}:{u.port or 6379}{u.path or '/0'}"


def _mac(secret: bytes, name: str, data: bytes | memoryview) -> bytes:
    h = hmac.new(secret, VALUE_TAG, hashlib.sha256)
    encoded = name.encode()
    h.update(struct.pack("<Q", len(encoded)))  # length-prefixed: no name and encoding run into another pair
    h.update(encoded)
    h.update(data)
    return h.digest()


def seal(secret: bytes, name: str, data: bytes) -> bytes:
    """The value stored under the key `name` for the wire encoding `data`: VALUE_TAG | MAC | data."""
    return b"".join((VALUE_TAG, _mac(secret, name, data), data))


def unseal(secret: bytes, name: str, value: bytes) -> memoryview:
    """The wire encoding inside `value` (a view, not a copy), if `value` is what `seal` makes of it under `name`;
    Forged otherwise."""
    if len(value) < SEALED or value[: len(VALUE_TAG)] != VALUE_TAG:
        raise Forged(f"no authenticator (a value of {len(value)} bytes not starting {VALUE_TAG!r})")
    data = memoryview(value)[SEALED:]
    if not hmac.compare_digest(value[len(VALUE_TAG):SEALED], _mac(secret, name, data)):
        raise Forged("authenticator mismatch: written with another secret or under another key name, or altered")
    return data


class RemoteTier:
    def __init__(self, url: str, prefix: str, timeout_s: float, retry_s: float, max_value_bytes: int, write_queue: int,
                 layout: EntryLayout | None = None, codec: Codec | None = None, fetch: str = "always",
                 probe_s: float = 30.0, *, secret: bytes):
        """`secret`: the fleet's HMAC key (StoreConfig.remote_secret) every value is sealed and checked with."""
        if fetch not in FETCH:
            raise ValueError(f"fetch must be one of {FETCH}, got {fetch!r}")
        if len(secret) < REMOTE_SECRET_MIN_BYTES:
            raise ValueError(f"the remote tier's secret must be at least {REMOTE_SECRET_MIN_BYTES} bytes")
        self._secret = bytes(secret)
        self.fetch, self.probe_s = fetch, probe_s
        self._bytes_per_token: float | None = None
        self._decode_s_per_byte: float | None = None
        self.prefix = prefix
        self.layout = layout
        self.codec = codec
        self.retry_s = retry_s
        self.max_value_bytes = max_value_bytes
        self._limit_known = False  # max_value_bytes not yet lowered to the server's own limit
        self._lock = threading.Lock()
        self._full = False
        self._oversize_logged = False
        self._n = dict.fromkeys(("corrupt", "forged", "already_stored", "bytes_written", "oversize", "full",
                                 "dropped", "pending", "computed_instead", "probes"), 0)
        self._open(url, timeout_s)
        # (entry, replace_value, its place in the order of puts and purges)
        self._queue: queue.Queue[tuple[ChunkEntry, bool, int]] = queue.Queue(maxsize=write_queue)
        self._order = itertools.count()
        self._purged: dict[str, int] = {}  # tenant -> the place of its last purge: puts before it are not written
        self._writing = threading.Lock()  # held by the writer for one write, by a purge for its whole search
        threading.Thread(target=self._write_loop, name="chunkcache-remote-writer", daemon=True).start()

    # --- how keys reach the server: one endpoint here, overridden by the cluster tier ---------------------------

    def _open(self, url: str, timeout_s: float) -> None:
        # No retries: redis-py's default (10, with backoff) turns a down server into ~2.6 s per command.
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 0))
        self.server = redacted(url)
        self._endpoint = Endpoint(self.server, self.retry_s)

    def _name(self, key: str) -> str:
        """The server-side key of an entry."""
        return self.prefix + key

    def _fetch(self, names: list[str]) -> list[tuple[Endpoint, dict[str, bytes | None]]]:
        """What each server answered for `names` (None: no value). Names a server was not asked (down) or did not
        answer (failing) are left out, and counted as skipped or errors on it."""
        if not self._endpoint.available():
            self._endpoint.count("skipped", len(names))
            return []
        t = time.perf_counter()
        try:
            values = self.client.mget(names)
        except redis.RedisError as e:
            self._endpoint.failed(e)
            return []
        self._endpoint.link.observe(sum(len(v) for v in values if v), time.perf_counter() - t)
        self._endpoint.working()
        return [(self._endpoint, dict(zip(names, values)))]

    def _route(self, name: str) -> Endpoint | None:
        """The endpoint of the server holding `name`, if known without a round trip."""
        return self._endpoint

    def _connect(self, name: str) -> tuple[Endpoint, Any]:
        """The endpoint of the server holding `name` and a client whose single-key commands reach it; the client is
        None when that server is down (breaker open) or cannot be reached (counted as a failure)."""
        return self._endpoint, self.client if self._endpoint.available() else None

    def _server_limit(self, client: Any, name: str) -> int:
        """The proto-max-bulk-len of the server holding `name`."""
        return int(client.config_get("proto-max-bulk-len")["proto-max-bulk-len"])

    def _endpoints(self) -> list[Endpoint]:
        """Every endpoint whose counters make the tier's totals."""
        return [self._endpoint]

    def _servers(self) -> list[Any]:
        """A client of each server holding entries (a purge searches each)."""
        return [self.client]

    def _up(self) -> bool:
        return self._endpoint.up

    def _node_stats(self) -> tuple[NodeStats, ...]:
        return ()

    def _link(self) -> LinkEstimate | None:
        return self._endpoint.link.estimate()

    # --- the tier ----------------------------------------------------------------------------------------------

    def get(self, key: str) -> ChunkEntry | None:
        return self.get_many([key]).get(key)

    def get_many(self, keys: list[str]) -> dict[str, ChunkEntry]:
        """The entries the servers hold for `keys`, in one round trip per server; the others are misses."""
        if not keys:
            return {}
        names = {self._name(key): key for key in keys}
        found = {}
        for endpoint, values in self._fetch(list(names)):
            for name, data in values.items():
                key = names[name]
                if data is None:
                    endpoint.count("misses")
                    continue
                t = time.perf_counter()
                if (entry := self._verified(key, name, data)) is not None:
                    endpoint.count("hits")
                    found[key] = entry
                    self._measured(len(data), entry.num_tokens, time.perf_counter() - t)
        return found

    def choose(self, costs: dict[str, tuple[int, float | None]]) -> list[str]:
        """The keys of `costs` (key -> (its tokens, seconds to compute it here; None: unknown)) to ask the servers
        for, by the tier's `fetch` rule (contract above); the others are counted computed_instead."""
        if self.fetch != "auto":
            self._count("computed_instead", len(costs) if self.fetch == "never" else 0)
            return [] if self.fetch == "never" else list(costs)
        asked: list[str] = []
        per_node: dict[Endpoint, list[tuple[str, int, float]]] = {}
        with self._lock:
            per_token, decode_per_byte = self._bytes_per_token, self._decode_s_per_byte
        for key, (tokens, compute_s) in costs.items():
            endpoint = self._route(self._name(key))
            if endpoint is None or compute_s is None or per_token is None:
                asked.append(key)
            else:
                nbytes = int(tokens * per_token)
                # the link must deliver the chunk in what computing it would take, less decoding it here
                per_node.setdefault(endpoint, []).append((key, nbytes, compute_s - nbytes * decode_per_byte))
        for endpoint, chunks in per_node.items():
            keys, probe = worth_fetching(endpoint.link, chunks, self.probe_s)
            asked += keys
            self._count("probes", int(probe))
        self._count("computed_instead", len(costs) - len(asked))
        return asked

    def _measured(self, nbytes: int, tokens: int, decode_s: float) -> None:
        """One fetched entry's size and decoding time: the bytes per token a fetch is predicted to carry and the
        seconds per byte its decoding costs follow them (moving averages)."""
        per_token, per_byte = nbytes / max(tokens, 1), decode_s / max(nbytes, 1)
        with self._lock:
            old = self._bytes_per_token
            self._bytes_per_token = per_token if old is None else 0.8 * old + 0.2 * per_token
            old = self._decode_s_per_byte
            self._decode_s_per_byte = per_byte if old is None else 0.8 * old + 0.2 * per_byte

    def _verified(self, key: str, name: str, value: bytes) -> ChunkEntry | None:
        try:
            data = unseal(self._secret, name, value)
            entry = decode(bytearray(data))  # one copy, which the entry's tensors share
            if entry.key != key:
                raise CorruptEntry(f"value holds key {entry.key}")
            if self.layout is not None:
                self.layout.check(entry)
        except Forged as e:
            self._count("forged")
            log.warning("chunkcache: dropping unauthenticated value %s from remote store %s: %s", name, self.server, e)
            self._delete(name)
            return None
        except ValueError as e:  # CorruptEntry, FingerprintMismatch and a layout misfit are ValueErrors
            self._count("corrupt")
            log.warning("chunkcache: dropping corrupt or unusable entry %s from remote store %s: %s: %s", name,
                        self.server, type(e).__name__, e)
            self._delete(name)
            return None
        return entry

    def _delete(self, name: str) -> None:
        """Remove a value that failed verification, so that the next put (SET NX) can store a good one."""
        endpoint, client = self._connect(name)
        if client is not None:
            try:
                client.delete(name)
            except redis.RedisError as exc:
                endpoint.failed(exc)

    def put(self, entry: ChunkEntry, replace_value: bool = False) -> bool:
        """Queue `entry` for the writer: stored only where its key holds no value (SET NX), or, with
        `replace_value` (the entry grown by selector features), over whatever the key holds (contract above). False
        if dropped instead: its server's breaker is open (`skipped`) or the queue is full (`dropped`)."""
        endpoint = self._route(self._name(entry.key))
        if endpoint is not None and not endpoint.available():
            endpoint.count("skipped")
            return False
        with self._lock:
            try:
                copy = replace(entry, features=dict(entry.features))
                self._queue.put_nowait((copy, replace_value, next(self._order)))
            except queue.Full:
                self._n["dropped"] += 1
                return False
            self._n["pending"] += 1
        return True

    def stats(self) -> RemoteStats:
        totals = dict.fromkeys(Endpoint.COUNTERS, 0)
        for endpoint in self._endpoints():
            for field, n in endpoint.counters().items():
                totals[field] += n
        nodes, up, link = self._node_stats(), self._up(), self._link()
        with self._lock:
            decode = None if self._decode_s_per_byte is None else self._decode_s_per_byte * 1e6
            return RemoteStats(server=self.server, up=up, **totals, **self._n, bytes_per_token=self._bytes_per_token,
                               decode_s_per_mb=decode, link=link, nodes=nodes)

    def purge(self, tenant: str) -> int:
        """Delete every value whose entry is `tenant`'s, of every model, and say how many (contract above); raises
        redis.RedisError when a server cannot be searched."""
        with self._lock:
            self._purged[tenant] = next(self._order)
        with self._writing:
            return sum(self._purge_on(client, tenant) for client in self._servers())

    def _purge_on(self, client: Any, tenant: str) -> int:
        deleted, page = 0, []
        for name in client.scan_iter(match=f"{KEY_SPACE}:*", count=PURGE_PAGE):
            page.append(name)
            if len(page) == PURGE_PAGE:
                deleted += self._purge_page(client, page, tenant)
                page = []
        return deleted + (self._purge_page(client, page, tenant) if page else 0)

    def _purge_page(self, client: Any, names: list[bytes], tenant: str) -> int:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.getrange(name, 0, SEALED + HEAD + HEADER_PEEK - 1)
        doomed = [name for name, head in zip(names, pipe.execute()) if self._tenant_of(client, name, head) == tenant]
        if not doomed:
            return 0
        pipe = client.pipeline(transaction=False)
        for name in doomed:
            pipe.delete(name)
        return sum(pipe.execute())

    @staticmethod
    def _tenant_of(client: Any, name: bytes, head: bytes) -> str | None:
        """The tenant the header at the start of the value under `name` names (`head`: the value's first bytes);
        None for a value that is no entry (or is gone)."""
        at = SEALED if head[: len(VALUE_TAG)] == VALUE_TAG else 0  # a value without the seal is judged by its header
        try:
            end = at + HEAD + header_length(head[at:])
            if end > len(head):  # a header longer than the peek
                head = client.getrange(name, 0, end - 1)
            return read_header(head[at:]).get("tenant")
        except CorruptEntry:
            return None

    def _write_loop(self) -> None:
        while True:
            entry, replace_value, order = self._queue.get()
            try:
                with self._writing:
                    with self._lock:
                        purged = order < self._purged.get(entry.tenant, -1)
                    if not purged:
                        self._write(entry, replace_value)
            except Exception:  # noqa: BLE001 - the writer must outlive any one entry (e.g. an encoding bug)
                log.exception("chunkcache: remote put of %s failed", entry.key)
            finally:
                self._count("pending", -1)

    def _write(self, entry: ChunkEntry, replace_value: bool) -> None:
        name = self._name(entry.key)
        endpoint, client = self._connect(name)
        if client is None:
            endpoint.count("skipped")
            return
        data = seal(self._secret, name, encode(entry, self.codec))
        try:
            if len(data) > self._value_limit(client, name):
                self._oversize(entry.key, len(data))
                return
            # SET NX: a new entry never overwrites (every writer computes the same bits for a key, entry.py); the
            # entry grown by features replaces (contract above). NX answers None where the key holds a value.
            stored = client.set(name, data, nx=not replace_value)
        except redis.OutOfMemoryError as e:
            self._count("full")
            if not self._full:
                self._full = True
                log.warning("chunkcache: remote store %s is full, puts dropped until it takes writes again: %s",
                            endpoint.label, e)
            return
        except redis.ResponseError as e:
            if "bulk length" not in str(e):  # any other refusal is a failing server
                endpoint.failed(e)
                return
            # the server's limit is below ours and CONFIG GET did not tell (e.g. CONFIG renamed by the operator);
            # when the server resets the connection before its reply is read, the RedisError branch below counts it
            self._oversize(entry.key, len(data))
            return
        except redis.RedisError as e:
            endpoint.failed(e)
            return
        endpoint.working()
        if not stored:
            self._count("already_stored")
            return
        endpoint.count("writes")
        if self._full:
            self._full = False
            log.info("chunkcache: remote store %s takes writes again", endpoint.label)
        self._count("bytes_written", len(data))

    def _value_limit(self, client: Any, name: str) -> int:
        """max_value_bytes, lowered once to the server's proto-max-bulk-len: a bigger value is refused, and one much
        bigger has its connection reset only after being sent in full."""
        if not self._limit_known:
            try:
                self.max_value_bytes = min(self.max_value_bytes, self._server_limit(client, name))
            except (redis.ResponseError, KeyError):  # CONFIG disabled or renamed (managed services): keep ours
                pass
            self._limit_known = True
        return self.max_value_bytes

    def _oversize(self, key: str, size: int) -> None:
        self._count("oversize")
        if not self._oversize_logged:
            self._oversize_logged = True
            log.warning("chunkcache: entry %s is %d bytes, more than remote store %s accepts (%d); such entries stay "
                        "local (chunkcache_remote_skipped{reason=\"oversize\"} counts them)", key, size, self.server,
                        self.max_value_bytes)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._n[name] += n
