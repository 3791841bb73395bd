"""Answer scores: SQuAD-style F1 and exact match against gold answers (max over the golds), as the RAG papers
report them. Normalisation: lowercase, drop punctuation and the articles a/an/the, collapse whitespace."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

_PUNCT = set(string.punctuation)


def normalize(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in _PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1(prediction: str, gold: str) -> float:
    pred, ref = normalize(prediction).split(), normalize(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize(prediction) == normalize(gold))


def best_f1(prediction: str, golds: Sequence[str]) -> float:
    return max((f1(prediction, g) for g in golds), default=0.0)


def best_em(prediction: str, golds: Sequence[str]) -> float:
    return max((exact_match(prediction, g) for g in golds), default=0.0)
