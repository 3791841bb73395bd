"""The synthetic task generator: seeded, ground truth in the passages, chunk sizes as asked."""

import re

import pytest

from chunkbench import synthetic


PROSE = [f"Title {i}\nFirst sentence of paragraph {i}. It goes on about topic {i}. A third remark ends it."
         for i in range(12)]


def _generate(task, seed, **kw):
    return synthetic.generate(task, seed, paragraphs=PROSE if task in synthetic.PROSE_TASKS else None, **kw)


@pytest.mark.parametrize("task", synthetic.TASKS)
def test_cases_are_seeded_and_grounded(task):
    a, b = _generate(task, 7), _generate(task, 7)
    assert a == b and _generate(task, 8) != a
    text = " ".join(a.chunks)
    for answer in a.answers:
        assert answer in text
    assert a.correct(" and ".join(a.answers)) and not a.correct("no idea")
    for i in a.needle_chunks:
        assert 0 <= i < len(a.chunks)


def test_bridge_spreads_fact_link_and_distractor_over_chunks():
    for seed in range(20):
        case = synthetic.generate("bridge", seed)
        assert len(case.needle_chunks) == 3
        city = case.answers[0]
        (host_chunk,) = [i for i, c in enumerate(case.chunks) if f"house is in {city}." in c]
        guest = case.question.split("does ")[1].split(" stay")[0]
        (link_chunk,) = [i for i, c in enumerate(case.chunks) if f"{guest} stays in" in c]
        assert host_chunk != link_chunk
        assert case.extract(f"{guest} stays in {city}, not in Paris.")[0] == city


def test_realkey_hides_multikeys_needles_in_real_paragraphs():
    count = lambda s: len(s.split())  # noqa: E731
    for seed in range(10):
        case = synthetic.generate("realkey", seed, n_chunks=8, length=(8, 12), count=count, paragraphs=PROSE)
        twin = synthetic.generate("multikey", seed, n_chunks=8)  # same seed, same keys, values and places
        assert (case.question, case.answers, case.needle_chunks) == (twin.question, twin.answers, twin.needle_chunks)
        assert len(case.needle_chunks) == 4
        titles = set()
        for i, chunk in enumerate(case.chunks):
            head, body = chunk.split("\n")
            titles.add(head)
            source = PROSE[int(head.split()[1])].split("\n")[1]
            sentences = re.split(r"(?<=\.) ", body)
            assert sum("special magic number" in s for s in sentences) == (i in case.needle_chunks)
            prose = " ".join(s for s in sentences if "special magic number" not in s)
            assert prose and source.startswith(prose)  # the paragraph's own opening sentences
        assert len(titles) == 8  # eight different paragraphs
    with pytest.raises(ValueError, match="needs paragraphs"):
        synthetic.generate("realkey", 0)
    with pytest.raises(ValueError, match="takes no paragraphs"):
        synthetic.generate("multikey", 0, paragraphs=PROSE)


def test_chunk_lengths_follow_the_counter():
    count = lambda s: len(s.split())  # noqa: E731
    case = synthetic.generate("multivalue", 3, n_chunks=5, length=(256, 512), count=count)
    for chunk in case.chunks:
        assert 256 <= count(chunk) <= 512 + 40


def test_prompt_pieces_are_tokenised_separately(default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    case = synthetic.generate("single", 0)
    prefix, chunks, query = synthetic.prompt(case, tok)
    assert len(chunks) == len(case.chunks)
    assert tok.decode(chunks[0]) == case.chunks[0] + "\n\n"
    assert tok.decode(query).startswith("Question: ") and tok.decode(prefix).startswith("<|im_start|>system")
