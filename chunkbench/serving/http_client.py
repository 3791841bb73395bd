"""One streamed /generate request, timed: TTFT is the arrival of the first streamed chunk (the first token).

Streamed chunks carry the cumulative text; `meta_info["chunkcache"]` (the blend's report) comes with the first
chunk only, so it is picked up wherever it appears. A hinted request whose whole prompt is an exact radix hit in its
namespace is not blended and has no report."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import requests


@dataclass
class Outcome:
    ttft_s: float
    latency_s: float
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # radix-cache hits (exact prefix)
    report: dict | None  # meta_info["chunkcache"], None for stock or unblended requests
    output_ids: tuple[int, ...] = ()  # the generated token ids

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first over the time after the first."""
        decode = self.latency_s - self.ttft_s
        return (self.completion_tokens - 1) / decode if decode > 0 and self.completion_tokens > 1 else float("nan")


def fell_back(report: dict | None) -> bool:
    """The server computed a hinted prompt (or part of it) in full instead of blending it: a `fallback` in its
    report, a non-empty `fallbacks` list, or a `rounds` entry (one per prefill round) with a `fallback`."""
    report = report or {}
    return ("fallback" in report or bool(report.get("fallbacks"))
            or any("fallback" in entry for entry in report.get("rounds") or ()))


def generate(url: str, input_ids: list[int], max_new_tokens: int, kv_hints: dict | None = None,
             timeout: float = 1800, *, ignore_eos: bool = False) -> Outcome:
    """`ignore_eos`: exactly max_new_tokens tokens, so both sides of a throughput comparison decode the same."""
    body: dict = {"input_ids": input_ids, "stream": True,
                  "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": ignore_eos}}
    if kv_hints is not None:
        body["kv_hints"] = kv_hints
    t0 = time.perf_counter()
    ttft, last, report = None, None, None
    for chunk in _streamed(url, "/generate", body, timeout):
        ttft = ttft if ttft is not None else time.perf_counter() - t0
        report = report or chunk["meta_info"].get("chunkcache")
        last = chunk
    if last is None:
        raise RuntimeError(f"{url}/generate streamed no output")
    meta = last["meta_info"]
    return Outcome(ttft, time.perf_counter() - t0, last["text"], meta["prompt_tokens"], meta["completion_tokens"],
                   meta.get("cached_tokens", 0), report, tuple(last.get("output_ids") or ()))


def chat(url: str, body: dict, timeout: float = 1800) -> Outcome:
    """One streamed /v1/chat/completions request (greedy unless `body` says otherwise), timed like `generate`: TTFT
    is the first chunk carrying generated text; the report is the `chunkcache` of the chunk that finishes the answer."""
    body = {"model": "default", "temperature": 0, **body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage, report = None, "", {}, None
    for chunk in _streamed(url, "/v1/chat/completions", body, timeout):
        for choice in chunk.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text += piece
        usage = chunk.get("usage") or usage
        report = chunk.get("chunkcache") or report
    latency = time.perf_counter() - t0
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(latency if ttft is None else ttft, latency, text, usage.get("prompt_tokens", 0),
                   usage.get("completion_tokens", 0), details.get("cached_tokens") or 0, report)


def _streamed(url: str, path: str, body: dict, timeout: float):
    """The JSON chunks of a streamed (server-sent events) answer, as they arrive; an HTTP error or a streamed error
    raises."""
    with requests.post(url + path, json=body, stream=True, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}{path} answered {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}{path} streamed an error: {chunk['error']}")
            yield chunk


def scored(url: str, input_ids: list[int], logprob_start: int, top_logprobs: int, token_ids: list[int] | None = None,
           kv_hints: dict | None = None, timeout: float = 1800) -> dict:
    """The meta_info of a one-token greedy /generate (not streamed) that returns SGLang's logprobs of the input
    positions from `logprob_start` on: `input_top_logprobs` (the top `top_logprobs` per position) and, for
    `token_ids`, `input_token_ids_logprobs`; entry i describes the token at logprob_start + i given those before
    it (entry 0 is None: its distribution would come from the position before logprob_start). Prefix matching stops
    at `logprob_start`, so every position from there on is computed by this request."""
    body: dict = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                  "return_logprob": True, "logprob_start_len": logprob_start, "top_logprobs_num": top_logprobs}
    if token_ids:
        body["token_ids_logprob"] = token_ids
    if kv_hints is not None:
        body["kv_hints"] = kv_hints
    r = requests.post(url + "/generate", json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"{url}/generate answered {r.status_code}: {r.text[:500]}")
    return r.json()["meta_info"]


def flush_cache(url: str, wait_s: float = 120) -> None:
    """Empty the server's radix tree (the chunk store is kept): later requests cannot exact-match earlier ones.
    The scheduler may still hold a request whose last chunk the client already has: it waits up to wait_s for idle."""
    r = requests.post(url + "/flush_cache", params={"timeout": wait_s}, timeout=wait_s + 60)
    if r.status_code != 200:
        raise RuntimeError(f"{url}/flush_cache answered {r.status_code}: {r.text[:300]}")


def drain(url: str, timeout_s: float = 600.0) -> None:
    """Wait until the server at `url` has done its idle work: the deviations its requests estimated measured, the
    paragraphs they taught it encoded."""
    wait_measured(lambda: requests.get(url + "/server_info", timeout=30).json(), timeout_s)


def wait_measured(server_info: Callable[[], dict], timeout_s: float = 600.0) -> None:
    """Wait until `server_info()` (SGLang's /server_info) shows no idle work left (deviations to measure, paragraphs
    to encode, audits to run), so that no timed request shares the cores with it."""
    deadline = time.monotonic() + timeout_s
    while any((state := server_info()["internal_states"][0]["chunkcache"]).get(k)
              for k in ("deferred_deviations", "encodes_waiting", "audits_waiting")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"idle work still waiting after {timeout_s} s: {state}")
        time.sleep(0.2)
