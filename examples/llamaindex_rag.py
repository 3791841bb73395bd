"""RAG with LlamaIndex's own packages on a chunkcache server with automatic chunk detection: `OpenAILike` pointed at
the server's /v1 and the query engine of an in-memory `SummaryIndex` (no embedding model: every document goes into the
prompt, in the index's order); the prompt is LlamaIndex's, nothing in it marks the documents.

    .venv/bin/chunkcache serve --auto-chunks                   # server on 127.0.0.1:30000
    .venv/bin/python examples/llamaindex_rag.py http://127.0.0.1:30000

The query engine answers the question over the documents in examples/documents twice, the second time from an index of
them in reverse order (as another retriever's ranking would give them), and prints each answer with the server's chunk
report: the second request (sent once the server has learned the first one's paragraphs) finds the documents'
segments in the chunk store (`chunk_hits`, `reused_tokens`). `--exact`
passes `{"chunkcache": {"exact": true}}` as the OpenAI client's `extra_body` through OpenAILike's `additional_kwargs`:
the server computes those requests with SGLang's own prefill, reusing nothing (`reused_tokens: 0`). The report's
counts are the answer's `usage.chunkcache`, in the `raw` OpenAI response of the LLM's ChatResponse (the whole report
is `raw.chunkcache`); the query engine's response holds only the answer's text, so an instrumentation event handler
keeps the ChatResponse itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llama_index.core import Document, SummaryIndex
from llama_index.core.base.llms.types import ChatResponse
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.llms.openai_like import OpenAILike
from server_state import learned  # examples/server_state.py, beside this script

DOCUMENTS = Path(__file__).resolve().parent / "documents"


class LastChat(BaseEventHandler):
    """The last ChatResponse an LLM returned, from LlamaIndex's instrumentation events."""

    response: ChatResponse | None = None

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent):
            self.response = event.response


def ask(url: str, docs: list[str], question: str, max_tokens: int = 32, exact: bool = False) -> tuple[str, dict]:
    """The query engine's answer over an index of `docs` in this order, and the usage of its chat completion
    (`usage.chunkcache` is the server's chunk report's counts)."""
    llm = OpenAILike(model="default", api_base=url + "/v1", api_key="none", is_chat_model=True, temperature=0,
                     max_tokens=max_tokens,
                     additional_kwargs={"extra_body": {"chunkcache": {"exact": True}}} if exact else {})
    index = SummaryIndex.from_documents([Document(text=d) for d in docs])
    dispatcher, last = get_dispatcher(), LastChat()
    dispatcher.add_event_handler(last)
    try:
        answer = index.as_query_engine(llm=llm).query(question)  # one LLM call: the documents fit one prompt
    finally:
        dispatcher.event_handlers.remove(last)
    return str(answer), last.response.raw.usage.model_dump()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:30000", help="the server (default: %(default)s)")
    parser.add_argument("--question", default="When does the Amber market open and close?")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--exact", action="store_true", help="ask for SGLang's own prefill: no reused KV")
    args = parser.parse_args(argv)

    docs = [p.read_text().strip() for p in sorted(DOCUMENTS.glob("*.txt"))]
    reports = []
    for order in (docs, docs[::-1]):
        answer, usage = ask(args.url, order, args.question, args.max_tokens, args.exact)
        report = usage["chunkcache"]
        print(f"answer: {answer.strip()!r}\nchunks: {report}\n")
        reports.append(report)
        learned(args.url)
    return reports



if __name__ == "__main__":
    main()
