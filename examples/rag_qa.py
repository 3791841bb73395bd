"""RAG question answering as an SGLang frontend program whose retrieved documents are reused as chunks.

    make serve                                   # server on 127.0.0.1:30000
    .venv/bin/python examples/rag_qa.py "Which day does the Amber market open?"

A small in-memory retriever (word-overlap BM25) picks the top documents; the program asks the question twice, the
second time with the same documents in reverse order, and prints each answer with the server's chunk report
(`meta_info["chunkcache"]`): the second call finds every document in the chunk store.
"""

from __future__ import annotations

import argparse
import math
import re
from collections import Counter

import sglang as sgl

from sglang_patch import lang

CORPUS = [
    "The river Vell flows north through the town of Amber and into Lake Sorn.",
    "Amber's market opens every Tuesday at dawn and closes at noon.",
    "The Amber lighthouse was built in 1852 by the engineer Mara Quill.",
    "Lake Sorn freezes over most winters; skating races are held in February.",
    "The town of Amber has 4,200 inhabitants and one school, the Quill Academy.",
    "Mara Quill also designed the stone bridge over the river Vell.",
    "Ferries cross Lake Sorn twice a day from April to October.",
    "The Amber festival of lanterns takes place on the first Saturday of June.",
]
SYSTEM = "You are a helpful assistant. Answer the question in one short sentence using the documents."


class Retriever:
    """BM25 over lowercase word tokens: enough to rank a handful of short documents, no model needed."""

    def __init__(self, docs: list[str], k1: float = 1.2, b: float = 0.75):
        self.docs, self.k1, self.b = docs, k1, b
        self.tfs = [Counter(_words(d)) for d in docs]
        self.avg_len = sum(sum(tf.values()) for tf in self.tfs) / len(docs)
        df = Counter(w for tf in self.tfs for w in tf)
        self.idf = {w: math.log(1 + (len(docs) - n + 0.5) / (n + 0.5)) for w, n in df.items()}

    def top(self, query: str, k: int) -> list[str]:
        scores = [self._score(_words(query), tf) for tf in self.tfs]
        ranked = sorted(range(len(self.docs)), key=lambda i: -scores[i])
        return [self.docs[i] for i in ranked[:k]]

    def _score(self, query: list[str], tf: Counter) -> float:
        norm = self.k1 * (1 - self.b + self.b * sum(tf.values()) / self.avg_len)
        return sum(self.idf.get(w, 0.0) * tf[w] * (self.k1 + 1) / (tf[w] + norm) for w in query)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


@sgl.function
def rag_qa(s, question: str, docs: list[str], max_tokens: int = 32):
    # The documents come before the question: the text before the first chunk (system turn, user header) is the
    # chunks' shared prefix, and it must not change between calls for the chunks to be reused.
    s += sgl.system(SYSTEM)
    s += sgl.user("Documents:\n\n" + lang.documents(docs) + "Question: " + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens, temperature=0))


def main(argv: list[str] | None = None) -> list[dict | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question", nargs="?", default="Which day does the Amber market open?")
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--selector", help="chunkcache selector (default: the server's)")
    args = parser.parse_args(argv)

    sgl.set_default_backend(lang.ChunkcacheEndpoint(args.url, selector=args.selector, chat_template_name="chatml"))
    docs = Retriever(CORPUS).top(args.question, args.top_k)
    reports = []
    for order in (docs, docs[::-1]):
        state = rag_qa.run(question=args.question, docs=order, max_tokens=args.max_tokens)
        report = state.get_meta_info("answer").get("chunkcache")
        print(f"answer: {state['answer'].strip()!r}\nchunks: {report}\n")
        reports.append(report)
    return reports


if __name__ == "__main__":
    main()
