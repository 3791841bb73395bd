"""Benchmark workloads as RAG prompts built by `chunkcache.prompt.build`, so both A/B sides send the same ids.

`musique[:PATH]`: MuSiQue records `{ctxs: [{title, text}], question, answers}`, the first `docs` passages each,
truncated to `words` words. `synthetic:TASK`: the generator's cases (answers known by construction;
`synthetic:realkey`'s passages are MuSiQue's paragraphs).
`shuffled`: a fixed pool of documents; every request takes `docs` of them in a new random order and asks for the
archive number of one. Each measured phase `k` (sequential, then one per arrival rate) reorders the documents
(rotation by k; shuffled draws new orders), so a phase never replays a prompt an earlier phase left in the radix
tree: stock prefix caching gets the hits a new request would get, no more.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, replace
from pathlib import Path

from chunkcache.prompt import RagPrompt, build
from . import synthetic

# the MuSiQue file of the CacheBlend/LMCache benchmark: 100 dev records, 10 passages each (chunkbench/data/README.md)
DEFAULT_MUSIQUE = Path(__file__).resolve().parent / "data" / "musique_dev.json"
SYSTEM = "You are a helpful assistant. Answer the question using only the given documents. Be brief."
_WORDS = ("the river city north market council bridge winter harvest museum library station engineer doctor "
          "garden history mountain festival report village").split()


@dataclass(frozen=True)
class WorkloadConfig:
    spec: str = "shuffled"  # musique[:PATH] | synthetic:TASK | documents:PATH | shuffled
    requests: int = 30  # measured requests per phase
    docs: int = 6  # documents per prompt
    words: int = 150  # words per document (musique: truncation; synthetic: ~1.3 tokens per word)
    pool: int = 12  # shuffled: documents the requests draw from
    seed: int = 0  # synthetic: first seed; shuffled: the draws'; musique: 0 = each record's first docs, else drawn


@dataclass(frozen=True)
class Item:
    """One question over its documents, before ordering and tokenisation."""
    id: str
    documents: tuple[str, ...]
    question: str
    answers: tuple[str, ...]
    system: str = SYSTEM
    instruction: str = "Documents:\n\n"


@dataclass(frozen=True)
class Request:
    id: str
    prompt: RagPrompt
    answers: tuple[str, ...]


def items(config: WorkloadConfig) -> list[Item]:
    kind, _, arg = config.spec.partition(":")
    if kind == "musique":
        return _musique(Path(arg) if arg else DEFAULT_MUSIQUE, config)
    if kind == "synthetic":
        return _synthetic(arg, config)
    if kind == "documents" and arg:
        return _documents(Path(arg), config)
    if kind == "shuffled" and not arg:
        return _shuffled_pool(config)
    raise ValueError(f"unknown workload {config.spec!r}; expected musique[:PATH], synthetic:TASK, documents:PATH or "
                     "shuffled")


def phase(config: WorkloadConfig, pool: list[Item], k: int) -> list[Item]:
    """The items of measured phase k, documents in that phase's order."""
    if config.spec == "shuffled":
        rng = random.Random(f"{config.seed}:{k}")
        return [_shuffled_request(pool, rng, config.docs, i) for i in range(config.requests)]
    return [Item(it.id, _rotate(it.documents, k), it.question, it.answers, it.system, it.instruction) for it in pool]


DRY_PHASES = 20


def fresh(config: WorkloadConfig, pool: list[Item], n: int) -> list[Item]:
    """n items from phases 1, 2, ..., no two with the same documents in the same order: a run whose servers live
    through many measured blocks never replays a prompt. Rotations run out after `docs` phases; shuffled draws at
    random, so a phase may bring nothing new before its orders run out: ValueError after DRY_PHASES such in a row."""
    out: list[Item] = []
    seen: set[tuple[str, ...]] = set()
    k = dry = 0
    while len(out) < n:
        k += 1
        before = len(out)
        for it in phase(config, pool, k):
            if it.documents not in seen:
                seen.add(it.documents)
                out.append(replace(it, id=f"{it.id}.{k}"))
        dry = dry + 1 if len(out) == before else 0
        if dry == DRY_PHASES:
            raise ValueError(f"{config.spec}: {len(out)} distinct document orders, {n} needed (raise --pool or --docs)")
    return out[:n]


WARM_QUESTION = "Question: Which documents are these?"


def chunk_warmup(pool: list[Item], per_request: int) -> list[Item]:
    """Every document of the pool into the chunk store: requests of at most `per_request` documents (the shuffled
    pool is one item, larger than a prompt and maybe than the context), all hinted (a missed chunk is computed alone
    after the shared prefix, wherever it sits, so batching them changes no stored KV). Each group is sent a second
    time rotated by one, so every document is also blended away from its home (right after the shared prefix): what
    a selector learns per chunk there (mix's stored deviation) is in place before the measured requests, as in steady
    serving, instead of being paid by the first measured batch."""
    groups = [(it, it.documents[i:i + per_request]) for it in pool for i in range(0, len(it.documents), per_request)]
    orders = [(it, docs) for it, group in groups for docs in {group: None, _away(group, it.documents): None}]
    return [Item(f"warm-{i}", docs, WARM_QUESTION, (), it.system, it.instruction) for i, (it, docs) in enumerate(orders)]


def _away(group: tuple[str, ...], documents: tuple[str, ...]) -> tuple[str, ...]:
    """`group` reordered so that each of its documents sits after another one: rotated by one, or a lone document
    after another document of its item."""
    if len(group) > 1 or len(documents) < 2:
        return _rotate(group, 1)
    return (documents[0] if documents[0] != group[0] else documents[1],) + group


def prefix_warmup(measured: list[Item]) -> list[Item]:
    """Stock's counterpart: `[system][document]` in its radix tree for every document that opens a measured prompt
    (the only place prefix caching can reuse a document; the others' entries would never be matched)."""
    seen: dict[str, Item] = {}
    for it in measured:
        d = it.documents[0]
        seen.setdefault(d, Item(f"warm{len(seen)}", (d,), WARM_QUESTION, (), it.system, it.instruction))
    return list(seen.values())


def to_request(tokenizer, item: Item) -> Request:
    return Request(item.id, build(tokenizer, item.documents, item.question, system=item.system,
                                  instruction=item.instruction), item.answers)


def _rotate(docs: tuple[str, ...], k: int) -> tuple[str, ...]:
    k %= len(docs)
    return docs[k:] + docs[:k]


def _musique(path: Path, config: WorkloadConfig) -> list[Item]:
    if not path.is_file():
        raise FileNotFoundError(f"MuSiQue data set not found at {path}; pass musique:PATH (a JSON list of "
                                "{ctxs: [{title, text}], question, answers} records)")
    records = json.loads(path.read_text())
    if len(records) < config.requests:
        raise ValueError(f"{path} holds {len(records)} records; {config.requests} requests asked")
    out = []
    for i, r in enumerate(records[: config.requests]):
        ctxs = r["ctxs"][: config.docs]
        if config.seed:  # other cases of the same records: docs of the record's passages drawn, in a drawn order
            ctxs = random.Random(f"{config.seed}:{i}").sample(r["ctxs"], min(config.docs, len(r["ctxs"])))
        docs = [_paragraph(c, config.words) for c in ctxs]
        case = f"musique{i}" if not config.seed else f"musique.draw{config.seed}.{i}"
        out.append(Item(case, tuple(docs), f"Question: {r['question']}\nAnswer:", tuple(r["answers"])))
    return out


def musique_records(path: Path = DEFAULT_MUSIQUE) -> int:
    """How many records the MuSiQue file holds: the most cases a `musique` workload has."""
    return len(json.loads(path.read_text()))


def musique_paragraphs(path: Path) -> list[str]:
    """Every distinct MuSiQue paragraph of the file, "title\ntext", in file order (the real prose `synthetic:realkey`
    hides its needles in)."""
    if not path.is_file():
        raise FileNotFoundError(f"MuSiQue data set not found at {path} (synthetic:realkey draws its passages from it)")
    return list(dict.fromkeys(_paragraph(c) for r in json.loads(path.read_text()) for c in r["ctxs"]))


def _paragraph(ctx: dict, words: int | None = None) -> str:
    """A MuSiQue passage as a document: "title\ntext" (text only when untitled), the text's first `words` words."""
    text = " ".join(ctx["text"].split()[:words])
    return f"{ctx['title']}\n{text}" if ctx.get("title") else text


def _synthetic(task: str, config: WorkloadConfig) -> list[Item]:
    tokens = round(1.3 * config.words)
    prose = musique_paragraphs(DEFAULT_MUSIQUE) if task in synthetic.PROSE_TASKS else None
    out = []
    for seed in range(config.seed, config.seed + config.requests):
        case = synthetic.generate(task, seed, n_chunks=config.docs, length=(tokens * 4 // 5, tokens * 6 // 5),
                                  paragraphs=prose)
        out.append(Item(f"{task}{seed}", tuple(case.chunks), f"Question: {case.question}", tuple(case.answers),
                        synthetic.SYSTEM, synthetic.INSTRUCTION))
    return out


def _documents(path: Path, config: WorkloadConfig) -> list[Item]:
    """A user's own documents. A JSONL file: one case per line, {"passages": [str, ...], "question": str, "answers":
    [str, ...] (optional)}, its first `docs` passages cut at `words` words. A folder: its .txt and .md files'
    paragraphs (blank-line separated, 40 words or more) as the prose of `synthetic:realkey` (multikey's needles hidden
    at sentence boundaries of `docs` paragraphs drawn per seed), so needle accuracy is measured on the user's text."""
    if path.is_file():
        out = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                case = json.loads(line)
                passages, question = case["passages"], case["question"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected {{\"passages\": [...], \"question\": ...}}: {e}") from e
            docs = tuple(" ".join(str(p).split()[: config.words]) for p in passages[: config.docs])
            out.append(Item(f"documents{len(out)}", docs, f"Question: {question}\nAnswer:",
                            tuple(case.get("answers", ()))))
        if len(out) < config.seed + config.requests:
            raise ValueError(f"{path} holds {len(out)} cases; {config.requests} from case {config.seed} asked")
        return out[config.seed: config.seed + config.requests]
    if not path.is_dir():
        raise FileNotFoundError(f"documents:{path}: no such file or folder (a JSONL of cases or a folder of .txt/.md)")
    paragraphs = [p for f in sorted(path.rglob("*")) if f.suffix in (".txt", ".md") and f.is_file()
                  for p in (" ".join(block.split()) for block in re.split(r"\n\s*\n", f.read_text()))
                  if len(p.split()) >= 40]
    if len(paragraphs) < 2 * config.docs:
        raise ValueError(f"documents:{path}: {len(paragraphs)} paragraphs of 40 words or more in its .txt/.md files; "
                         f"at least {2 * config.docs} needed for {config.docs} passages per case")
    tokens = round(1.3 * config.words)
    out = []
    for seed in range(config.seed, config.seed + config.requests):
        case = synthetic.generate("realkey", seed, n_chunks=config.docs, length=(tokens * 4 // 5, tokens * 6 // 5),
                                  paragraphs=paragraphs)
        out.append(Item(f"documents{seed}", tuple(case.chunks), f"Question: {case.question}", tuple(case.answers),
                        synthetic.SYSTEM, synthetic.INSTRUCTION))
    return out


def _shuffled_pool(config: WorkloadConfig) -> list[Item]:
    if config.pool < config.docs:
        raise ValueError(f"shuffled: pool {config.pool} is smaller than docs per request {config.docs}")
    rng = random.Random(config.seed)
    docs = [f"Document {i}. " + " ".join(rng.choice(_WORDS) for _ in range(config.words))
            + f" The archive number of document {i} is {_archive(i)}." for i in range(config.pool)]
    # one item holding the pool: `documents` warms it, `phase` draws the requests from it
    return [Item("pool", tuple(docs), "", ())]


def _shuffled_request(pool: list[Item], rng: random.Random, n: int, i: int) -> Item:
    docs = pool[0].documents
    order = rng.sample(range(len(docs)), n)
    asked = rng.choice(order)
    return Item(f"shuffled{i}", tuple(docs[j] for j in order),
                f"Question: What is the archive number of document {asked}?", (_archive(asked),))


def _archive(i: int) -> str:
    return str(10000 + 37 * i)
