"""The online audit in a live server (config `audit`, sglang_patch/scheduler/audit.py): every blended request is
recomputed in full while the server is idle, against the logits it was served from.

The server is started with a deliberately wrong estimator: `audit.margin: 0.01` serves every fidelity estimate at
1/100 of what the coefficients say, so the KL it promises is far below what its blends measure. The audit must see
that in /metrics (the unsafe-served rate above the 10 % promise), widen the margin (gauge, WARNING line, and the
estimates the reports carry: the first prompt served again reports its first estimate times the margin's growth),
and the window after the last widening must be back within the promise.

Oracles outside the audit: each blended prompt is also sent with `exact: true` (SGLang's own prefill, nothing
reused): the audit's greedy agreement must be whether the blend's first token is that exact request's, and its
measured KL at least the lower bound the exact request's top-20 first-token logprobs and the blend's logprobs of the
same tokens give (log-sum inequality). And a request that arrives while audits wait is served before they drain:
the scheduler runs one audit per idle turn and takes new requests between them."""

import itertools
import json
import math
import time

import pytest
import requests
import yaml
from conftest import Rag, hints, metric, start_server, with_test_defaults
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow

WINDOW = 3  # 10 % of 3 is 0: one request over its bound breaks the promise
MARGIN = 0.01  # the wrong estimator: every estimate served at 1/100 of the fitted one
KEEP = 8
TOP = 20  # first-token logprobs the KL lower bound reads
MAX_REQUESTS = 12  # the widening phase gives up after this many blended requests


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return AutoTokenizer.from_pretrained(default_model)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("audit")
    # mix measuring each request's deviation in the request: a prompt's estimate depends on the prompt alone, not
    # on which chunks' deviations earlier requests stored, so the same prompt served again shows the margin's change
    config = {"audit": {"rate": 1.0, "window": WINDOW, "keep": KEEP, "margin": MARGIN,
                        "cases": str(tmp / "cases.jsonl"), "keep_prompts": True},
              "select": {"options": {"mix": {"stored_deviation": False}}}}
    path = tmp / "audit.yaml"
    path.write_text(with_test_defaults(yaml.safe_dump(config)))
    srv = start_server(tmp / "server.log", "--enable-metrics", "--chunkcache-config", str(path))
    srv.cases = tmp / "cases.jsonl"
    yield srv
    srv.stop()


def generate(server, ids, **extra) -> dict:
    r = requests.post(server.url + "/generate", timeout=300, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def audited(server) -> int:
    return int(metric(server, "chunkcache_audit_requests_total"))


def wait_audited(server, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while audited(server) < n:
        assert time.monotonic() < deadline, f"{audited(server)} of {n} requests audited after {timeout} s"
        time.sleep(0.1)


def cases(server) -> dict[str, dict]:
    """The audited cases the server wrote (audit.cases), by request id."""
    lines = server.cases.read_text().splitlines() if server.cases.exists() else []
    return {c["rid"]: c for c in map(json.loads, lines)}


def kl_lower_bound(full: list, served: list) -> float:
    """KL(full || served) is at least its sum over the tokens `full` lists plus the two leftover masses' term (the
    log-sum inequality). `full`: (logprob, id, _) of the exact request's top tokens; `served`: the blend's logprobs
    of the same ids."""
    q = {tid: lp for lp, tid, _ in served}
    p_mass = sum(math.exp(lp) for lp, _, _ in full)
    q_mass = sum(math.exp(q[tid]) for _, tid, _ in full)
    bound = sum(math.exp(lp) * (lp - q[tid]) for lp, tid, _ in full)
    if p_mass < 1 and q_mass < 1:
        bound += (1 - p_mass) * math.log((1 - p_mass) / (1 - q_mass))
    return bound


def flush(server) -> None:
    """Empty the radix tree (the chunk store stays); SGLang refuses while it still holds the request just answered."""
    deadline = time.monotonic() + 60
    while requests.post(server.url + "/flush_cache", timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "the server kept refusing /flush_cache"
        time.sleep(0.1)


def blended_and_exact(server, rag: Rag, order) -> tuple[dict, dict, list[int], list]:
    """The prompt of `order`, first computed exactly (its top first-token logprobs), then blended (its logprobs of
    those tokens); and the prompt's ids and hinted spans."""
    ids, spans = rag.build(order, "What is the code of document 1?")
    exact = generate(server, ids, kv_hints=hints(spans, exact=True), return_logprob=True, top_logprobs_num=TOP)
    top = exact["meta_info"]["output_top_logprobs"][0]
    blended = generate(server, ids, kv_hints=hints(spans), return_logprob=True,
                       token_ids_logprob=[tid for _, tid, _ in top])
    assert "fallback" not in blended["meta_info"]["chunkcache"], blended["meta_info"]["chunkcache"]
    return blended, exact, ids, spans


def check_against_exact(case: dict, blended: dict, exact: dict, ids: list[int], spans) -> None:
    """The audit's measurement of one request against SGLang's own prefill of its prompt, and the prompt it kept
    (audit.keep_prompts): the request's ids, each chunk it reused inside one of the hinted spans."""
    assert case["prompt_ids"] == ids and case["chunk_spans"]
    assert all(any(hs <= s < e <= he for hs, he in spans) for s, e in case["chunk_spans"]), (case["chunk_spans"], spans)
    assert case["agree"] == (blended["output_ids"][0] == exact["output_ids"][0]), case
    full = exact["meta_info"]["output_top_logprobs"][0]
    served = blended["meta_info"]["output_token_ids_logprobs"][0]
    # the exact request's prefill and the audit's full recompute run other attention kernels: a little slack
    assert case["kl"] >= kl_lower_bound(full, served) - 0.02, (case, kl_lower_bound(full, served))
    assert case["estimated_kl"] == pytest.approx(blended["meta_info"]["chunkcache"]["fidelity"]["kl"], rel=1e-4,
                                                 abs=1e-6)


def test_a_wrong_estimator_is_caught_and_the_margin_widens_until_the_promise_holds(server, tokenizer):
    rag = Rag(tokenizer, n_docs=4, words=50, seed=3)
    orders = itertools.permutations(range(4))
    first = next(orders)
    orders = itertools.chain([first], orders)
    margins, unsafe, rids = [], [], []  # after each audited request
    caught = stable = False
    for i in range(MAX_REQUESTS):
        blended, exact, ids, spans = blended_and_exact(server, rag, next(orders))
        wait_audited(server, i + 1)
        rids.append(blended["meta_info"]["id"])
        check_against_exact(cases(server)[rids[-1]], blended, exact, ids, spans)
        margins.append(metric(server, "chunkcache_audit_margin"))
        unsafe.append(metric(server, "chunkcache_audit_unsafe_total"))
        if not caught and margins[-1] > MARGIN:
            # the wrong estimator caught: an unsafe-served rate past the promise in /metrics, the margin widened
            # (a window of 3 allows no request over its bound), and said so
            caught = True
            assert unsafe[-1] / (i + 1) > 0.1 and metric(server, "chunkcache_audit_unsafe_share") > 0.1
            assert f"the fidelity margin widens from {MARGIN:g}" in server.log_path.read_text()
        assert caught or unsafe[-1] == 0  # no request over its bound goes without a widening
        stable = caught and len(margins) > WINDOW and len(set(margins[-WINDOW - 1:])) == 1
        if stable:
            break
    assert caught, f"{MAX_REQUESTS} requests served at 1/{1 / MARGIN:g} of their estimates, none over its bound"
    assert stable, f"the margin was still widening after {MAX_REQUESTS} requests: {margins}"
    # the window after the last widening: no request over its bound (10 % of 3 is 0), by /metrics' counters
    assert unsafe[-1] - unsafe[-WINDOW - 1] == 0, unsafe
    assert metric(server, "chunkcache_audit_unsafe_share") <= 0.1
    assert {c["margin"] for c in list(cases(server).values())[-WINDOW:]} == {margins[-1]}
    # the widened margin is what the blends serve: the first prompt again (its chunks now stored, its estimate's
    # signals the same) reports its first estimate times the margin's growth
    flush(server)
    again = generate(server, rag.build(first, "What is the code of document 1?")[0],
                     kv_hints=hints(rag.build(first, "What is the code of document 1?")[1]))
    estimated = again["meta_info"]["chunkcache"]["fidelity"]["kl"]
    assert estimated == pytest.approx(cases(server)[rids[0]]["estimated_kl"] * margins[-1] / MARGIN, rel=1e-3)
    assert metric(server, "chunkcache_audit_seconds_total") > 0


def test_a_request_arriving_while_audits_wait_is_served_before_they_drain(server, tokenizer):
    rag = Rag(tokenizer, n_docs=4, words=50, seed=4)
    orders = itertools.permutations(range(4))
    before = audited(server)
    queued = 4
    for _ in range(queued):  # back to back: the scheduler is never idle 0.5 s between them, so all four wait
        ids, spans = rag.build(next(orders), "What is the code of document 2?")
        generate(server, ids, kv_hints=hints(spans))
    wait_audited(server, before + 1)  # the audits have started
    at_send = audited(server)
    ids, spans = rag.build(next(orders), "What is the code of document 3?")
    generate(server, ids, kv_hints=hints(spans))
    at_answer = audited(server)
    # at most the audit running when it arrived (and one started between the count's read and the send) ran first
    assert at_answer <= at_send + 2, (before, at_send, at_answer)
    assert at_answer < before + queued, "the waiting audits all ran before the request was served"
    wait_audited(server, before + queued + 1)  # and then every one, the late request's too


def test_the_audited_prompts_feed_calibrate(server, tmp_path, capsys):
    """audit.keep_prompts: the cases file is what `chunkcache calibrate --served` measures. The tiny llama shares the
    default model's tokenizer, so it fits on the served prompts in seconds (no answers: no needle column)."""
    from chunkbench.quality import calibration
    from chunkcache.models import tiny_model

    kept = [c for c in cases(server).values() if "prompt_ids" in c]
    assert len(kept) >= 5, f"{len(kept)} audited cases kept their prompt"
    parsed = calibration.served_cases(server.cases, limit=len(kept))
    for case, served in zip(kept, parsed):
        prefix, chunks, query = served.parts
        assert prefix + sum(chunks, []) + query == case["prompt_ids"]
        assert [len(prefix) + sum(map(len, chunks[:i])) for i in range(len(chunks))] == \
            [s for s, _ in case["chunk_spans"]]
    work, out = tmp_path / "work", tmp_path / "fidelity.json"
    assert calibration.main(["--model", str(tiny_model("llama", initializer_range=0.1)), "--served",
                             str(server.cases), "--cases", "5", "--covers", "4", "--threads", "1", "--workdir",
                             str(work), "--out", str(out)]) == 0
    lines = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| served |")]
    assert len(lines) == len(calibration.ANSWER_BOUNDS) and all(cells[3].strip() == "3" for cells in lines)
    assert all(cells[10].strip() == "" for cells in lines)  # needle / full's: nobody knows a served answer
    rows = [json.loads(line) for line in (work / "served.jsonl").read_text().splitlines()[1:]]
    assert len(rows) == 5 * len(calibration.RATIOS) and all(r["contains"] is None and r["f1"] is None for r in rows)
    assert json.loads(out.read_text())["models"]


def test_the_audit_measures_the_answer_the_client_read(server, tokenizer):
    """The shipped estimator covers 16 answer tokens: a blended request answering 5 is audited over those 5 (the
    logits of each decode step kept, the answer teacher-forced in the full recompute), its KL at least the first
    token's against SGLang's own prefill."""
    rag = Rag(tokenizer, n_docs=4, words=50, seed=5)
    ids, spans = rag.build([2, 0, 3, 1], "What is the code of document 0?")
    generate(server, ids, kv_hints=hints(spans))  # stores the chunks
    flush(server)
    ids, spans = rag.build([3, 1, 2, 0], "What is the code of document 0?")
    exact = generate(server, ids, kv_hints=hints(spans, exact=True), return_logprob=True, top_logprobs_num=TOP)
    top = exact["meta_info"]["output_top_logprobs"][0]
    before = audited(server)
    r = requests.post(server.url + "/generate", timeout=300, json={
        "input_ids": ids, "kv_hints": hints(spans), "return_logprob": True,
        "token_ids_logprob": [tid for _, tid, _ in top],
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    blended = r.json()
    report = blended["meta_info"]["chunkcache"]
    assert "fallback" not in report and report["fidelity"]["covers"] == 16, report
    rid, deadline = blended["meta_info"]["id"], time.monotonic() + 120
    while rid not in cases(server):  # the storing request may be audited first
        assert time.monotonic() < deadline, f"request {rid} not audited after 120 s ({audited(server) - before} were)"
        time.sleep(0.1)
    case = cases(server)[rid]
    assert case["answer_tokens"] == len(blended["output_ids"]) == 5 and case["covers"] == 16, case
    served = blended["meta_info"]["output_token_ids_logprobs"][0]
    assert case["kl"] >= kl_lower_bound(top, served) - 0.02, (case, kl_lower_bound(top, served))
