"""The shared tier's authenticated values against a real Valkey server (tests/store_server.py): every value is
VALUE_TAG | HMAC-SHA256(secret, tag, key name, encoding) | encoding (chunkcache/store/remote.py). A value written
with another secret, planted without one, altered or moved under another key name is a counted miss (`forged`),
never served, and deleted; a new entry is written with SET NX (a second writer changes nothing), and only the entry
grown by selector features replaces a value; a remote tier without a secret refuses to start."""

import dataclasses
import logging

import pytest
import torch
from store_server import SECRET, StoreServer, store_secret  # noqa: F401 - store_secret is an autouse fixture
from test_store import FP, assert_same, key, make_entry
from test_store_remote import drain, remote_store, sealed, stored

from chunkcache.config import REMOTE_SECRET_ENV, Config, ConfigError, StoreConfig
from chunkcache.hashing import chunk_key, prefix_key, tenant_key
from chunkcache.store import ChunkEntry, ChunkStore
from chunkcache.store.remote import MAC_BYTES, VALUE_TAG, key_prefix
from chunkcache.store.wire import encode

OTHER_SECRET = "another-fleets-secret-0123456789"


@pytest.fixture
def valkey(tmp_path):
    srv = StoreServer(tmp_path)
    yield srv
    srv.kill()


def entry(seed: int, tokens: int = 16) -> ChunkEntry:
    """An entry as a server's store makes it: tenant and context digests in its header, its key made of them."""
    ids = torch.arange(tokens) + 100 * seed
    e = make_entry(chunk_key(FP, "tenant-a", prefix_key([1, 2, 3]), ids), tokens=tokens, seed=seed)
    e.token_ids, e.tenant, e.context = ids, tenant_key("tenant-a"), prefix_key([1, 2, 3])
    e.check_key()
    return e


def refused(store: ChunkStore, valkey: StoreServer, e: ChunkEntry, forged: int) -> None:
    """The store's get of `e` is a miss counted `forged` (the `forged`-th), not `corrupt`, and its value is gone."""
    assert store.get(e.key) is None
    st = store.stats()
    assert (st.remote.forged, st.remote.corrupt, st.remote.hits, st.misses) == (forged, 0, 0, forged)
    assert not valkey.client().exists(key_prefix(FP) + e.key)  # deleted: the next put (SET NX) can store a good one


def test_a_value_written_with_another_secret_is_refused_counted_and_deleted(valkey, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="chunkcache.store.remote")  # an earlier in-process server may raise it
    e = entry(1)
    monkeypatch.setenv(REMOTE_SECRET_ENV, OTHER_SECRET)
    other_fleet = remote_store(valkey.url)
    other_fleet.put(e)
    drain(other_fleet)
    assert other_fleet.stats().remote.writes == 1
    monkeypatch.setenv(REMOTE_SECRET_ENV, SECRET)
    store = remote_store(valkey.url)
    refused(store, valkey, e, 1)
    assert "unauthenticated" in caplog.text and SECRET not in caplog.text and OTHER_SECRET not in caplog.text
    store.put(e)  # the put after the miss stores the entry: the refused value was deleted
    drain(store)
    assert store.stats().remote.writes == 1 and store.stats().remote.already_stored == 0
    assert_same(remote_store(valkey.url, host_bytes=0).get(e.key), e)


@pytest.mark.parametrize("how", ["no authenticator", "wrong authenticator", "tag only", "empty"])
def test_a_forged_value_is_refused_and_counted_never_served(valkey, how):
    """A valid disk encoding (checksum, key, digests, layout all right) planted by a client without the secret."""
    e = entry(1)
    data = encode(e)
    value = {"no authenticator": data, "wrong authenticator": VALUE_TAG + bytes(MAC_BYTES) + data,
             "tag only": VALUE_TAG, "empty": b""}[how]
    valkey.client().set(key_prefix(FP) + e.key, value)
    store = remote_store(valkey.url)
    refused(store, valkey, e, 1)
    valkey.client().set(key_prefix(FP) + e.key, value)
    assert store.get_many([e.key, entry(2).key]) == {}  # in a request's lookup too
    assert store.stats().remote.forged == 2 and store.stats().remote.misses == 1  # entry(2)'s key holds nothing


@pytest.mark.parametrize("where", ["tag", "authenticator", "header", "kv"])
def test_a_value_with_one_byte_flipped_is_refused(valkey, where):
    e = entry(1)
    name = key_prefix(FP) + e.key
    value = bytearray(sealed(name, encode(e)))
    at = {"tag": 1, "authenticator": len(VALUE_TAG) + 7, "header": len(VALUE_TAG) + MAC_BYTES + 12, "kv": -5}[where]
    value[at] ^= 0x01
    valkey.client().set(name, bytes(value))
    refused(remote_store(valkey.url), valkey, e, 1)


def test_a_value_copied_under_another_key_name_is_refused(valkey):
    """An authentic value moved to another entry's key, or to the same chunk key of another model's key space: the
    authenticator covers the name it was written under."""
    a, b = entry(1), entry(2)
    writer = remote_store(valkey.url)
    writer.put(a)
    drain(writer)
    client = valkey.client()
    value = client.get(key_prefix(FP) + a.key)
    client.set(key_prefix(FP) + b.key, value)
    store = remote_store(valkey.url)
    refused(store, valkey, b, 1)
    other_model = "e" * 32
    client.set(key_prefix(other_model) + a.key, value)
    assert remote_store(valkey.url, fp=other_model).get(a.key) is None  # forged before its model is looked at
    assert not client.exists(key_prefix(other_model) + a.key)
    assert_same(store.get(a.key), a)  # the original, under its own name, still serves
    assert store.stats().remote.hits == 1


def test_a_second_put_of_a_key_does_not_change_the_stored_bytes(valkey):
    """SET NX: a server that missed an entry, computed it and puts it leaves the fleet's copy as it was, even if its
    bits differed (they do not where every writer keeps entry.py's invariant; seed 9 stands for one that did not)."""
    e = entry(1)
    first = remote_store(valkey.url)
    first.put(e)
    drain(first)
    name = key_prefix(FP) + e.key
    before = valkey.client().get(name)
    second = remote_store(valkey.url)
    other_bits = make_entry(e.key, tokens=16, seed=9)
    other_bits.token_ids, other_bits.tenant, other_bits.context = e.token_ids, e.tenant, e.context
    second.put(other_bits)
    second.put(e)
    drain(second)
    assert valkey.client().get(name) == before and stored(valkey.client(), name) == encode(e)
    st = second.stats().remote
    assert (st.writes, st.already_stored, st.bytes_written, st.errors) == (0, 2, 0, 0)
    assert_same(remote_store(valkey.url).get(e.key), e)


def test_features_grown_on_another_server_replace_the_stored_value(valkey):
    """The one put that replaces: ChunkStore.add_features of an entry another server stored first."""
    e = entry(1)
    writer = remote_store(valkey.url)
    writer.put(e)
    drain(writer)
    grower = remote_store(valkey.url)
    assert grower.get(e.key) is not None  # fetched: now in its host tier
    scores = torch.rand(16)
    assert grower.add_features(e.key, {"spec:imp": scores}) is True
    drain(grower)
    assert grower.stats().remote.writes == 1 and grower.stats().remote.already_stored == 0
    got = remote_store(valkey.url).get(e.key)
    assert_same(got, dataclasses.replace(e, features={"spec:imp": scores}))
    assert stored(valkey.client(), key_prefix(FP) + e.key) == encode(got)
    writer.put(e)  # a plain put of the entry without the features: kept out (SET NX)
    drain(writer)
    assert "spec:imp" in remote_store(valkey.url).get(e.key).features and writer.stats().remote.already_stored == 1


def test_a_remote_tier_without_a_secret_refuses_to_start(valkey, monkeypatch, tmp_path):
    monkeypatch.delenv(REMOTE_SECRET_ENV)
    with pytest.raises(ConfigError, match=f"\\${REMOTE_SECRET_ENV} is unset or empty: set it"):
        ChunkStore.from_config(StoreConfig(remote_url=valkey.url))
    path = tmp_path / "c.yaml"
    path.write_text(f"store:\n  remote_url: {valkey.url}\n")
    with pytest.raises(ConfigError, match=f"c.yaml:store:remote_secret_env: .*{REMOTE_SECRET_ENV}"):
        Config.load(path)
    monkeypatch.setenv(REMOTE_SECRET_ENV, "short\n")  # stripped: 5 bytes
    with pytest.raises(ConfigError, match="is 5 bytes long") as err:
        Config.load(path)
    assert "short" not in str(err.value)
    # the variable the knob names, here one of the operator's choosing
    path.write_text(f"store:\n  remote_url: {valkey.url}\n  remote_secret_env: FLEET_KV_SECRET\n  compress: none\n")
    monkeypatch.setenv("FLEET_KV_SECRET", f"  {SECRET}\n")  # a file's trailing newline: the same secret
    writer = ChunkStore.from_config(Config.load(path).store, FP)
    e = entry(1)
    writer.put(e)
    drain(writer)
    monkeypatch.setenv(REMOTE_SECRET_ENV, SECRET)
    reader = remote_store(valkey.url)
    assert_same(reader.get(e.key), e)
    assert reader.stats().remote.forged == 0
    monkeypatch.delenv(REMOTE_SECRET_ENV)
    assert Config.load().store.remote_url is None  # no remote tier: no secret needed


def test_serve_refuses_a_shared_tier_without_a_secret_before_starting_sglang(monkeypatch, capsys):
    from chunkcache.models import tiny_model
    from sglang_patch.serve import cli, launcher, server_process

    def started(*args, **kwargs):
        raise AssertionError("chunkcache serve started SGLang")

    monkeypatch.setattr(server_process, "ServerProcess", started)
    monkeypatch.setattr(launcher, "prepare_environment", lambda config_path: None)  # leaves os.environ alone
    monkeypatch.setenv(launcher.REMOTE_URL_ENV, "")  # restored (unset) after the test, whatever serve sets
    monkeypatch.delenv(REMOTE_SECRET_ENV)
    assert cli.main(["serve", "--model-path", str(tiny_model("llama")), "--remote-url", "redis://127.0.0.1:1/0"]) == 2
    assert f"${REMOTE_SECRET_ENV} is unset or empty" in capsys.readouterr().err


def test_forged_values_and_kept_puts_reach_prometheus(valkey):
    from prometheus_client import CollectorRegistry

    from sglang_patch.scheduler import metrics

    registry = CollectorRegistry()
    metrics.start(True, model_name="m", registry=registry)
    try:
        e = entry(1)
        valkey.client().set(key_prefix(FP) + e.key, encode(e))
        store = remote_store(valkey.url)
        assert store.get(e.key) is None
        store.put(e)
        drain(store)
        store.put(entry(1))  # the same key again: SET NX keeps the stored value
        drain(store)
        metrics.set_store_stats(store.stats())

        def value(name):
            return registry.get_sample_value(name, {"model_name": "m"})

        assert value("chunkcache_remote_forged_total") == 1 and value("chunkcache_remote_corrupt_total") == 0
        assert value("chunkcache_remote_already_stored_total") == 1
    finally:
        metrics.start(False)
