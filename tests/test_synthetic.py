"""The synthetic task generator: seeded, ground truth in the passages, chunk sizes as asked."""

import pytest

from chunkbench import synthetic


@pytest.mark.parametrize("task", synthetic.TASKS)
def test_cases_are_seeded_and_grounded(task):
    a, b = synthetic.generate(task, 7), synthetic.generate(task, 7)
    assert a == b and synthetic.generate(task, 8) != a
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
