"""RAG with LangChain's own packages on a chunkcache server with automatic chunk detection: `ChatOpenAI` pointed at
the server's /v1 and a stuff-documents chain; the prompt is LangChain's, nothing in it marks the documents.

    .venv/bin/chunkcache serve --auto-chunks                   # server on 127.0.0.1:30000
    .venv/bin/python examples/langchain_rag.py http://127.0.0.1:30000

The chain answers the question over the documents in examples/documents twice, the second time with them in reverse
order (as another retriever's ranking would give them), and prints each answer with the server's chunk report: the
second request (sent once the server has learned the first one's paragraphs) finds the documents' segments in the
chunk store (`chunk_hits`, `reused_tokens`). `--exact` passes
`{"chunkcache": {"exact": true}}` through ChatOpenAI's `extra_body`: the server computes those requests with SGLang's
own prefill, reusing nothing (`reused_tokens: 0`). The report's counts are the answer's `usage.chunkcache`, which
ChatOpenAI keeps in the reply's `response_metadata["token_usage"]` (the whole report, the answer's top-level
`chunkcache`, is not among what it keeps); the chain's output parser keeps only the reply's text, so a callback
handler keeps the reply itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from langchain_classic.chains.combine_documents import create_stuff_documents_chain
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import AIMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_openai import ChatOpenAI
from server_state import learned  # examples/server_state.py, beside this script

DOCUMENTS = Path(__file__).resolve().parent / "documents"
PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer the question in one short sentence using only the context."),
    ("human", "Context:\n\n{context}\n\nQuestion: {question}"),
])


class Reply(BaseCallbackHandler):
    """The chat model's reply, as LangChain hands it to callbacks when the model ends."""

    message: AIMessage

    def on_llm_end(self, response, **kwargs) -> None:
        self.message = response.generations[0][0].message


def ask(url: str, docs: list[str], question: str, max_tokens: int = 32, exact: bool = False) -> tuple[str, dict]:
    """The chain's answer over `docs` in this order, and the usage of its chat completion as ChatOpenAI keeps it
    (`usage.chunkcache` is the server's chunk report's counts)."""
    llm = ChatOpenAI(base_url=url + "/v1", api_key="none", model="default", temperature=0, max_tokens=max_tokens,
                     extra_body={"chunkcache": {"exact": True}} if exact else None)
    chain = create_stuff_documents_chain(llm, PROMPT)  # documents joined by "\n\n"
    reply = Reply()
    answer = chain.invoke({"context": [Document(page_content=d) for d in docs], "question": question},
                          config={"callbacks": [reply]})
    return answer, reply.message.response_metadata["token_usage"]


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
