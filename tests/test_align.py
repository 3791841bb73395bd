"""Cross-tokenizer alignment between the SmolLM2 (byte-level BPE) and Gemma-3 (SentencePiece) tokenizers."""

import random

import pytest
import torch
from transformers import AutoTokenizer

from chunkcache.align import Alignment, close_units, decode_with_offsets, encode_with_offsets, overlap_pairs, unit_ids

TRICKY = [
    "The special magic number for quiet-river is 5663623. Its UUID is 123e4567-e89b-12d3-a456-426614174000.",
    "  Leading spaces,\ttabs\tand\n\nnewlines   everywhere  ",
    "Café naïve façade — 東京 and 🙂 emoji, then 3.14159 and 10,000,000 and 2024-01-31T12:30.",
    "id=9f1c2e7a-0b3d-4c8e-a1f2-0123456789ab; amount: $1,234.56; phone 555-0134; v1.2.3",
]


@pytest.fixture(scope="module")
def smol(default_model):
    return AutoTokenizer.from_pretrained(default_model)


@pytest.fixture(scope="module")
def gemma(gemma_tokenizer):
    return gemma_tokenizer


@pytest.mark.parametrize("text", TRICKY)
def test_decode_with_offsets_matches_the_tokenizer(smol, gemma, text):
    for tok in (smol, gemma):
        ids, enc_offsets = encode_with_offsets(tok, text)
        decoded, offsets = decode_with_offsets(tok, ids)
        assert decoded == text
        for (s, e), (es, ee) in zip(offsets, enc_offsets):
            assert s <= es and ee <= e or (s, e) == (es, ee)  # multi-byte pieces share their character's span
            assert decoded[s:e].strip() == "" or decoded[s:e] in text


def test_decode_with_offsets_of_piecewise_ids(smol):
    parts = ["<|im_start|>system\nBe brief.<|im_end|>\n", "Chunk one ends here.\n\n", "Chunk 2: 5663623\n\n", "Q?"]
    ids = [i for p in parts for i in smol(p, add_special_tokens=False)["input_ids"]]
    text, offsets = decode_with_offsets(smol, ids)
    assert text == "".join(parts)
    assert offsets[0] == (0, len("<|im_start|>")) and offsets[-1][1] == len(text)


def _brute_pairs(src, dst):
    return {(i, j) for i, (a, b) in enumerate(src) for j, (c, d) in enumerate(dst) if max(a, c) < min(b, d)}


@pytest.mark.parametrize("text", TRICKY)
def test_overlap_pairs_is_the_character_overlap_relation(smol, gemma, text):
    _, a = encode_with_offsets(smol, text)
    _, b = encode_with_offsets(gemma, text)
    for src, dst in ((a, b), (b, a)):
        si, dj = overlap_pairs(src, dst)
        assert set(zip(si.tolist(), dj.tolist())) == _brute_pairs(src, dst)


def test_many_to_many(smol, gemma):
    text = "Its UUID is known."
    s_ids, s_off = encode_with_offsets(smol, text)
    g_ids, g_off = encode_with_offsets(gemma, text)
    sm = smol.convert_ids_to_tokens(s_ids)
    gm = gemma.convert_ids_to_tokens(g_ids)
    assert sm[1:3] == ["ĠU", "UID"] and gm[1] == "▁UUID"
    align = Alignment.between(g_off, s_off)  # gemma draft -> smol target
    one = torch.zeros(len(g_ids), dtype=torch.bool)
    one[1] = True
    assert align.project(one).nonzero().flatten().tolist() == [1, 2]  # one draft token -> two target tokens
    back = Alignment.between(s_off, g_off)
    for i in (1, 2):
        m = torch.zeros(len(s_ids), dtype=torch.bool)
        m[i] = True
        assert back.project(m).nonzero().flatten().tolist() == [1]  # two target tokens -> the same draft token


def test_units():
    text = "Value 5663623, id 123e4567-e89b-12d3, total 10,000 in Paris. Done"
    offsets = [(i, i + 1) for i in range(len(text))]  # one token per character
    u = unit_ids(text, offsets)

    def same(word):
        s = text.index(word)
        return len(set(u[s : s + len(word)].tolist())) == 1

    assert same("5663623") and same("123e4567-e89b-12d3") and same("10,000") and same("Paris")
    comma = text.index(", id")
    assert u[comma] != u[comma - 1]  # a comma followed by a space ends the number
    assert u[text.index("Paris") + 5] != u[text.index("Paris")]  # the full stop is not part of the word


def test_numbers_are_recomputed_whole_or_not_at_all(smol, gemma):
    text = TRICKY[0] + " " + TRICKY[3] + " The code 5663623 appears again: 8675309."
    _, t_off = encode_with_offsets(smol, text)
    _, d_off = encode_with_offsets(gemma, text)
    align = Alignment.between(d_off, t_off)
    units = unit_ids(text, t_off)
    number = text.index("5663623")
    whole = [j for j, (s, e) in enumerate(t_off) if s < number + 7 and e > number]
    assert len(whole) >= 7  # SmolLM2 splits digits
    rng = random.Random(0)
    for trial in range(200):
        picked = torch.tensor([rng.random() < 0.1 for _ in d_off])
        target = close_units(align.project(picked), units)
        for g in units.unique():
            members = target[units == g]
            assert bool(members.all()) or not bool(members.any())
    # any single draft token inside the number brings back every target token of it
    for i, (s, e) in enumerate(d_off):
        if s >= number and e <= number + 7:
            one = torch.zeros(len(d_off), dtype=torch.bool)
            one[i] = True
            got = close_units(align.project(one), units).nonzero().flatten().tolist()
            assert set(whole) <= set(got)
