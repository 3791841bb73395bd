"""The admin routes on a live server started with SGLang's `--admin-api-key`, a disk tier and a shared Valkey tier:
/chunkcache/ingest and /chunkcache/purge want the admin key (401 without it, as /flush_cache), `chunkcache ingest`
and `chunkcache purge` send it; /flush_cache under store.clear_on_flush empties the server's local tiers and leaves
the shared one; a purge of one tenant leaves none of its entries in any tier and every other tenant's whole."""

import time

import pytest
import requests
import yaml
from conftest import metric, start_server, with_test_defaults
from store_server import SECRET, SECRET_ENV, StoreServer

from chunkcache.client import API_KEY_ENV
from chunkcache.config import config_file
from chunkcache.hashing import tenant_key
from chunkcache.store.remote import VALUE_TAG, unseal
from chunkcache.store.wire import decode
from sglang_patch.serve import cli

pytestmark = pytest.mark.slow

ADMIN = "admin-key-of-the-test"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def valkey(tmp_path_factory):
    store = StoreServer(tmp_path_factory.mktemp("store"))
    yield store
    store.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory, valkey):
    tmp = tmp_path_factory.mktemp("admin")
    config = yaml.safe_load(config_file("default").read_text())
    # remote_fetch always: a chunk the local tiers lack is read from the shared tier, whatever the fetch rule would
    # predict for chunks this small (docs/shared-store.md "Fetch or compute")
    config["store"].update(disk_dir=str(tmp / "disk"), remote_url=valkey.url, remote_fetch="always",
                           clear_on_flush=True)
    path = tmp / "admin.yaml"
    path.write_text(with_test_defaults(yaml.safe_dump(config)))
    srv = start_server(tmp / "server.log", "--enable-metrics", "--admin-api-key", ADMIN, "--chunkcache-config",
                       str(path), env=SECRET_ENV)
    srv.disk = tmp / "disk"
    yield srv
    srv.stop()


def docs(tag: str, n: int = 2) -> list[str]:
    return [f"The {tag} archive holds record {i}, sealed in the year {1700 + 37 * i}." for i in range(n)]


def ingest(server, documents, headers=AUTH, **extra):
    return requests.post(server.url + "/chunkcache/ingest", json={"documents": documents, **extra}, headers=headers,
                         timeout=600)


def ingested(server, documents, **extra) -> tuple[int, int]:
    r = ingest(server, documents, **extra)
    assert r.status_code == 200, r.text
    return r.json()["new"], r.json()["existing"]


def store_state(server) -> dict:
    """The chunk store's counters once the shared tier's writer has sent every put."""
    deadline = time.monotonic() + 60
    while True:
        state = requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]["chunkcache"]
        if not state["store"]["remote"]["pending"]:
            return state["store"]
        assert time.monotonic() < deadline, state["store"]["remote"]
        time.sleep(0.1)


def shared(valkey) -> dict[str, int]:
    """The shared tier's entries per tenant digest, each value authenticated and decoded whole (what a reader is
    served)."""
    client, found = valkey.client(), {}
    for name in client.scan_iter(match="cc:v1:*"):
        value = client.get(name)
        if value is not None and value.startswith(VALUE_TAG):
            tenant = decode(bytearray(unseal(SECRET.encode(), name.decode(), value))).tenant
            found[tenant] = found.get(tenant, 0) + 1
    return found


def test_ingest_wants_the_admin_key_and_the_command_sends_it(server, tmp_path, monkeypatch, capsys):
    documents = docs("Quill")
    assert ingest(server, documents, headers={}).status_code == 401
    assert ingest(server, documents, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert ingested(server, documents) == (2, 0)
    assert ingested(server, documents) == (0, 2)  # stored: the second call finds them

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(f'"{d}"\n' for d in docs("Osier")))
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert cli.main(["ingest", str(path), "--url", server.url]) == 2
    assert "HTTP 401" in capsys.readouterr().err
    assert cli.main(["ingest", str(path), "--url", server.url, "--api-key", ADMIN]) == 0
    assert "2 documents: 2 new, 0 already stored" in capsys.readouterr().out
    monkeypatch.setenv(API_KEY_ENV, ADMIN)  # the key kept out of the process list
    assert cli.main(["ingest", str(path), "--url", server.url]) == 0
    assert "2 documents: 0 new, 2 already stored" in capsys.readouterr().out


def flush(server) -> None:
    """/flush_cache with the admin key; SGLang refuses (400) while its scheduler still holds the request just
    answered, so it is asked again."""
    deadline = time.monotonic() + 60
    while (r := requests.post(server.url + "/flush_cache", headers=AUTH, timeout=60)).status_code != 200:
        assert r.status_code == 400 and time.monotonic() < deadline, r.text
        time.sleep(0.1)


def test_flush_cache_empties_the_local_tiers_and_leaves_the_shared_one(server, valkey):
    assert ingested(server, docs("Larch"), namespace="flush") == (2, 0)
    before = store_state(server)
    assert before["memory_entries"] > 0 and before["disk_entries"] > 0
    assert metric(server, "chunkcache_store_bytes", '{tier="host"}') > 0
    in_store = shared(valkey)
    assert in_store[tenant_key("flush")] == 2

    assert requests.post(server.url + "/flush_cache", timeout=60).status_code == 401  # an admin route
    flush(server)
    after = store_state(server)
    assert (after["memory_entries"], after["memory_bytes"], after["disk_entries"], after["disk_bytes"]) == (0, 0, 0, 0)
    assert not list(server.disk.rglob("*.kv"))
    assert metric(server, "chunkcache_store_bytes", '{tier="host"}') == 0
    assert metric(server, "chunkcache_store_bytes", '{tier="disk"}') == 0
    assert shared(valkey) == in_store  # other servers' store too: kept
    # the documents are no longer this server's: the second ingest reads them from the shared tier, computes none
    assert ingested(server, docs("Larch"), namespace="flush") == (0, 2)
    assert store_state(server)["remote_hits"] == before["remote_hits"] + 2


def test_purge_removes_one_tenant_from_every_tier_and_leaves_the_others(server, valkey, monkeypatch, capsys):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    a, b = docs("Sorrel"), docs("Tansy")
    assert ingested(server, a, namespace="purge-a") == (2, 0)
    assert ingested(server, a, namespace="purge-a", cache_salt="user-1") == (2, 0)  # another tenant, same text
    assert ingested(server, b, namespace="purge-b") == (2, 0)
    store_state(server)  # every put sent
    tenants = [tenant_key("purge-a"), tenant_key("purge-a", "user-1"), tenant_key("purge-b")]
    assert [shared(valkey).get(t) for t in tenants] == [2, 2, 2]

    url = server.url + "/chunkcache/purge"
    assert requests.post(url, json={"namespace": "purge-a"}, timeout=60).status_code == 401
    r = requests.post(url, json={}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "names its tenant" in r.json()["error"]["message"]
    r = requests.post(url, json={"namespace": "purge-a"}, headers=AUTH, timeout=600)
    assert r.status_code == 200, r.text
    purged = r.json()["purged"]
    assert {tier: purged[tier] for tier in ("memory", "disk", "remote")} == {"memory": 2, "disk": 2, "remote": 2}
    assert [shared(valkey).get(t) for t in tenants] == [None, 2, 2]
    assert ingested(server, a, namespace="purge-a") == (2, 0)  # computed again: no tier held them
    assert ingested(server, a, namespace="purge-a", cache_salt="user-1") == (0, 2)  # the salted tenant kept its own
    assert ingested(server, b, namespace="purge-b") == (0, 2)

    # the command: the salted tenant alone
    assert cli.main(["purge", "--namespace", "purge-a", "--cache-salt", "user-1", "--url", server.url]) == 2
    assert "HTTP 401" in capsys.readouterr().err
    assert cli.main(["purge", "--namespace", "purge-a", "--cache-salt", "user-1", "--url", server.url,
                     "--api-key", ADMIN]) == 0
    assert "purged 2 memory, 2 disk, 2 remote, " in capsys.readouterr().out
    assert ingested(server, a, namespace="purge-a", cache_salt="user-1") == (2, 0)
    assert ingested(server, a, namespace="purge-a") == (0, 2)
