"""Where an OpenAI-compatible answer carries the chunk report (sglang_patch.http.usage), on answers and streams built
with SGLang's own response models and chunk builders and read back by the `openai` package: the whole report as the
answer's top-level `chunkcache` (a stream's: on the chunk that finishes the answer), its counts as `usage.chunkcache`,
integers LangChain's `generate()` sums over several answers without a warning. A stream whose client did not ask for
usage gets no `choices: []` chunk, so the everyday `"".join(c.choices[0].delta.content or "" for c in stream)` works;
a client that asked for usage also finds the counts in the usage chunk; a stream without a report is SGLang's, byte
for byte."""

import asyncio
from types import SimpleNamespace

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk
from sglang.srt.entrypoints.openai.protocol import (ChatCompletionStreamResponse, CompletionResponseStreamChoice,
                                                    CompletionStreamResponse, UsageInfo)
from sglang.srt.entrypoints.openai.sse_utils import build_sse_content

from sglang_patch.http import usage

REPORT = {"chunk_hits": 3, "chunk_misses": 0, "reused_tokens": 30, "recomputed_tokens": 12, "radix_tokens": 0,
          "ratio": 0.15, "selector": "epic", "stages_s": {"fill": 0.001}}
COUNTS = {"chunk_hits": 3, "chunk_misses": 0, "reused_tokens": 30, "recomputed_tokens": 12, "radix_tokens": 0}
DONE = "data: [DONE]\n\n"
ANSWER = ["The ", "market opens ", "on Tuesday, in Zürich."]


def chat_stream(asked: bool) -> list[str]:
    """A one-choice chat stream as SGLang's _generate_chat_stream writes it: the role, the content, the chunk that
    finishes the choice, the usage chunk when the client asked for usage, [DONE]."""
    meta = {"chunk_id": "chatcmpl-1", "created": 1, "model": "default", "index": 0}
    chunks = [build_sse_content(**meta, role="assistant", content="")]
    chunks += [build_sse_content(**meta, content=piece) for piece in ANSWER]
    chunks.append(build_sse_content(**meta, finish_reason="stop", matched_stop=2))
    if asked:
        counts = UsageInfo(prompt_tokens=40, completion_tokens=6, total_tokens=46)
        closing = ChatCompletionStreamResponse(id="chatcmpl-1", created=1, model="default", choices=[], usage=counts)
        chunks.append(f"data: {closing.model_dump_json()}\n\n")
    return chunks + [DONE]


def completion_chunk(index: int, text: str, finish_reason: str | None = None) -> str:
    """A text completion chunk as SGLang's _generate_completion_stream writes it: one choice's text."""
    choice = CompletionResponseStreamChoice(index=index, text=text, finish_reason=finish_reason)
    chunk = CompletionStreamResponse(id="cmpl-1", created=1, model="default", choices=[choice])
    return f"data: {chunk.model_dump_json()}\n\n"


def through_in_stream(chunks: list[str], report: dict | None) -> list[str]:
    """What in_stream sends for SGLang's `chunks`, the request's state holding `report` (None: the request had none)."""
    async def sglang_stream(serving, adapted_request, request, raw_request):
        for chunk in chunks:
            yield chunk

    async def sent():
        state = SimpleNamespace(**({usage.STATE: report} if report is not None else {}))
        raw_request = SimpleNamespace(state=state)
        return [chunk async for chunk in usage.in_stream(sglang_stream, None, None, None, raw_request)]

    return asyncio.run(sent())


def read_by_openai(chunks: list[str], model=ChatCompletionChunk) -> list:
    """The chunks as the `openai` package's stream hands them to a client."""
    client = openai.OpenAI(base_url="http://127.0.0.1:1/v1", api_key="none")
    body = "".join(chunks).encode()
    return list(openai.Stream(cast_to=model, response=httpx.Response(200, content=body), client=client))


def test_a_stream_that_did_not_ask_for_usage_has_the_report_on_its_finishing_chunk():
    sglang_chunks = chat_stream(asked=False)
    sent = through_in_stream(sglang_chunks, REPORT)
    chunks = read_by_openai(sent)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "".join(ANSWER)
    *answer, finishing = chunks
    assert finishing.choices[0].finish_reason == "stop" and finishing.usage is None
    assert finishing.chunkcache == finishing.model_extra["chunkcache"] == REPORT
    assert not any(c.model_extra for c in answer)
    # only the finishing chunk changed: the others are SGLang's, byte for byte
    assert sent[:-2] == sglang_chunks[:-2] and sent[-1] == DONE and sent[-2] != sglang_chunks[-2]


def test_a_stream_that_asked_for_usage_has_the_report_in_usage_too():
    chunks = read_by_openai(through_in_stream(chat_stream(asked=True), REPORT))
    *answer, finishing, closing = chunks
    assert closing.choices == [] and closing.usage.prompt_tokens == 40
    assert closing.usage.model_extra["chunkcache"] == closing.usage.chunkcache == COUNTS
    assert finishing.choices[0].finish_reason == "stop" and finishing.chunkcache == REPORT
    assert not any(c.model_extra or c.usage for c in answer)


@pytest.mark.parametrize("asked", [False, True])
def test_a_stream_without_a_report_is_sglangs(asked):
    assert through_in_stream(chat_stream(asked), None) == chat_stream(asked)


def test_of_several_choices_only_the_last_to_finish_carries_the_report():
    """Text completions with n=2: choice 0 finishes while choice 1 still streams; the report, the request's (choice
    0's), rides on the last finishing chunk, where a client's loop over the stream has seen every choice end."""
    sglang_chunks = [completion_chunk(0, "Tues"), completion_chunk(1, "Mon"), completion_chunk(0, "day", "stop"),
                     completion_chunk(1, "day in Zürich", "length"), DONE]
    sent = through_in_stream(sglang_chunks, REPORT)
    chunks = read_by_openai(sent, model=Completion)
    assert [(c.choices[0].index, c.choices[0].text) for c in chunks] == [
        (0, "Tues"), (1, "Mon"), (0, "day"), (1, "day in Zürich")]
    assert [c.model_extra.get("chunkcache") for c in chunks] == [None, None, None, REPORT]
    assert sent[:3] == sglang_chunks[:3] and "Zürich" in sent[3]  # its text as SGLang wrote it, not \u-escaped


def answer(report: dict | None, prompt_tokens: int = 40):
    """A chat answer as SGLang's _build_chat_response makes it, through usage.in_answer, as the server sends it."""
    from sglang.srt.entrypoints.openai.protocol import (ChatCompletionResponse, ChatCompletionResponseChoice,
                                                        ChatMessage)

    choice = ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content="Tuesday."),
                                          finish_reason="stop")
    built = ChatCompletionResponse(id="chatcmpl-1", created=1, model="default", choices=[choice], usage=UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=3, total_tokens=prompt_tokens + 3))
    meta = {"chunkcache": report} if report is not None else {}
    return usage.in_answer(built, None, None, [{"meta_info": meta}]).model_dump_json(by_alias=True)


def read_answer(sent: str):
    from openai.types.chat import ChatCompletion

    return ChatCompletion.model_validate_json(sent)


def test_an_answer_has_the_report_and_its_counts_in_usage():
    read = read_answer(answer(REPORT))
    assert read.chunkcache == read.model_extra["chunkcache"] == REPORT
    assert read.usage.chunkcache == COUNTS and read.usage.prompt_tokens == 40
    exact = {"chunk_hits": 0, "reused_tokens": 0, "recomputed_tokens": 40, "radix_tokens": 0, "exact": True,
             "reason": "exact", "selector": "full"}
    assert read_answer(answer(exact)).usage.chunkcache == {**{k: exact[k] for k in COUNTS if k in exact},
                                                           "chunk_misses": 0}
    # a report that counts nothing puts nothing in usage; an answer without a report is SGLang's
    for uncounted in ({"fallback": "bad_hint", "detail": "..."}, {"private": True}):
        read = read_answer(answer(uncounted))
        assert read.chunkcache == uncounted and "chunkcache" not in (read.usage.model_extra or {})
    assert "chunkcache" not in answer(None)


def test_langchain_sums_the_counts_of_several_answers_without_a_warning():
    """ChatOpenAI's generate() over several message lists merges the answers' `usage` with _combine_llm_outputs:
    the counts add up, SGLang's token counts too, and nothing warns, whatever the reports' shapes (a blended one, an
    exact one, one that counts nothing)."""
    import warnings

    from langchain_openai import ChatOpenAI

    exact = {"chunk_hits": 0, "reused_tokens": 0, "recomputed_tokens": 50, "radix_tokens": 4, "exact": True,
             "reason": "exact", "selector": "full"}
    answers = [read_answer(answer(r, n)).model_dump() for r, n in ((REPORT, 40), (exact, 54), ({"private": True}, 9))]
    llm = ChatOpenAI(model="default", api_key="none", base_url="http://127.0.0.1:1/v1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = llm._combine_llm_outputs([llm._create_chat_result(a).llm_output for a in answers])["token_usage"]
    assert merged["prompt_tokens"] == 103 and merged["chunkcache"] == {
        "chunk_hits": 3, "chunk_misses": 0, "reused_tokens": 30, "recomputed_tokens": 62, "radix_tokens": 4}
