"""The request contract and observability on a live `chunkcache serve` (the session's shared `server` fixture)."""

import pytest
import requests

from chunkcache.blend import round_report
from chunkcache.hints import ACTION_TYPE
from conftest import metric

pytestmark = pytest.mark.slow

GREEDY = {"max_new_tokens": 4, "temperature": 0}
CHUNKS = ["The river Vell flows north through the town of Amber.\n\n",
          "Amber's market opens every Tuesday at dawn.\n\n"]
QUESTION = "Question: on which day does the market open?\nAnswer:"
REPORT_KEYS = {"chunk_hits", "chunk_misses", "reused_tokens", "recomputed_tokens", "selector", "ratio", "select_s",
               "blend_s"}


def kv_hints(payload, *extra_actions):
    actions = [*extra_actions, {"action_id": "c1", "action_type": ACTION_TYPE, "action_version": "1",
                                "payload": payload}]
    return {"protocol_version": "1", "message_id": "m1", "actions": actions}


def rag_prompt(chunks=CHUNKS):
    """The prompt text and each chunk's character span, as a client assembling it would compute them."""
    text, spans = "Answer from the passages.\n\n", []
    for chunk in chunks:
        spans.append([len(text), len(text) + len(chunk)])
        text += chunk
    return text + QUESTION, spans


def generate(server, **body):
    return requests.post(server.url + "/generate", json={"sampling_params": GREEDY, **body}, timeout=600)


@pytest.mark.parametrize("body, message", [
    ({"input_ids": [1, 2, 3, 4], "kv_hints": kv_hints({"token_spans": [[0, 4]]})},
     "token_spans[0] = [0, 4] contains the last prompt token (index 3)"),
    ({"input_ids": [1, 2, 3, 4], "kv_hints": kv_hints({"token_spans": [[0, 2], [1, 3]]})},
     "token_spans[1] = [1, 3] starts at 1, before the end 2 of token_spans[0]"),
    ({"input_ids": [1, 2, 3, 4], "kv_hints": kv_hints({"token_spans": [[0, 2]], "ratio": 2})},
     "ratio must be in [0, 1], got 2"),
    ({"text": "Hello world, hello.", "kv_hints": kv_hints({"char_spans": [[0, 8]]})},
     "char_spans[0] = [0, 8]: end offset 8 falls inside token"),
    ({"text": "Hello world, hello.", "kv_hints": kv_hints({"token_spans": [[0, 1]]})},
     "token_spans is for an input_ids request"),
    ({"input_ids": [1, 2, 3, 4], "kv_hints": kv_hints({"token_spans": [[0, 1]]}, {
        "action_id": "c0", "action_type": ACTION_TYPE, "action_version": "1", "payload": {}})},
     "2 chunkcache.chunks actions"),
])
def test_malformed_hint_is_a_400_and_the_server_keeps_serving(server, body, message):
    r = generate(server, **body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    ok = generate(server, text="The capital of France is")
    assert ok.status_code == 200 and ok.json()["text"]


def test_char_spans_request_is_served(server):
    text, spans = rag_prompt()
    r = generate(server, text=text, kv_hints=kv_hints({"char_spans": spans, "selector": "epic", "ratio": 1.0}))
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] > 0


def test_hinted_request_reports_chunk_reuse(server):
    """meta_info["chunkcache"] is the round the blend reports on the scheduler's Req (sglang_patch/scheduler/report.py).
    The chunks in another order than above, so the radix tree cannot serve the whole prompt as an exact prefix."""
    text, spans = rag_prompt(CHUNKS[::-1])
    # its own namespace: its chunks are missing, so it blends (to store them) whatever the blend-or-full prediction
    r = generate(server, text=text, kv_hints=kv_hints({"char_spans": spans, "selector": "epic", "ratio": 1.0,
                                                       "namespace": "report"}))
    report = r.json()["meta_info"].get("chunkcache")
    assert report is not None, "the blend did not report on a hinted request (did it run?)"
    assert REPORT_KEYS <= set(report) and report["selector"] == "epic"
    assert round_report.validate(report) == "blended"  # docs/report-schema.md, as a client receives it
    assert report["chunk_hits"] + report["chunk_misses"] == len(CHUNKS)


def test_plain_request_has_no_report(server):
    r = generate(server, text="The capital of France is")
    assert r.status_code == 200 and "chunkcache" not in r.json()["meta_info"]


def test_metrics_exposed(server):
    """chunkcache's series sit beside SGLang's on /metrics under the same model_name label, the served model's."""
    generate(server, text=rag_prompt()[0], kv_hints=kv_hints({"char_spans": rag_prompt()[1]}))  # chunks stored
    model = f'model_name="{requests.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]}"'
    assert metric(server, "sglang:prompt_tokens_total", f"{{{model}}}") > 0
    assert sum(metric(server, name, f"{{{model}}}") for name in ("chunkcache_chunk_hits_total",
                                                                  "chunkcache_chunk_misses_total")) > 0
    # the store's own updates (ChunkStore on_change, wired in sglang_patch.scheduler.cache)
    assert metric(server, "chunkcache_store_bytes", f'{{{model},tier="host"}}') > 0
