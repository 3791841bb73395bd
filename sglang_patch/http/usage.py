"""The chunk report on OpenAI-compatible answers (HTTP server process): /v1/chat/completions and /v1/completions.
The request's report (what /generate returns in `meta_info["chunkcache"]`) is a top-level `chunkcache` of the answer,
and its counts are `usage.chunkcache`, beside SGLang's own counts:
  * `chunkcache`, the whole report: on a non-streamed answer, and on the last chunk of a stream that finishes a
    choice (the last with a `finish_reason`). The `openai` package keeps undeclared fields (`answer.chunkcache`,
    `answer.model_extra["chunkcache"]`), and so LlamaIndex's `raw`; a chat answer also has it in
    `metadata.chunkcache` (sglang_patch.http.chat).
  * `usage.chunkcache`, the counts (`COUNTS`, integers; absent for a report that counts nothing: a fallback or a
    private one): in a non-streamed answer's `usage`, and in a stream's usage chunk when there is one. `usage` is
    what every framework hands on (LangChain's `response_metadata["token_usage"]`, LlamaIndex's `raw.usage`), and
    what LangChain's `generate()` over several prompts sums (`_combine_llm_outputs`: integers and dicts of them; a
    float or a string warns, two values of different types raise), so it holds integers only, the same keys on every
    answer: those sums are the prompts' totals.
`usage.prompt_tokens_details.cached_tokens` (with `--enable-cache-report`) stays SGLang's: the radix tree's exact
prefix, never the reused chunk tokens.

A stream is stock's in shape: it ends with a usage chunk (`choices: []`) only when the client asked for usage
(`stream_options.include_usage`, or the server's `--stream-response-default-include-usage`), since a client that did
not ask reads `choices[0]` of every chunk. A stream without a report (a request without chunks) is sent unchanged.

SGLang's response models drop fields they do not declare, so the report is added where each answer is built or
serialized (plugin.hooks):
  * after `_build_chat_response` / `_build_completion_response` (`in_answer`): the answer becomes the same response
    model with the report and a usage model that declares the counts (subclasses: SGLang's Anthropic endpoint reads
    the chat answer as a ChatCompletionResponse). A request of several prompts carries the first one's report, as
    `metadata.chunkcache` does.
  * around `TokenizerManager.generate_request` (`keep_report`): a streamed HTTP request's report, which arrives with
    its first output (sglang_patch.scheduler.report), kept on the request's state for the stream's end;
  * around `_generate_chat_stream` / `_generate_completion_stream` (`in_stream`): the chunks above get it.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pydantic import model_serializer
from sglang.srt.entrypoints.openai.protocol import ChatCompletionResponse, CompletionResponse, UsageInfo

KEY = "chunkcache"  # the answer's key, usage's, meta_info's and a streamed answer's finishing chunk's
STATE = "chunkcache_report"  # the HTTP request's state attribute holding a streamed request's report
# the report's counts that `usage.chunkcache` carries: chunks and tokens, integers that add up over answers
COUNTS = ("chunk_hits", "chunk_misses", "reused_tokens", "recomputed_tokens", "radix_tokens")


def counts(report: dict) -> dict[str, int] | None:
    """The report's COUNTS, or None for a report that counts nothing (a fallback or a private report). A round that
    computed no chunk standalone (an exact or an auto_stock one, which name no `chunk_misses`) missed none: 0."""
    if "chunk_hits" not in report:
        return None
    return {key: report.get(key, 0) for key in COUNTS}


class ReportedUsage(UsageInfo):
    chunkcache: Optional[dict[str, int]] = None

    @model_serializer(mode="wrap")
    def _without_no_counts(self, handler):
        data = handler(self)
        if self.chunkcache is None:
            data.pop(KEY, None)
        return data


class ReportedChatCompletion(ChatCompletionResponse):
    usage: ReportedUsage
    chunkcache: dict[str, Any]


class ReportedCompletion(CompletionResponse):
    usage: ReportedUsage
    chunkcache: dict[str, Any]


REPORTED = {ChatCompletionResponse: ReportedChatCompletion, CompletionResponse: ReportedCompletion}


def in_answer(response, serving, request, ret, *args, **kwargs):
    report = ret[0]["meta_info"].get(KEY) if ret else None
    reported = REPORTED.get(type(response))  # None for an error response SGLang built instead
    if report is None or reported is None:
        return response
    usage = ReportedUsage.model_construct(**dict(response.usage), chunkcache=counts(report))
    return reported.model_construct(**{**dict(response), "usage": usage, KEY: report})


def keep_report(original, manager, obj, request=None):
    outputs = original(manager, obj, request)
    return _keeping_report(outputs, request) if request is not None and getattr(obj, "stream", False) else outputs


async def _keeping_report(outputs, request):
    async for out in outputs:
        # a streamed output is one choice's dict; choice 0's report, as the non-streamed answer's
        if out.get("index", 0) == 0 and KEY in out["meta_info"]:
            setattr(request.state, STATE, out["meta_info"][KEY])
        yield out


async def in_stream(original, serving, adapted_request, request, raw_request=None):
    # a chunk that finishes a choice is held until the next chunk says whether it was the last: a chat stream sends
    # every choice's finishing chunk after generation ended, so holding delays nothing; a text completion of several
    # choices sends one as its choice ends, held until another choice's next chunk
    held_finish = None
    async for chunk in original(serving, adapted_request, request, raw_request):
        finishes = _finishes_a_choice(chunk)
        if held_finish is not None:
            yield held_finish if finishes else _reported(held_finish, raw_request, in_usage=False)
            held_finish = None
        if finishes:
            held_finish = chunk
        else:
            yield _reported(chunk, raw_request, in_usage=True) if _is_usage_chunk(chunk) else chunk
    if held_finish is not None:  # the stream's end also says it was the last
        yield _reported(held_finish, raw_request, in_usage=False)


def _finishes_a_choice(chunk: str) -> bool:
    """Whether a chunk has a choice with a `finish_reason`. SGLang writes each chunk as compact JSON, where a set
    `finish_reason` reads `"finish_reason":"` (text inside a JSON string cannot: its quotes are escaped), so the other
    chunks, most of a stream, are not parsed."""
    if not chunk.startswith("data: {") or '"finish_reason":"' not in chunk:
        return False
    return any(choice.get("finish_reason") for choice in json.loads(chunk.removeprefix("data: ")).get("choices", []))


def _is_usage_chunk(chunk: str) -> bool:
    """Whether a chunk is SGLang's closing usage chunk (no choices, the answer's usage), which it sends only to a
    client that asked for usage; `"usage":{` is in no other chunk but with `continuous_usage_stats`."""
    if not chunk.startswith("data: {") or '"usage":{' not in chunk:
        return False
    return json.loads(chunk.removeprefix("data: ")).get("choices") == []


def _reported(chunk: str, raw_request, in_usage: bool) -> str:
    """The chunk with the request's report's counts as `usage.chunkcache`, or with the report as its own top-level
    `chunkcache`; the chunk unchanged when the request has no report (or, in usage, no counts)."""
    report = getattr(raw_request.state, STATE, None) if raw_request is not None else None
    added = counts(report) if in_usage and report is not None else report
    if added is None:
        return chunk
    payload = json.loads(chunk.removeprefix("data: "))
    (payload["usage"] if in_usage else payload)[KEY] = added
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"
