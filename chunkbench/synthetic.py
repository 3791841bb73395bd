"""Seeded RULER-style RAG tasks with known answers, chunked like retrieved passages (~256-512 tokens each).

Tasks: `single` (one needle), `multikey` (needles for several keys, one asked), `multivalue` (one key, values
spread over chunks, all asked), `vartrack` (a chain of variable assignments across chunks), `bridge` (ProphetKV
App. B: a fact in one chunk, the entity linking it to the question in another, a distractor fact elsewhere),
`realkey` (multikey's needles inside real paragraphs instead of filler: `generate(..., paragraphs=...)`, the
workloads pass MuSiQue's; filler sentences are easy to tell from a needle, prose is not).
Needles sit at random sentence boundaries; every case is a pure function of (task, seed[, paragraphs]).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

TASKS = ("single", "multikey", "multivalue", "vartrack", "bridge", "realkey")
# tasks whose passages are real paragraphs (generate's `paragraphs`) -> the task whose facts, seeds and answers they
# share: the two families' cases differ only in their passages
PROSE_TASKS = {"realkey": "multikey"}

SYSTEM = "You are a helpful assistant. Answer the question using only the given passages. Be brief."
INSTRUCTION = "Read the passages below and answer the question at the end.\n\n"

PEOPLE = ["Alice", "John", "Maria", "Omar", "Chen", "Priya", "Lukas", "Sofia", "Kenji", "Amara", "Diego", "Nora",
          "Ivan", "Leila", "Tom", "Hana", "Pedro", "Zoe", "Yusuf", "Greta"]
CITIES = ["London", "Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Madrid", "Dublin", "Vienna", "Nairobi", "Seoul",
          "Lisbon", "Prague", "Toronto", "Sydney", "Athens", "Berlin", "Mumbai", "Denver", "Havana"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
KEYS = ["amber-falcon", "quiet-river", "silver-maple", "rapid-otter", "broken-clock", "golden-harbor",
        "misty-canyon", "lucky-pebble", "frozen-lantern", "crimson-meadow", "hollow-reed", "velvet-storm"]

_SUBJECTS = ["The city council", "A local bakery", "The museum", "Our neighbour", "The school choir",
             "A small startup", "The river ferry", "The public library", "An old farmer", "The weather service",
             "A travelling circus", "The football club", "The night market", "A young painter", "The harbour office",
             "The train company"]
_VERBS = ["announced new plans for", "spent the afternoon discussing", "quietly changed", "published a report on",
          "celebrated", "asked volunteers to help with", "raised money for", "postponed", "reviewed", "redesigned"]
_OBJECTS = ["the spring festival", "the opening hours", "a bicycle lane", "the annual budget", "the old bridge",
            "a community garden", "the bus timetable", "a photography contest", "the harvest fair",
            "the recycling rules", "a charity concert", "the playground", "the winter schedule", "a reading club",
            "the fish market"]
_TAILS = ["last week.", "after a long debate.", "to the surprise of many residents.", "without much fuss.",
          "for the second time this year.", "despite the rain.", "before the holidays.", "with mixed results.",
          "in front of a large crowd.", "according to the newsletter."]


@dataclass
class Case:
    task: str
    seed: int
    chunks: list[str]  # passage texts, in prompt order
    question: str
    answers: list[str]  # every string a correct answer contains
    needle_chunks: list[int] = field(default_factory=list)  # chunks holding the facts the answer needs

    def correct(self, text: str) -> bool:
        return all(a.lower() in text.lower() for a in self.answers)

    def extract(self, text: str) -> tuple[str, ...]:
        """The answer-shaped strings in a model's reply (cities, 7-digit numbers, variable names), first
        occurrences in order: two replies agree when they extract the same, however they are phrased."""
        found = re.findall(_ANSWER_PATTERNS[PROSE_TASKS.get(self.task, self.task)], text)
        return tuple(dict.fromkeys(found))


def generate(task: str, seed: int, n_chunks: int = 6, length: tuple[int, int] = (256, 512),
             count: Callable[[str], int] | None = None, paragraphs: Sequence[str] | None = None) -> Case:
    """One case. `count` measures a text in target tokens (default: ~1.3 tokens per word). `paragraphs`: the real
    texts a PROSE_TASKS case draws its passages from (each cut at the sentence that reaches its length)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    if (task in PROSE_TASKS) != (paragraphs is not None):
        raise ValueError(f"task {task!r} {'needs' if task in PROSE_TASKS else 'takes no'} paragraphs")
    if paragraphs is not None and len(paragraphs) < n_chunks:
        raise ValueError(f"{len(paragraphs)} paragraphs for {n_chunks} passages")
    facts_of = PROSE_TASKS.get(task, task)
    rng = random.Random(f"{facts_of}:{seed}")
    count = count or (lambda s: round(1.3 * len(s.split())))
    facts, question, answers = _FACTS[facts_of](rng, n_chunks)
    chunk_facts: dict[int, list[str]] = {}
    for where, sentence in facts:
        chunk_facts.setdefault(where, []).append(sentence)
    if paragraphs is None:
        chunks = [filler_passage(rng, rng.randint(*length), chunk_facts.get(i, []), count) for i in range(n_chunks)]
    else:
        texts = rng.sample(list(paragraphs), n_chunks)
        chunks = [_prose(rng, text, rng.randint(*length), chunk_facts.get(i, []), count)
                  for i, text in enumerate(texts)]
    return Case(task, seed, chunks, question, answers, sorted(chunk_facts))


def prompt(case: Case, tokenizer) -> tuple[list[int], list[list[int]], list[int]]:
    """(prefix, chunks, query) token ids in the model's chat format; each piece is tokenised on its own, as
    cached chunks are."""
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\x00"}]
    head = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    before, after = head.split("\x00")
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return (enc(before + INSTRUCTION), [enc(c + "\n\n") for c in case.chunks],
            enc(f"Question: {case.question}" + after))


def filler_passage(rng: random.Random, tokens: int, facts: list[str], count: Callable[[str], int]) -> str:
    sentences: list[str] = []
    used = sum(count(" " + f) for f in facts)
    while used < tokens:
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        sentences.append(s)
        used += count(" " + s)
    for f in facts:
        sentences.insert(rng.randint(0, len(sentences)), f)
    return " ".join(sentences)


def _prose(rng: random.Random, text: str, tokens: int, facts: list[str], count: Callable[[str], int]) -> str:
    """`text`'s sentences up to the one that reaches `tokens` (with the facts), the facts at random boundaries
    after its first line (a title stays the passage's opening)."""
    head, sep, body = text.partition("\n") if "\n" in text else ("", "", text)
    sentences: list[str] = []
    used = count(head) + sum(count(" " + f) for f in facts)
    for s in re.split(r"(?<=[.!?])\s+", body.strip()):
        if sentences and used >= tokens:  # every passage keeps at least its first sentence
            break
        sentences.append(s)
        used += count(" " + s)
    for f in facts:
        sentences.insert(rng.randint(0, len(sentences)), f)
    return head + sep + " ".join(sentences)


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _needle(key: str, value: str) -> str:
    return f"The special magic number for {key} is {value}."


def _single(rng, n):
    key, value = rng.choice(KEYS), _number(rng)
    return [(rng.randrange(n), _needle(key, value))], f"What is the special magic number for {key}?", [value]


def _multikey(rng, n):
    keys = rng.sample(KEYS, 4)
    values = [_number(rng) for _ in keys]
    where = rng.sample(range(n), min(n, len(keys)))
    facts = [(w, _needle(k, v)) for w, k, v in zip(where, keys, values)]
    return facts, f"What is the special magic number for {keys[0]}?", [values[0]]


def _multivalue(rng, n):
    key, values = rng.choice(KEYS), [_number(rng) for _ in range(3)]
    where = rng.sample(range(n), min(n, len(values)))
    facts = [(w, _needle(key, v)) for w, v in zip(where, values)]
    return facts, f"What are all the special magic numbers for {key}?", values


def _vartrack(rng, n):
    names = [f"{rng.choice('QWXYZ')}{rng.randint(10, 99)}" for _ in range(3)]
    while len(set(names)) < 3:
        names = [f"{rng.choice('QWXYZ')}{rng.randint(10, 99)}" for _ in range(3)]
    value = str(rng.randint(10_000, 99_999))
    where = sorted(rng.sample(range(n), min(n, 3)))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    return list(zip(where, chain)), f"Which variables are assigned the value {value}?", names


def _bridge(rng, n):
    host, guest = rng.sample(PEOPLE, 2)
    city, decoy = rng.sample(CITIES, 2)
    day = rng.choice(DAYS)
    where = rng.sample(range(n), min(n, 3))
    facts = [(where[0], f"{host}'s house is in {city}."), (where[1], f"{guest}'s house is in {decoy}."),
             (where[2 % len(where)], f"{guest} stays in {host}'s house on {day}.")]
    return facts, f"In which city does {guest} stay on {day}?", [city]


_ANSWER_PATTERNS = {"single": r"\d{7}", "multikey": r"\d{7}", "multivalue": r"\d{7}", "vartrack": r"\b[QWXYZ]\d\d\b",
                    "bridge": r"\b(?:" + "|".join(CITIES) + r")\b"}
_FACTS = {"single": _single, "multikey": _multikey, "multivalue": _multivalue, "vartrack": _vartrack,
          "bridge": _bridge}
