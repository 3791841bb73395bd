"""An adversarial probe: bad or hostile input on every surface of a live server (chunk hints on
/generate, documents on /v1/chat/completions, /chunkcache/ingest, the `chunkcache` CLI, the config file, the disk
store's files). Each case must get a clear 4xx naming the offending field, or be served with a counted, visible
fallback; and after each one the server's known-good answer is unchanged (nothing crashed, hung or leaked).
tests/test_bad_input_kinds.py checks, without a server, that the tables below reach every check of the validators.

One server for the module (CI time): small limits so the bounds are cheap to hit, a KV pool small enough to refuse a
long prompt, a disk tier with no host tier in front (every chunk read goes to its files).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from chunkcache.prompt import _SLOT
from chunkcache.store.wire import decode, encode
from sglang_patch.scheduler.request_hint import radix_partition
from sglang_patch.serve import cli

from conftest import metric, start_server

pytestmark = pytest.mark.slow
GREEDY = {"max_new_tokens": 6, "temperature": 0}
KNOWN_GOOD = "The capital of France is"
MAX_SPANS, IN_FLIGHT, MAX_DOCS, POOL = 8, 2, 16, 3072
IDS = list(range(1000, 1040))  # a 40-token prompt: structural hint errors are found before the model runs
TEXT = "Doc A: the vault code is 4417.\nDoc B: the river is green.\nWhat is the vault code?"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_input")
    config = d / "chunkcache.yaml"
    config.write_text(f"serve: {{max_total_tokens: {POOL}}}\n"
                      f"store: {{host_bytes: 0, disk_dir: {d / 'store'}}}\n"
                      f"limits: {{max_spans: {MAX_SPANS}, ingest_in_flight: {IN_FLIGHT}, "
                      f"ingest_max_documents: {MAX_DOCS}}}\n")
    server = start_server(d / "server.log", "--chunkcache-config", str(config), "--enable-metrics")
    server.store = d / "store"
    server.known_good = answer(server)
    yield server
    server.stop()


def answer(server) -> str:
    r = requests.post(server.url + "/generate", json={"text": KNOWN_GOOD, "sampling_params": GREEDY}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["text"]


@pytest.fixture
def healthy(srv):
    """After the case: the server still answers the known-good prompt exactly as before."""
    yield srv
    assert answer(srv) == srv.known_good


def hints(payload, protocol="1", version="1", extra_actions=()):
    return {"protocol_version": protocol, "message_id": "m", "actions": [*extra_actions, {
        "action_id": "c", "action_type": "chunkcache.chunks", "action_version": version, "payload": payload}]}


def tok(spans, **payload):
    return {"input_ids": IDS, "kv_hints": hints({"token_spans": spans, **payload})}


OURS = {"action_id": "d", "action_type": "chunkcache.chunks", "action_version": "1", "payload": {"token_spans": [[0, 1]]}}

# (surface, body, message): every one a 400 whose message names the field
GENERATE = {
    "span past the prompt": (tok([[0, 50]]), "token_spans[0] = [0, 50]: end 50 is past the prompt (40 prompt tokens)"),
    "overlapping spans": (tok([[0, 5], [3, 8]]), "token_spans[1] = [3, 8] starts at 3, before the end 5"),
    "empty span": (tok([[4, 4]]), "token_spans[0] = [4, 4] is empty"),
    "negative start": (tok([[-2, 4]]), "token_spans[0] = [-2, 4]: start -2 is negative"),
    "span holding the last token": (tok([[0, 40]]), "contains the last prompt token (index 39)"),
    "spans not a list": (tok("0-5"), "token_spans must be a non-empty list of [start, end] pairs"),
    "empty spans": (tok([]), "token_spans must be a non-empty list"),
    "span of three": (tok([[0, 2, 4]]), "token_spans[0] must be a pair of integers"),
    "bool in a span": (tok([[True, 4]]), "token_spans[0] must be a pair of integers"),
    "float in a span": (tok([[0.5, 4]]), "token_spans[0] must be a pair of integers"),
    "too many spans": (tok([[i, i + 1] for i in range(30)]),
                       f"token_spans has 30 spans; at most {MAX_SPANS} per request (server limits.max_spans)"),
    "400 one-token spans": ({"input_ids": list(range(1000, 1500)),
                             "kv_hints": hints({"token_spans": [[i, i + 1] for i in range(18, 418)]})},
                            "token_spans has 400 spans; at most"),
    "ratio above 1": (tok([[0, 4]], ratio=7), "ratio must be in [0, 1], got 7"),
    "ratio a string": (tok([[0, 4]], ratio="0.2"), "ratio must be a number in [0, 1], got '0.2'"),
    "ratio a bool": (tok([[0, 4]], ratio=True), "ratio must be a number in [0, 1], got True"),
    "unknown selector": (tok([[0, 4]], selector="bogus"), "selector 'bogus' is not registered"),
    "selector not a string": (tok([[0, 4]], selector=5), "selector must be a string, got 5"),
    "empty namespace": (tok([[0, 4]], namespace=""), "namespace must be a non-empty string"),
    "namespace not a string": (tok([[0, 4]], namespace=["a"]), "namespace must be a non-empty string"),
    "1 MB namespace": (tok([[0, 4]], namespace="n" * (1 << 20)), "namespace is 1048576 characters; at most 256"),
    "unknown payload key": (tok([[0, 4]], top_k=3), "unknown payload key(s) 'top_k'"),
    "exact not a bool": (tok([[0, 4]], exact=1), "exact must be true or false, got 1"),
    "selector with exact": (tok([[0, 4]], exact=True, selector="mix"), "selector 'mix' cannot apply with exact: true"),
    "ratio with exact": (tok([[0, 4]], exact=True, ratio=0.2), "ratio cannot apply with exact: true"),
    "max_kl zero": (tok([[0, 4]], max_kl=0), "max_kl must be a number > 0 (nats of KL over what kl_over names), got 0"),
    "max_kl with ratio": (tok([[0, 4]], max_kl=0.1, ratio=0.2), "max_kl and ratio both set the recompute budget"),
    "max_kl with exact": ({"input_ids": IDS, "kv_hints": hints({"exact": True, "max_kl": 0.1})},
                          "max_kl cannot apply with exact: true"),
    "kl_over unknown": (tok([[0, 4]], max_kl=0.1, kl_over="tokens"), "kl_over must be one of 'answer', 'first_token'"),
    "kl_over with ratio": (tok([[0, 4]], ratio=0.2, kl_over="first_token"), "kl_over says what a quality floor"),
    "learn not a bool": ({"input_ids": IDS, "kv_hints": hints({"learn": "no"})}, "learn must be true or false"),
    "payload not an object": ({"input_ids": IDS, "kv_hints": hints([[0, 4]])}, "actions[0].payload"),
    "two chunkcache actions": ({"input_ids": IDS, "kv_hints": hints({"token_spans": [[0, 4]]}, extra_actions=[OURS])},
                               "2 chunkcache.chunks actions"),
    "action version 2": ({"input_ids": IDS, "kv_hints": hints({"token_spans": [[0, 4]]}, version="2")},
                         "action_version '2' is not supported"),
    "protocol version 99": ({"input_ids": IDS, "kv_hints": hints({"token_spans": [[0, 4]]}, protocol="99")},
                            "protocol_version '99' is not supported"),
    "envelope without message_id": ({"input_ids": IDS, "kv_hints": {"protocol_version": "1", "actions": []}},
                                    "message_id"),
    "char_spans on input_ids": ({"input_ids": IDS, "kv_hints": hints({"char_spans": [[0, 4]]})},
                                "char_spans is for a text request"),
    "token_spans on text": ({"text": TEXT, "kv_hints": hints({"token_spans": [[0, 4]]})},
                            "token_spans is for an input_ids request"),
    "char span cutting a token": ({"text": TEXT, "kv_hints": hints({"char_spans": [[0, 9]]})},
                                  "char_spans[0] = [0, 9]: end offset 9 falls inside token"),
    "char span starting inside a token": ({"text": TEXT, "kv_hints": hints({"char_spans": [[1, 31]]})},
                                          "char_spans[0] = [1, 31]: start offset 1 falls inside token 0"),
    "char span past the text": ({"text": TEXT, "kv_hints": hints({"char_spans": [[0, 500]]})},
                                "char_spans[0] = [0, 500]: end 500 is past the prompt"),
    "plain request in the reserved partition": ({"input_ids": IDS, "extra_key": radix_partition(None, None)},
                                                "extra_key: values starting with"),
    "hinted request in the reserved partition": ({**tok([[0, 4]]), "extra_key": radix_partition("t", "x")},
                                                 "extra_key: values starting with"),
}

CHAT_QUESTION = [{"role": "user", "content": "What is the vault code?"}]
# (chunkcache object, message[, other fields of the request])
CHAT = {
    "documents a string": ({"documents": "one"}, "chunkcache.documents must be a non-empty list of strings"),
    "documents empty": ({"documents": []}, "got an empty list"),
    "blank document": ({"documents": ["ok", "  "]}, "chunkcache.documents[1] must be a non-empty string"),
    "document not a string": ({"documents": ["ok", 5]}, "chunkcache.documents[1] must be a non-empty string"),
    "too many documents": ({"documents": [f"d{i}" for i in range(12)]},
                           f"chunkcache.documents has 12 documents; at most {MAX_SPANS} per request "
                           "(server limits.max_spans)"),
    "unknown chunkcache key": ({"documents": ["ok"], "top_k": 2}, "unknown key(s) 'top_k' in chunkcache"),
    "chunkcache not an object": (["ok"], "chunkcache must be an object"),
    "bad ratio": ({"documents": ["ok"], "ratio": -1}, "chunkcache: ratio must be in [0, 1], got -1"),
    "bad exact": ({"exact": "yes"}, "chunkcache: exact must be true or false, got 'yes'"),
    "learn not a bool": ({"learn": "no"}, "chunkcache: learn must be true or false, got 'no'"),
    "long namespace": ({"documents": ["ok"], "namespace": "n" * 300}, "namespace is 300 characters; at most 256"),
    "documents with input_ids": ({"documents": ["ok"]}, "do not also send input_ids", {"input_ids": [1, 2, 3]}),
    "no user message first": ({"documents": ["ok"]}, "got roles ['assistant', 'user']",
                              {"messages": [{"role": "assistant", "content": "4417"}, *CHAT_QUESTION]}),
    "blank question": ({"documents": ["ok"]}, "the user message must have non-empty text content",
                       {"messages": [{"role": "user", "content": "  "}]}),
}

INGEST = {
    "documents missing": ({"system": "x"}, "ingest.documents must be a non-empty list of strings, got nothing"),
    "unknown key": ({"documents": ["ok"], "selector": "epic"}, "unknown key(s) 'selector' in ingest"),
    "too many documents": ({"documents": [f"d{i}" for i in range(MAX_DOCS + 1)]},
                           f"ingest.documents has {MAX_DOCS + 1} documents; at most {MAX_DOCS} per request "
                           "(server limits.ingest_max_documents)"),
    "empty cache_salt": ({"documents": ["ok"], "cache_salt": ""}, "ingest.cache_salt must be a non-empty string"),
    "blank system": ({"documents": ["ok"], "system": " "}, "ingest.system must be a non-empty string"),
    "document over the context": ({"documents": ["ok", "word " * 9000]}, "ingest.documents[1]: "),
    "body a list": (["ok"], "ingest must be an object"),
}


@pytest.mark.parametrize("case", GENERATE)
def test_generate_hint(healthy, case):
    body, message = GENERATE[case]
    r = requests.post(healthy.url + "/generate", json={"sampling_params": GREEDY, **body}, timeout=300)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


@pytest.mark.parametrize("case", CHAT)
def test_chat_documents(healthy, case):
    documents, message, *extra = CHAT[case]
    r = requests.post(healthy.url + "/v1/chat/completions", timeout=300, json={
        "messages": CHAT_QUESTION, "max_tokens": 4, "chunkcache": documents, **(extra[0] if extra else {})})
    assert r.status_code == 400, r.text
    assert message in r.json()["message"]


@pytest.mark.parametrize("case", INGEST)
def test_ingest(healthy, case):
    body, message = INGEST[case]
    r = requests.post(healthy.url + "/chunkcache/ingest", json=body, timeout=300)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_ingest_body_not_json(healthy):
    r = requests.post(healthy.url + "/chunkcache/ingest", data=b"{not json", timeout=60,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "the body must be JSON" in r.json()["error"]["message"]


def test_chat_question_holding_the_template_placeholder_is_answered(healthy):
    r = requests.post(healthy.url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": f"What is {_SLOT} the code?"}], "max_tokens": 4,
        "chunkcache": {"documents": ["The vault code is 4417."]}})
    assert r.status_code == 200, r.text  # was 400 "too many values to unpack (expected 2)"
    assert "fallback" not in r.json()["metadata"]["chunkcache"]


def test_input_logprobs_is_a_counted_visible_fallback(healthy):
    before = metric(healthy, "chunkcache_fallbacks_total", '{reason="input_logprobs"}')
    r = requests.post(healthy.url + "/generate", timeout=300, json={
        "text": TEXT, "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0,
        "kv_hints": hints({"char_spans": [[0, 31]]})})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["chunkcache"]["fallback"] == "input_logprobs"
    assert metric(healthy, "chunkcache_fallbacks_total", '{reason="input_logprobs"}') == before + 1


def test_prompt_longer_than_the_kv_pool_is_a_400_not_a_bad_hint(healthy):
    bad_hints = metric(healthy, "chunkcache_fallbacks_total", '{reason="bad_hint"}')
    ids = [1000 + i % 500 for i in range(POOL + 200)]
    r = requests.post(healthy.url + "/generate", timeout=300, json={
        "input_ids": ids, "sampling_params": GREEDY, "kv_hints": hints({"token_spans": [[10, 100]]})})
    assert r.status_code == 400 and "exceeds the maximum allowed length" in r.text, r.text
    assert metric(healthy, "chunkcache_fallbacks_total", '{reason="bad_hint"}') == bad_hints


# --- the disk store's files -----------------------------------------------------------------------------------------

def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _garbage(path: Path) -> None:
    path.write_bytes(b"CCKV" + b"\xff" * 64)


def _wrong_shape(path: Path) -> None:
    """A valid-checksum entry whose KV has head_dim 192 (the model's is 64): the probe's poisoning entry."""
    entry = decode(path.read_bytes())
    entry.k, entry.v = entry.k.repeat(1, 1, 1, 3), entry.v.repeat(1, 1, 1, 3)
    path.write_bytes(encode(entry))


def _foreign_model(path: Path) -> None:
    entry = decode(path.read_bytes())
    entry.model_fingerprint = "0" * 32
    path.write_bytes(encode(entry))


@pytest.mark.parametrize("damage", [_directory, _garbage, _wrong_shape, _foreign_model])
def test_damaged_store_file_is_a_counted_miss(healthy, damage):
    doc = f"The {damage.__name__.strip('_')} ledger holds the code {len(damage.__name__) * 37}."
    before = set(healthy.store.glob("*/*.kv"))
    r = requests.post(healthy.url + "/chunkcache/ingest", json={"documents": [doc]}, timeout=300)
    assert r.json()["new"] == 1, r.text
    (path,) = set(healthy.store.glob("*/*.kv")) - before
    damage(path)
    corrupt = metric(healthy, "chunkcache_store_corrupt_total")
    for _ in range(2):  # the first request drops and recomputes it, the second is served from the fresh entry
        r = requests.post(healthy.url + "/v1/chat/completions", timeout=300, json={
            "messages": CHAT_QUESTION, "max_tokens": 4, "chunkcache": {"documents": [doc], "selector": "none"}})
        assert r.status_code == 200, r.text
        assert "fallback" not in r.json()["metadata"]["chunkcache"], r.json()["metadata"]
    assert metric(healthy, "chunkcache_store_corrupt_total") == corrupt + 1
    assert path.is_file() and decode(path.read_bytes()).k.shape[-1] == 64


def test_entry_holding_other_tokens_is_a_miss_and_replaced(healthy):
    """A valid-checksum entry under a chunk's key but holding other tokens (a forged or foreign shared-tier value)
    is never copied into a request: the chunk is computed, and its put replaces the entry."""
    doc = "The swapped ledger holds the code 5151."
    before = set(healthy.store.glob("*/*.kv"))
    r = requests.post(healthy.url + "/chunkcache/ingest", json={"documents": [doc]}, timeout=300)
    assert r.json()["new"] == 1, r.text
    (path,) = set(healthy.store.glob("*/*.kv")) - before
    entry = decode(path.read_bytes())
    tokens = entry.token_ids.clone()
    entry.token_ids = tokens.flip(0)
    path.write_bytes(encode(entry))
    r = requests.post(healthy.url + "/v1/chat/completions", timeout=300, json={
        "messages": CHAT_QUESTION, "max_tokens": 4, "chunkcache": {"documents": [doc], "selector": "none"}})
    info = r.json()["metadata"]["chunkcache"]
    assert info["chunk_misses"] == 1 and "fallback" not in info, info
    assert decode(path.read_bytes()).token_ids.tolist() == tokens.tolist()


# --- the CLI --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lines, args, message", [
    (["not json"], [], ":1: not JSON"),
    (['{"title": "x"}'], [], ':1: expected a JSON string or an object with a non-empty "text"'),
    ([""], [], ": no documents"),
    (['"ok"'], ["--batch-size", "0"], "batch_size must be at least 1, got 0"),
    ([json.dumps(f"doc {i}") for i in range(MAX_DOCS + 2)], ["--batch-size", str(MAX_DOCS + 2)],
     f"HTTP 400: ingest.documents has {MAX_DOCS + 2} documents; at most {MAX_DOCS}"),
])
def test_cli_ingest(healthy, tmp_path, capsys, lines, args, message):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert cli.main(["ingest", str(path), "--url", healthy.url, *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_serve_refuses_a_bad_config(healthy, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("select: {selector: bogus}\nstore: {host_bytes: '2 gigs'}\nlimits: {max_spans: 0}\n")
    out = subprocess.run([sys.executable, "-m", "sglang_patch.serve.cli", "serve", "--chunkcache-config", str(path)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2
    for key in ("select:selector", "store:host_bytes", "limits:max_spans"):
        assert key in out.stderr, out.stderr

