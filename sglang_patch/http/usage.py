"""The chunk report in the `usage` of OpenAI-compatible answers (HTTP server process): /v1/chat/completions and
/v1/completions, streamed and not, carry the request's report (what /generate returns in `meta_info["chunkcache"]`)
as `usage.chunkcache`, beside SGLang's own counts. `usage.prompt_tokens_details.cached_tokens` (with
`--enable-cache-report`) stays SGLang's: the radix tree's exact prefix, never the reused chunk tokens. `usage` is where
every framework hands a response's extras on (LangChain's `response_metadata["token_usage"]`, LlamaIndex's
`raw.usage`, the `openai` package's `usage`); LangChain drops SGLang's `sglext` and `metadata`.

SGLang's response models drop fields they do not declare, so the report is added where each answer is built or
serialized (plugin.hooks):
  * after `_build_chat_response` / `_build_completion_response` (`in_answer`): the answer becomes the same response
    model with a usage model that declares `chunkcache` (a subclass: SGLang's Anthropic endpoint reads the chat
    answer as a ChatCompletionResponse). A request of several prompts carries the first one's report, as
    `metadata.chunkcache` does (sglang_patch.http.chat).
  * around `TokenizerManager.generate_request` (`keep_report`): a streamed HTTP request's report, which arrives with
    its first output (sglang_patch.scheduler.report), kept on the request's state for its last chunk;
  * around `_generate_chat_stream` / `_generate_completion_stream` (`in_stream`): the stream ends with SGLang's usage
    chunk (`choices: []`, after every choice finished), which gets the report. A client that did not ask for usage
    (`stream_options.include_usage`, or the server's `--stream-response-default-include-usage`) is sent that chunk
    only when there is a report: SGLang is asked for it always, and it is dropped otherwise, so a stream without a
    report is stock's.
"""

from __future__ import annotations

import json
from typing import Any

from sglang.srt.entrypoints.openai.protocol import (ChatCompletionResponse, CompletionResponse, StreamOptions,
                                                    UsageInfo)
from sglang.srt.entrypoints.openai.utils import should_include_usage
from sglang.srt.runtime_context import get_serving

KEY = "chunkcache"  # usage's key, and meta_info's
STATE = "chunkcache_report"  # the HTTP request's state attribute holding a streamed request's report


class ReportedUsage(UsageInfo):
    chunkcache: dict[str, Any]


class ReportedChatCompletion(ChatCompletionResponse):
    usage: ReportedUsage


class ReportedCompletion(CompletionResponse):
    usage: ReportedUsage


REPORTED = {ChatCompletionResponse: ReportedChatCompletion, CompletionResponse: ReportedCompletion}


def in_answer(response, serving, request, ret, *args, **kwargs):
    report = ret[0]["meta_info"].get(KEY) if ret else None
    reported = REPORTED.get(type(response))  # None for an error response SGLang built instead
    if report is None or reported is None:
        return response
    usage = ReportedUsage.model_construct(**dict(response.usage), chunkcache=report)
    return reported.model_construct(**{**dict(response), "usage": usage})


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
    asked, _ = should_include_usage(request.stream_options, get_serving().stream_response_default_include_usage)
    if not asked:
        request.stream_options = (request.stream_options or StreamOptions()).model_copy(update={"include_usage": True})
    async for chunk in original(serving, adapted_request, request, raw_request):
        closing = _usage_chunk(chunk)
        report = getattr(raw_request.state, STATE, None) if closing is not None and raw_request is not None else None
        if closing is None or (report is None and asked):
            yield chunk
        elif report is not None:
            closing["usage"][KEY] = report
            yield f"data: {json.dumps(closing, separators=(',', ':'))}\n\n"


def _usage_chunk(chunk: str) -> dict | None:
    """The JSON of SGLang's closing usage chunk (no choices, the answer's usage); None for every other chunk. SGLang
    writes each chunk with pydantic's compact JSON, so a chunk without `"usage":{` has no usage and is not parsed (a
    stream is mostly token chunks)."""
    if not chunk.startswith("data: {") or '"usage":{' not in chunk:
        return None
    payload = json.loads(chunk.removeprefix("data: "))
    return payload if payload.get("choices") == [] else None
