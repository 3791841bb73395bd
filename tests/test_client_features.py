"""SGLang's client features on blended requests (chunks marked with `kv_hints`, README "the request contract"):
constrained decoding, parallel sampling, an abort in the middle of a blend, a request retracted under memory pressure.

The oracle is the same request with `selector: full` (SGLang's own prefill, stock's tokens). A blend at `ratio: 1`
runs every step of the blend (the fill computes and stores the missing chunks, the stored KV is copied in, the
features, the recompute through the blend's own passes, the sampler on the blend's own last-token logits) and in
float32 its greedy tokens are stock's (tests/test_blend_serving.py): a difference is the feature's own plumbing
around the blend. At the server's ratio (0.15) the KV is approximate, and only what holds whatever the KV is asserted
(the constraint, the copies of a parallel request agreeing, the report)."""

import json
import re
import threading
import time
import uuid

import pytest
import requests
from conftest import Rag, hints, start_server, with_test_defaults

pytestmark = pytest.mark.slow
POOL = 2000  # KV-pool tokens: the retraction test's concurrent decodes need more than this


@pytest.fixture(scope="module")
def srv(tmp_path_factory, default_model):
    d = tmp_path_factory.mktemp("client_features")
    config = d / "features.yaml"
    config.write_text(with_test_defaults("serve:\n  dtype: float32\nselect:\n  selector: epic\n  ratio: 0.15\n"))
    # a scheduler that counts on running requests stopping early (SGLang's new-token ratio, 0.7 x 0.1) admits more
    # than the pool holds once they do not: the retraction test's memory pressure
    server = start_server(d / "server.log", "--chunkcache-config", str(config), "--max-total-tokens", str(POOL),
                          "--schedule-conservativeness", "0.1")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model)


@pytest.fixture(scope="module")
def rag(tokenizer):
    return Rag(tokenizer, n_docs=6, words=60)


def body(ids, spans=None, *, n=16, sampling=None, **payload) -> dict:
    out = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, **(sampling or {})}}
    if spans is not None:
        out["kv_hints"] = hints(spans, **payload)
    return out


def generate(srv, ids, spans=None, **kwargs):
    r = requests.post(srv.url + "/generate", json=body(ids, spans, **kwargs), timeout=900)
    assert r.status_code == 200, r.text
    return r.json()


def report(out) -> dict:
    return out["meta_info"]["chunkcache"]


def kv_pool(srv) -> dict:
    return requests.get(srv.url + "/server_info", timeout=60).json()["internal_states"][0]["chunkcache"]["kv_pool"]


def pool_total(srv) -> int:
    p = kv_pool(srv)
    return p["available"] + p["evictable"] + p["protected"]


def settled_pool(srv, idle: int, timeout: float = 120) -> dict:
    """The pool once every slot is back (available + evictable + protected == `idle`, nothing protected), or as it
    is after `timeout` s: a finished request's slots return when the scheduler retires its batch."""
    deadline = time.monotonic() + timeout
    while True:
        p = kv_pool(srv)
        if (p["available"] + p["evictable"] + p["protected"] == idle and p["protected"] == 0) \
                or time.monotonic() > deadline:
            return p
        time.sleep(0.5)


# ---- constrained decoding ---------------------------------------------------------------------------------------------

REGEX = r"The code of document [0-9] is [0-9]{4}\."
SCHEMA = {"type": "object", "properties": {"document": {"type": "string", "pattern": "^[0-9]$"},
                                           "code": {"type": "string", "pattern": "^[0-9]{4}$"}},
          "required": ["document", "code"], "additionalProperties": False}
CONSTRAINTS = {"regex": (REGEX, lambda text: re.fullmatch(REGEX, text) is not None),
               "json_schema": (json.dumps(SCHEMA),
                               lambda text: set(json.loads(text)) == {"document", "code"}
                               and re.fullmatch(r"[0-9]{4}", json.loads(text)["code"]) is not None)}


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_constrained_decoding_of_a_blended_request(srv, rag, kind):
    """Greedy under the grammar: the blend's answer is the full computation's, token for token, and matches the
    constraint; reordered at the server's ratio (stored chunks reused) it still matches it."""
    constraint, conforms = CONSTRAINTS[kind]
    sampling, namespace = {kind: constraint}, f"constrained-{kind}"
    ids, spans = rag.build([0, 1, 2, 3], "What is the code of document 2? Answer with the document and its code.")
    full = generate(srv, ids, spans, n=40, sampling=sampling, selector="full", namespace=namespace)
    assert report(full)["exact"] is True and conforms(full["text"]), full["text"]
    blended = generate(srv, ids, spans, n=40, sampling=sampling, selector="epic", ratio=1.0, namespace=namespace)
    info = report(blended)
    assert info["selector"] == "epic" and info["chunk_misses"] == 4 and "fallback" not in info, info
    assert blended["output_ids"] == full["output_ids"], (blended["text"], full["text"])
    ids, spans = rag.build([3, 1, 0, 2], "What is the code of document 1? Answer with the document and its code.")
    reused = generate(srv, ids, spans, n=40, sampling=sampling, namespace=namespace)
    info = report(reused)
    assert info["chunk_hits"] == 4 and info["reused_tokens"] > 0 and "fallback" not in info, info
    assert conforms(reused["text"]), reused["text"]


# ---- parallel sampling -----------------------------------------------------------------------------------------------

def test_parallel_sampling_of_a_blended_request(srv, rag):
    """n = 2, greedy: every copy is the full computation's answer and carries a report. SGLang runs a request of
    n > 1 as a prefix request (max_new_tokens 0; it blends, and its report goes to no client) and then the n copies,
    whose whole prompt the radix tree's hinted partition then holds: each copy reports that round (nothing to blend,
    every prompt token but the last the tree's)."""
    ids, spans = rag.build([2, 4, 1], "What is the code of document 4?")
    full = generate(srv, ids, spans, selector="full", namespace="parallel")
    outs = generate(srv, ids, spans, sampling={"n": 2}, selector="epic", ratio=1.0, namespace="parallel")
    assert isinstance(outs, list) and len(outs) == 2
    for out in outs:
        assert out["output_ids"] == full["output_ids"], (out["text"], full["text"])
        info = report(out)
        assert info["selector"] == "epic" and info["radix_tokens"] == len(ids) - 1 and "fallback" not in info, info
    # at the server's ratio the prefix request reuses the stored chunks; both copies decode from that KV and agree
    ids, spans = rag.build([1, 2, 4], "What is the code of document 1?")
    outs = generate(srv, ids, spans, sampling={"n": 2}, namespace="parallel")
    assert len(outs) == 2 and outs[0]["output_ids"] == outs[1]["output_ids"]
    assert all(report(out)["radix_tokens"] == len(ids) - 1 for out in outs), [report(out) for out in outs]


# ---- abort -----------------------------------------------------------------------------------------------------------

def test_aborting_a_request_in_the_middle_of_its_blend_leaks_nothing(srv, tokenizer):
    """A long blended request (chunks never seen: its fill computes ~1,500 tokens) is aborted through SGLang's
    /abort_request while its blend runs, and another once it decodes. Each ends as aborted; then every KV slot is
    back (available + evictable + protected at its idle value), and the server still answers a blended request as
    the full computation does."""
    idle = pool_total(srv)
    big = Rag(tokenizer, n_docs=12, words=100, seed=7)
    ids, spans = big.build(list(range(12)), "What is the code of document 5?")
    assert 1200 < len(ids) < POOL - 400

    def send(rid, namespace, stream=False):
        payload = {**body(ids, spans, n=300, sampling={"ignore_eos": True}, selector="epic", namespace=namespace),
                   "rid": rid, "stream": stream}
        return requests.post(srv.url + "/generate", json=payload, timeout=900, stream=stream)

    def abort(rid):
        requests.post(srv.url + "/abort_request", json={"rid": rid}, timeout=60).raise_for_status()

    # in the blend: the abort reaches the scheduler while it runs the request's blended prefill (seconds: 12 chunks
    # computed), which handles it between forwards, once the blend has returned: the report says the blend ran, and
    # at most one decode step followed it
    landed = None
    for attempt, delay in enumerate((0.3, 0.6, 1.2, 2.4)):
        rid, result = uuid.uuid4().hex, {}
        thread = threading.Thread(target=lambda: result.update(r=send(rid, f"abort-blend-{attempt}")))
        thread.start()
        time.sleep(delay)
        abort(rid)
        thread.join(900)
        out = result["r"].json()
        assert out["meta_info"]["finish_reason"]["type"] == "abort", out["meta_info"]
        if out["meta_info"]["completion_tokens"] <= 2 and "stages_s" in out["meta_info"].get("chunkcache", {}):
            landed = out
            break
    assert landed is not None, "no abort landed during a blend (each came before the prefill or after decoding)"
    assert report(landed)["chunk_misses"] == 12, report(landed)

    # while it decodes: aborted once its first tokens are streamed
    rid = uuid.uuid4().hex
    with send(rid, "abort-decode", stream=True) as r:
        lines = (line for line in r.iter_lines(decode_unicode=True) if line.startswith("data:") and "[DONE]" not in line)
        first = json.loads(next(lines)[5:])
        assert "stages_s" in report(first), report(first)
        abort(rid)
        last = first
        for line in lines:
            last = json.loads(line[5:])
    assert last["meta_info"]["finish_reason"]["type"] == "abort", last["meta_info"]
    assert last["meta_info"]["completion_tokens"] < 300

    pool = settled_pool(srv, idle)
    assert pool["protected"] == 0 and pool["available"] + pool["evictable"] == idle, (pool, idle)
    ids, spans = big.build([5, 1, 9], "What is the code of document 9?")
    full = generate(srv, ids, spans, selector="full", namespace="after-abort")
    blended = generate(srv, ids, spans, selector="epic", ratio=1.0, namespace="after-abort")
    assert blended["output_ids"] == full["output_ids"] and report(blended)["selector"] == "epic"


# ---- retraction under memory pressure --------------------------------------------------------------------------------

def test_a_blended_request_retracted_under_memory_pressure_answers_as_the_full_computation(srv, tokenizer):
    """Blended requests arriving one after another are admitted on SGLang's estimate that running requests stop
    early (the server's conservativeness); they do not (`min_new_tokens`), so their KV outgrows the pool and SGLang
    retracts some: KV freed, prompt and output prefilled again later, which the blend computes in full and says so.
    Every answer is still the one the same request gets with `selector: full` (those computed in small batches that
    fit the pool: no retraction)."""
    idle = pool_total(srv)
    rag8 = Rag(tokenizer, n_docs=8, words=60, seed=11)
    prompts = [rag8.build(order, f"What is the code of document {order[0]}?")
               for order in ([0, 1, 2], [3, 4, 5], [6, 7, 0], [1, 3, 5], [2, 4, 6], [7, 5, 3])]
    n = 150
    assert sum(len(ids) + n for ids, _ in prompts) > 1.2 * POOL

    def run(indices, gap=0.0, **payload):
        outs = {}

        def one(i):
            ids, spans = prompts[i]
            outs[i] = generate(srv, ids, spans, n=n, sampling={"min_new_tokens": n}, **payload)

        threads = [threading.Thread(target=one, args=(i,)) for i in indices]
        for t in threads:
            t.start()
            time.sleep(gap)
        for t in threads:
            t.join(900)
        return outs

    want = {**run([0, 1, 2], selector="full", namespace="retract"), **run([3, 4, 5], selector="full", namespace="retract")}
    assert all(out["meta_info"]["num_retractions"] == 0 for out in want.values())
    outs = run(range(len(prompts)), gap=0.5, selector="epic", ratio=1.0, namespace="retract-blended")
    retracted = [i for i, out in outs.items() if out["meta_info"]["num_retractions"] > 0]
    assert retracted, "no request was retracted: the pool was not short"
    for i in retracted:  # its prefill after the retraction, prompt and output: computed in full, and said so
        info = report(outs[i])
        assert info["fallback"] == "partial_prefill" and "stages_s" in info["rounds"][0], info
    for i, out in outs.items():
        assert out["output_ids"] == want[i]["output_ids"], (i, out["meta_info"]["num_retractions"])
    pool = settled_pool(srv, idle)
    assert pool["protected"] == 0 and pool["available"] + pool["evictable"] == idle, (pool, idle)
