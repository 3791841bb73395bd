"""SGLang's own server test kits (`sglang.test.kits`, the mixins and functions SGLang's CI runs against its servers)
against three servers on the default model: stock SGLang (`--no-chunk-reuse`), chunkcache, and chunkcache with
automatic chunk detection (`--auto-chunks`). What passes on stock must pass on both chunkcache servers.

The mixins are unittest mixins reading `base_url`, `process` (its `poll()`), `model`, and some a size parameter;
each kit method runs here as a test of its own, on a TestCase built around the mixin (`kit_case`), as SGLang's
test classes mix them into theirs. A method that fails on stock SGLang too is skipped on all three servers, with the
reason (STOCK_FAILS), one that samples a coin toss with its reason (COIN_TOSSES); one that needs a server of its own is skipped with that reason (OWN_SERVER).

On top of what each kit asserts, every greedy single-sample request a kit sends while no other is in flight is
recorded (`Recorder`), and its answer on a chunkcache server must be stock's, text for text: chunkcache serves a
request without chunks exactly as stock does, and with automatic detection one whose prompt holds too few stored
tokens to reuse (every kit prompt but the cache-hit kit's).
"""

import functools
import json
import random
import threading
import unittest
from types import SimpleNamespace
from urllib.parse import urlparse

import pytest
import requests
from conftest import metric, start_server

from sglang.test.kits import (abort_timeout_kit, basic_api_contract_kit, basic_decode_correctness_kit,
                              basic_scheduler_stress_kit, cache_hit_kit, ebnf_constrained_kit, json_constrained_kit,
                              matched_stop_kit, prefix_cache_branching_kit, radix_cache_server_kit,
                              regex_constrained_kit)

pytestmark = pytest.mark.slow

SERVERS = {"stock": ("--no-chunk-reuse",), "chunkcache": (), "auto": ("--auto-chunks",)}

# each mixin's size parameters, smaller than SGLang's where it offers them (2 CPU cores)
MIXINS = {
    basic_api_contract_kit.BasicAPIContractMixin: {},
    basic_decode_correctness_kit.BasicDecodeCorrectnessMixin: {},
    basic_scheduler_stress_kit.BasicSchedulerStressMixin: {},
    matched_stop_kit.MatchedStopMixin: {},
    regex_constrained_kit.RegexConstrainedMixin: {},
    json_constrained_kit.JSONConstrainedMixin: {},
    ebnf_constrained_kit.EBNFConstrainedMixin: {},
    prefix_cache_branching_kit.PrefixCacheBranchingMixin: {"cache_chunk_size": 1},
    # SGLang's 16,000 new tokens exceed the model's 8,192-token context: every request is refused (no meta_info)
    abort_timeout_kit.AbortAllMixin: {"abort_all_num_requests": 8, "abort_all_max_new_tokens": 4000},
    abort_timeout_kit.WaitingTimeoutMixin: {},
    abort_timeout_kit.RunningTimeoutTwoWaveMixin: {},
}
CASES = [(mixin, name) for mixin in MIXINS for name in sorted(vars(mixin)) if name.startswith("test_")]

# fails on stock SGLang with this model on this CPU, and so is not run (measured on a stock server: the reason)
STOCK_FAILS = {
    ("BasicDecodeCorrectnessMixin", "test_basic_math"):
        "SmolLM2-135M answers ' 17' to 17 x 23, and repeats it (stock, greedy)",
    ("BasicDecodeCorrectnessMixin", "test_color_completion"):
        "SmolLM2-135M continues the blank with a numbered list ' 1. 2. 3.', no 'yellow' (stock, greedy)",
    ("BasicSchedulerStressMixin", "test_concurrent_requests"):
        "after the kit's system line SmolLM2-135M ends most answers at once (empty text) and names no capital: 0/8 "
        "on stock, the kit wants 7",
    ("JSONConstrainedMixin", "test_json_generate"):
        "SmolLM2-135M writes 'population' as an integer of 100+ digits, cut at the kit's 128 new tokens: the JSON "
        "never closes and json.loads fails (stock)",
    ("JSONConstrainedMixin", "test_mix_json_and_other"):
        "its 20 JSON-schema requests are test_json_generate's, which fails on stock as said there",
    ("PrefixCacheBranchingMixin", "test_prefix_cache_branching"):
        "written for a hybrid (Mamba) model's radix cache, which caches at chunk boundaries and branching points: "
        "a plain radix tree matches the shared prefix at once (stock: cached_tokens=256 on the second request, the "
        "kit wants 0)",
}
# samples 3 answers at temperature 0.5 (the kit's n=3 requests) against a pattern SmolLM2-135M meets in some runs and
# not others whatever the server: a coin toss that cannot tell chunkcache from stock. The prompts are 5-7 tokens, no
# chunk: a chunkcache server computes them as stock does.
COIN_TOSSES = {
    ("EBNFConstrainedMixin", "test_ebnf_generate_complex_json"):
        "a pattern wanting name, age and city: it wrote '{\"city\":\"New York\"}' on stock once, passed on all "
        "three servers another time",
    ("RegexConstrainedMixin", "test_regex_generate_custom_log_format"):
        "'Operation [a-z]+ successfully': a sample can spell a 128-token word ('ikvfvjfjfjfj...') and never close; "
        "passed on all three servers locally, one of three samples failed on the chunkcache server in CI",
    ("EBNFConstrainedMixin", "test_ebnf_generate_custom_log_format"):
        "the regex kit's log line as a grammar, the same unbounded '[a-z]+' word",
    ("RegexConstrainedMixin", "test_regex_generate_complex_json"):
        "the EBNF kit's JSON as a regex: unbounded '[a-zA-Z0-9 ]+' strings and '[1-9][0-9]*' numbers",
}
OWN_SERVER = {
    ("WaitingTimeoutMixin", "test_waiting_timeout"):
        "needs a server of its own per side (SGLANG_REQ_WAITING_TIMEOUT, --max-running-requests 1) for two plain "
        "requests; an abort of a waiting or running blended request is tests/test_client_features.py's",
    ("RunningTimeoutTwoWaveMixin", "test_running_timeout_no_crash"):
        "needs a server of its own per side (SGLANG_REQ_RUNNING_TIMEOUT) for sixteen plain 1,024-token decodes; an "
        "abort of a running blended request is tests/test_client_features.py's",
}

# every recorded greedy answer, per server kind, per test: stock's is the oracle of the other two
RECORDED: dict[str, dict[str, dict[str, dict]]] = {kind: {} for kind in SERVERS}


@pytest.fixture(scope="module", params=list(SERVERS))
def served(request, tmp_path_factory, default_model):
    """One server per kind, shared by the module's tests (pytest runs each kind's tests together, one server up at a
    time). Metrics on all three: the cache-hit kit checks that detection blended on the auto server."""
    srv = start_server(tmp_path_factory.mktemp(request.param) / "server.log", *SERVERS[request.param],
                       "--enable-metrics")
    srv.kind = request.param
    yield srv
    srv.stop()


class Recorder:
    """Stands in for the `requests` module a kit imported: `post` records the answer of each greedy single-sample
    request (not streamed) sent while no other was in flight, keyed by its path and body."""

    def __init__(self):
        self.answers: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._started = 0  # posts started so far
        self._in_flight = 0

    def __getattr__(self, name):
        return getattr(requests, name)

    def post(self, url, *args, json=None, **kwargs):
        with self._lock:
            self._started += 1
            mine, alone = self._started, self._in_flight == 0
            self._in_flight += 1
        try:
            response = requests.post(url, *args, json=json, **kwargs)
        finally:
            with self._lock:
                self._in_flight -= 1
                alone = alone and self._started == mine  # none started while it ran
        if alone and _greedy(json) and not json.get("stream") and response.status_code == 200:
            self.answers[f"{urlparse(url).path} {_dumps(json)}"] = _answer(response.json())
        return response


def _dumps(body) -> str:
    return json.dumps(body, sort_keys=True)


def _greedy(body) -> bool:
    if not isinstance(body, dict):
        return False
    params = body.get("sampling_params", body)
    return params.get("temperature") == 0 and params.get("n", 1) == 1


def _answer(body) -> dict:
    """The answer's text, and whether a chunkcache server reused stored KV for it (then it may differ)."""
    if isinstance(body, list):
        return {"text": [_answer(b)["text"] for b in body], "reused": any(_answer(b)["reused"] for b in body)}
    report = (body.get("meta_info") or body.get("metadata") or {}).get("chunkcache") or {}
    if "choices" in body:
        choice = body["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
    else:
        text = body.get("text")
    return {"text": text, "reused": report.get("reused_tokens", 0) > 0}


def kit_case(mixin, method, server, model, recorder):
    """The kit's method on a TestCase of its own, as SGLang's test classes mix kits into theirs."""
    process = SimpleNamespace(poll=lambda: None if server.alive() else 1)

    def flush_cache(cls):
        requests.post(cls.base_url + "/flush_cache", timeout=60)

    attrs = {"base_url": server.url, "process": process, "model": str(model), "served_model_name": str(model),
             "flush_cache": classmethod(flush_cache), **MIXINS[mixin]}
    return type(mixin.__name__, (mixin, unittest.TestCase), attrs)(method)


def check_against_stock(kind: str, test: str, answers: dict) -> None:
    """A chunkcache server's recorded answers against stock's for the same test (when stock's ran in this session):
    equal, unless the answer reused stored KV (automatic detection blended it)."""
    RECORDED[kind][test] = answers
    stock = RECORDED["stock"].get(test)
    if kind == "stock" or stock is None:
        return
    compared = [key for key in answers if key in stock and not answers[key]["reused"]]
    differ = {key: (answers[key]["text"], stock[key]["text"]) for key in compared
              if answers[key]["text"] != stock[key]["text"]}
    assert not differ, f"{kind} answered differently from stock: {differ}"


@pytest.mark.parametrize("mixin, method", CASES, ids=[f"{m.__name__}.{n}" for m, n in CASES])
def test_kit(served, default_model, monkeypatch, mixin, method):
    key = (mixin.__name__, method)
    for skipped in (STOCK_FAILS, COIN_TOSSES, OWN_SERVER):
        if key in skipped:
            pytest.skip(skipped[key])
    recorder = Recorder()
    monkeypatch.setattr(__import__(mixin.__module__, fromlist=["requests"]), "requests", recorder)
    getattr(kit_case(mixin, method, served, default_model, recorder), method)()
    check_against_stock(served.kind, f"{mixin.__name__}.{method}", recorder.answers)


def test_radix_cache_server_kit(served, monkeypatch):
    """SGLang's radix-attention stress: one batch of requests over a random tree of shared prefixes, each decoding its
    own length. 24 nodes of at most 64 tokens (SGLang's: 400 of 256), the same tree on every server."""
    monkeypatch.setattr(radix_cache_server_kit, "gen_radix_tree",
                        functools.partial(radix_cache_server_kit.gen_radix_tree, num_nodes=24, chunk_len=64))
    random.seed(57)
    radix_cache_server_kit.run_radix_attention_test(served.url)
    assert served.alive() and requests.get(served.url + "/health", timeout=30).status_code == 200


# the cache-hit kit's ShareGPT-format dataset: each request's text is one of these lines, repeated to the request
# length, so a later round's new question repeats lines an earlier round sent: automatic detection finds them stored
# (a line break ends a segment) and blends them
PASSAGES = [
    "The northern ferry leaves the harbour at seven, crosses the bay in forty minutes and returns before noon; in "
    "winter it waits for the ice breaker, and passengers buy tickets at the kiosk beside the old customs house.",
    "Our library lends books for three weeks, renews them twice online, charges nothing for late returns from "
    "children, and keeps its reading room open until nine on weekdays and until five on Saturdays.",
    "The bakery on Mill Street bakes rye bread every morning, sells pastries until they run out, closes on "
    "Mondays, and takes orders for wedding cakes at least two weeks ahead by phone or in person.",
]


def test_cache_hit_kit(served, default_model, tmp_path):
    """SGLang's multi-turn cache-hit kit: each round resends every client's history with a new question, and every
    request must find at least its previous round's prompt and output cached (`cached_tokens`, asserted by the kit).
    On the auto server the new questions (384 tokens: more stored than the exact lead and the reuse minimum) repeat
    lines an earlier round sent, which detection blends (checked on /metrics): a blended request's exact prefix still
    counts as cached."""
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps([{"conversations": [{"from": "human", "value": (PASSAGES[i % 3] + "\n") * 4},
                                                      {"from": "gpt", "value": "Noted."}]} for i in range(18)]))
    blended = metric(served, "chunkcache_auto_requests_total", '{outcome="blended"}')
    result = cache_hit_kit.run_multiturn_cache_hit_test(
        base_url=served.url, model_path=str(default_model), num_clients=4, num_rounds=3, request_length=384,
        output_length=16, max_parallel=4, dataset_path=str(dataset))
    assert result["rounds"]["round_2"]["total_cached_tokens"] > 0, result
    if served.kind == "auto":
        assert metric(served, "chunkcache_auto_requests_total", '{outcome="blended"}') > blended
