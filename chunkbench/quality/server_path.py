"""The server side of `chunkcache eval`: a live chunkcache server (SGLang with chunk reuse), over HTTP only.

Full recompute is a request without hints: stock SGLang's own prefill on the same server. Each (selector, rho) runs
in its own namespace, so no request is an exact radix hit on another configuration's prompt.

Teacher forcing: after a blended answer, the same hints with input_ids = prompt + full's answer and logprobs from the
last prompt token on. SGLang stops prefix matching where logprobs start, so the radix tree, which holds the blended
prompt in this namespace since the answer request, supplies the blended KV of all but the last prompt token; the
rest (last prompt token, full's answer) is an ordinary extend attending to it: the blended prompt, teacher-forced.
(chunkcache does not blend a request that asks for input logprobs: it is counted as an `input_logprobs` fallback, a
plain prefill of what the radix tree did not match.) Had the tree evicted the blended prompt in between, that prefill would
be full recompute: the request's cached_tokens shows it, and the row is refused rather than mismeasured.
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkcache.prompt import RagPrompt
from ..serving.http_client import generate, scored
from ..workloads import Item, to_request
from . import fidelity_measures


def server_runs(selectors: list[str]) -> list[tuple[str, str, dict]]:
    """(label, selector, options) per selector, as reference_path.selector_runs; a server's selector options come
    from its config, not the request."""
    for item in selectors:
        if ":" in item:
            raise ValueError(f"selector {item!r}: on the server path selector options are the server's own "
                             "(select.options in --config)")
    return [(item, item, {}) for item in selectors]


@dataclass
class FullAnswer:
    """Full recompute of one case on the server: what its blends are measured against."""
    prompt: RagPrompt
    continuation: list[int]  # greedy answer token ids
    first: dict[int, float]  # the first answer token's top-k: token id -> logprob


class ServerMeasure:
    """`chunkcache eval` rows of the server path: answer text, teacher-forced agreement and first-token KL (top-k
    plus remainder bucket) against full recompute, TTFT and the blend's report."""

    def __init__(self, url: str, tokenizer, max_new_tokens: int, top_logprobs: int):
        self.url = url
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.top_logprobs = top_logprobs

    def full(self, item: Item) -> tuple[FullAnswer, dict]:
        prompt = to_request(self.tokenizer, item).prompt
        ids = prompt.input_ids
        out = generate(self.url, ids, self.max_new_tokens)
        continuation = list(out.output_ids)
        meta = scored(self.url, ids + continuation, len(ids) - 1, self.top_logprobs)
        ref = FullAnswer(prompt, continuation, {t: lp for lp, t, _ in meta["input_top_logprobs"][1]})
        # measured like any blend: a real check of the teacher-forced pass against SGLang's greedy decoding
        return ref, {"text": out.text, "tf_agreement": fidelity_measures.agreement(_argmax(meta), continuation),
                     "kl_first": fidelity_measures.kl_top(ref.first, ref.first), "ttft_s": out.ttft_s,
                     "tokens": out.prompt_tokens, "rho_used": 1.0}

    def blended(self, ref: FullAnswer, name: str, ratio: float, options: dict) -> dict:
        ids = ref.prompt.input_ids
        hints = ref.prompt.kv_hints(selector=name, ratio=ratio, namespace=f"eval-{name}-{ratio}")
        out = generate(self.url, ids, self.max_new_tokens, hints)
        meta = scored(self.url, ids + ref.continuation, len(ids) - 1, 1, list(ref.first), hints)
        if meta.get("cached_tokens", 0) < len(ids) - 1:
            raise RuntimeError(f"teacher forcing found {meta.get('cached_tokens', 0)} of the blended prompt's "
                               f"{len(ids) - 1} tokens in the radix tree: it was evicted after the answer (a KV pool "
                               "too small for one prompt?), and the pass would measure full recompute instead")
        blended_first = {t: lp for lp, t, _ in meta["input_token_ids_logprobs"][1]}
        report = out.report or {}
        context = sum(e - s for s, e in ref.prompt.token_spans)
        reused = report.get("reused_tokens")
        return {"rho_used": None if reused is None else (context - reused) / context,
                "text": out.text, "tf_agreement": fidelity_measures.agreement(_argmax(meta), ref.continuation),
                "kl_first": fidelity_measures.kl_top(ref.first, blended_first), "ttft_s": out.ttft_s,
                "select_s": report.get("select_s"), "blend_s": report.get("blend_s"),
                "recomputed": report.get("recomputed_tokens"), "exact": bool(report.get("exact"))}


def _argmax(meta: dict) -> list[int]:
    """The top token at each teacher-forced position (rows are sorted by logprob)."""
    return [row[0][1] for row in meta["input_top_logprobs"][1:]]
