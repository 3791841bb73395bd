"""Automatic chunk detection's pure parts: content-defined segments (chunkcache.segment), their keys and the
detect / learn decisions (chunkcache.blend.auto), on the default model's tokenizer and MuSiQue passages."""

import json
from dataclasses import replace

import pytest
import torch

from chunkbench.workloads import DEFAULT_MUSIQUE
from chunkcache.blend.auto import AUTO_PREFIX, HEAD_PREFIX, AutoChunks
from chunkcache.blend.request import RequestHint
from chunkcache.config import AutoConfig, Config, ConfigError
from chunkcache.hashing import chunk_key, prefix_key
from chunkcache.segment import Segmenter, break_ids

DATA = DEFAULT_MUSIQUE
FP = "f" * 32


@pytest.fixture(scope="module")
def tok(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model)


@pytest.fixture(scope="module")
def auto(tok):
    return AutoChunks(AutoConfig(enabled=True), break_ids(tok.batch_decode([[i] for i in range(len(tok))])), FP)


@pytest.fixture(scope="module")
def passages():
    return [f"{c['title']}\n{c['text']}" for r in json.loads(DATA.read_text())[:3] for c in r["ctxs"]]


def chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True,
                                   return_dict=False)


def passage_keys(auto, tok, ids, passage):
    """Keys of the segments lying inside `passage`'s own tokens where it sits in `ids`."""
    own = tok(passage, add_special_tokens=False)["input_ids"]
    at = next(i for i in range(len(ids)) if ids[i: i + len(own)] == own)
    segs = auto.segments(ids, "default", None)
    return [k for (s, e), k in zip(segs.spans, segs.keys) if at <= s and e <= at + len(own)], len(own)


def test_segments_cover_the_prompt_and_keep_the_contract():
    seg = Segmenter(break_ids={7}, mean=4, min_tokens=3, max_tokens=8, window=2)
    ids = [1, 2, 3, 7, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 7, 7, 18]
    spans = seg.spans(ids)
    assert spans[0][0] == 0 and spans[-1][1] == len(ids)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no gaps, no overlaps
    assert all(e - s <= 8 for s, e in spans)
    breaks = [i for i, t in enumerate(ids) if t == 7]
    assert {(i, i + 1) for i in breaks} <= set(spans)  # every break token is a segment of its own


def test_the_same_passage_yields_the_same_keys_at_any_offset(tok, auto, passages):
    """A passage after other documents, in another template, at another offset: every segment inside it has the
    same key (joined by "\\n\\n", LlamaIndex's and LangChain's join, the passage keeps its standalone ids)."""
    target = passages[3]
    a = chat(tok, "Context information is below.\n---------------------\n" + "\n\n".join(passages[:4]) + "\nQuery: x")
    b = chat(tok, "Answer the question based only on the following context:\n" + "\n\n".join([passages[7], target,
                                                                                               passages[1]]))
    keys_a, n = passage_keys(auto, tok, a, target)
    keys_b, _ = passage_keys(auto, tok, b, target)
    assert keys_a and keys_a == keys_b
    assert sum(e - s for (s, e), k in zip(*_spans_keys(auto, a)) if k in keys_a) >= 0.9 * n
    # its last segment too, though "\n" follows it in a and "\n\n" in b (different tokens): the break is not in it
    last = max(e for (s, e), k in zip(*_spans_keys(auto, a)) if k in keys_a)
    assert tok.decode(a[last - 3: last]) == tok.decode(tok(target, add_special_tokens=False)["input_ids"][-3:])


def _spans_keys(auto, ids):
    segs = auto.segments(ids, "default", None)
    return segs.spans, segs.keys


@pytest.mark.parametrize("join", [" ", "\n[2] "])
def test_a_passage_whose_first_tokens_merge_keeps_its_later_segments(tok, auto, passages, join):
    """Joined by a space or numbered, the tokenizer merges a passage's first token with what precedes it: only its
    first segment changes; the content-defined cuts after it come back in step, so the rest is found."""
    target = passages[5]
    stored = chat(tok, "Docs:\n\n" + target + "\n\nQuestion: x")
    merged = chat(tok, "Docs: " + passages[12] + join + target + " Question: x")
    spans, keys = _spans_keys(auto, merged)
    template = set(_spans_keys(auto, chat(tok, "Docs: " + passages[12] + " Question: x"))[1])
    stored_keys = set(_spans_keys(auto, stored)[1]) - template  # the passage's own segments
    own = len(tok(target, add_special_tokens=False)["input_ids"])
    found = sum(e - s for (s, e), k in zip(spans, keys) if k in stored_keys)
    assert 0.75 * own <= found < own  # the edge is lost, the interior found


def test_keys_carry_namespace_salt_and_never_meet_hinted_chunks(auto):
    ids = list(range(100, 180))
    base = auto.segments(ids, "default", None).keys
    assert base and not set(base) & set(auto.segments(ids, "other", None).keys)
    assert not set(base) & set(auto.segments(ids, "default", "tenant-b").keys)
    s, e = auto.segments(ids, "default", None).spans[0]
    assert base[0] == chunk_key(FP, "default", AUTO_PREFIX, ids[s:e])
    assert base[0] != chunk_key(FP, "default", prefix_key([]), ids[s:e])  # a hinted chunk's key of the same tokens


def test_detect_needs_enough_stored_tokens_past_the_exact_prefix():
    config = AutoConfig(enabled=True, min_reuse_tokens=40, segment_min_tokens=8, segment_mean_tokens=1 << 20,
                        exact_lead_tokens=0)
    seg = AutoChunks(config, frozenset({0}), FP)
    ids = [5] * 3 + [0] + list(range(10, 30)) + [0] + list(range(40, 70)) + [0] + [99]
    segs = seg.segments(ids, "ns", None)
    # each run ends before its break token, a segment of its own too short to keep (no content cut at this mean)
    assert segs.spans == ((4, 24), (25, 55))
    stored = dict.fromkeys(segs.keys, 0)
    found = seg.detect(segs, len(ids), matched=0, learned_at=stored)
    assert found.spans == ((4, 24), (25, 55)) and found.tokens == 50
    # a segment the exact prefix reaches into is reused from the prefix's end: 19 + 30 tokens past the match
    found = seg.detect(segs, len(ids), matched=5, learned_at=stored)
    assert found.spans == ((4, 24), (25, 55)) and found.exact_until == 5 and found.tokens == 49
    assert seg.detect(segs, len(ids), matched=26, learned_at=stored) is None  # 29 tokens past the match: too few
    assert seg.detect(segs, len(ids), matched=0, learned_at={segs.keys[1]: 0}) is None
    assert seg.detect(segs, 55, matched=0, learned_at=stored) is None  # the last prompt token is never reused


def _three_passages():
    """A 21-token lead, line breaks (token 0) as the only cuts, and a prompt of a 3-token head and three passages,
    segments (4, 24), (25, 55), (56, 76): (config, detector, ids, segments)."""
    config = AutoConfig(enabled=True, min_reuse_tokens=20, segment_min_tokens=8, segment_mean_tokens=1 << 20,
                        exact_lead_tokens=21)
    seg = AutoChunks(config, frozenset({0}), FP)
    ids = [5] * 3 + [0] + list(range(10, 30)) + [0] + list(range(40, 70)) + [0] + list(range(80, 100)) + [0] + [99]
    segs = seg.segments(ids, "ns", None)
    assert segs.spans == ((4, 24), (25, 55), (56, 76))
    return config, seg, ids, segs


def test_detect_leaves_the_first_tokens_after_the_exact_prefix_to_be_computed():
    config, seg, ids, segs = _three_passages()
    deep = lambda keys: dict.fromkeys(keys, 300)  # noqa: E731 - learned after another prompt's passages
    found = seg.detect(segs, len(ids), matched=0, learned_at=deep(segs.keys))
    assert found.spans == ((25, 55), (56, 76)) and found.exact_until == 25  # (4, 24) is in the lead: 21 tokens
    assert found.tokens == 50
    # counted from the first stored segment past the exact prefix; a segment the lead ends inside is reused after it
    longer = AutoChunks(replace(config, exact_lead_tokens=30), frozenset({0}), FP)
    found = longer.detect(segs, len(ids), matched=0, learned_at=deep(segs.keys))
    assert found.spans == ((25, 55), (56, 76)) and found.exact_until == 34 and found.tokens == 21 + 20
    # a first stored segment at or past the lead's length into the prompt follows other text here too, as where it
    # was learned (the exact prefix holds a passage before it): no lead, whether the exact prefix reaches it or not
    for matched, learned in ((0, deep(segs.keys[1:])), (5, deep(segs.keys)), (25, deep(segs.keys))):
        found = seg.detect(segs, len(ids), matched=matched, learned_at=learned)
        assert found.spans == ((25, 55), (56, 76)) and found.exact_until == 25 and found.tokens == 50
    assert longer.detect(segs, len(ids), matched=5, learned_at=deep(segs.keys)).exact_until == 55  # at 25 < 30: lead
    # one the exact prefix reaches into past the lead's length is reused from the prefix's end (the radix tree held
    # its head); before it (above: matched 5), the lead is due and starts at the next segment
    found = seg.detect(segs, len(ids), matched=26, learned_at=deep(segs.keys))
    assert found.spans == ((25, 55), (56, 76)) and found.exact_until == 26 and found.tokens == 29 + 20
    # the first segment learned in its own prompt's head (ingested, sent alone): no other passage before it there,
    # so no lead; learned at the lead's length or deeper, the lead again
    head = {**deep(segs.keys), segs.keys[0]: 20}
    ingested = seg.detect(segs, len(ids), matched=0, learned_at=head)
    assert ingested.spans == segs.spans and ingested.exact_until == 4 and ingested.tokens == 70
    assert seg.detect(segs, len(ids), matched=0, learned_at={**head, segs.keys[0]: 21}).exact_until == 25
    # a later segment learned in a head ends the lead at its start when the lead would reach it (lead 30: it would
    # end at 34, inside (25, 55)), and is reused from its first token; one starting where the lead ends changes nothing
    later = {**deep(segs.keys), segs.keys[1]: 0}
    found = longer.detect(segs, len(ids), matched=0, learned_at=later)
    assert found.spans == ((25, 55), (56, 76)) and found.exact_until == 25 and found.tokens == 50
    assert longer.detect(segs, len(ids), matched=0, learned_at={**later, segs.keys[1]: 30}).exact_until == 34
    assert seg.detect(segs, len(ids), matched=0, learned_at=later).exact_until == 25
    # the first segment stored whole from deep in a prompt (this template wraps it) and trimmed from a head (ingested
    # bare): the head's form is reused, with no lead
    (span, key), = [form for form in segs.edges[0] if form[0] == (6, 24)]
    wrapped = seg.detect(segs, len(ids), matched=0, learned_at={**deep(segs.keys), key: 10})
    assert wrapped.spans == ((6, 24), (25, 55), (56, 76)) and wrapped.keys[0] == key and wrapped.exact_until == 6
    found = seg.detect(segs, len(ids), matched=0, learned_at=deep(segs.keys))
    plan = RequestHint(torch.tensor(ids), found.spans, found.keys, "mix", 0.15, "ns", auto=True,
                       exact_until=46).plan(matched=5)  # a lead ending inside the first chunk: its head is exact
    assert plan.start == 46 and [(c.span, c.head) for c in plan.chunks] == [((46, 55), 21), ((56, 76), 0)]
    assert RequestHint(torch.tensor(ids), found.spans, found.keys, "mix", 0.15, "ns", auto=True,
                       exact_until=46).plan(matched=60).chunks[0].span == (60, 76)  # a longer exact prefix wins



@pytest.mark.parametrize("wrap", ["<document>{}</document>", "[2] {}", "Document 2: {}\n---"])
def test_a_passage_stored_bare_is_found_inside_a_template_that_wraps_it_on_its_line(tok, auto, passages, wrap):
    """Ingest and the documents API store a passage after a line break and before one ("Documents:\n\n" + passage
    + "\n\n"); a client pasting it in tags or after a number has those on the same line. The segments inside
    match whole; the first and the last, which here carry the wrapper's tokens, match trimmed: the detected chunks
    cover >= 95 % of the passage's tokens (each token at most once) and nothing outside it."""
    target, other = passages[4].replace("\n", " "), passages[5].replace("\n", " ")
    stored_ids = chat(tok, "Documents:\n\n" + target + "\n\n" + other + "\n\nQuestion: x")
    stored = dict.fromkeys(auto.segments(stored_ids, "default", None).keys, 0)
    text = "Answer from these.\n" + "\n".join(wrap.format(p) for p in (other, target)) + "\nQuestion: y"
    ids = chat(tok, text)
    segs = auto.segments(ids, "default", None)
    found = AutoChunks(AutoConfig(enabled=True, exact_lead_tokens=0), auto.segmenter.break_ids, FP).detect(
        segs, len(ids), matched=0, learned_at=stored)
    own = tok(target, add_special_tokens=False)["input_ids"]
    at = next(i for i in range(len(ids)) if ids[i: i + len(own)] == own)
    covered = [span for span in found.spans if at <= span[0] and span[1] <= at + len(own)]
    assert sum(e - s for s, e in covered) >= 0.95 * len(own), (len(own), covered)
    assert all(e <= s2 for (_, e), (s2, _) in zip(found.spans, found.spans[1:]))  # no token twice
    trimmed = [span for span in found.spans if span not in segs.spans]
    assert trimmed, "every segment matched whole: the wrapper was not on the passage's line"
    # whole segments only (edge_tokens 0): the passage's first and last segments are lost
    whole = AutoChunks(AutoConfig(enabled=True, exact_lead_tokens=0, edge_tokens=0), auto.segmenter.break_ids, FP)
    bare = whole.detect(whole.segments(ids, "default", None), len(ids), matched=0, learned_at=stored)
    assert sum(e - s for s, e in bare.spans if at <= s and e <= at + len(own)) < sum(e - s for s, e in covered)

def test_learning_takes_computed_segments_the_store_lacks_and_when_crowded_only_those_seen_twice():
    config = AutoConfig(enabled=True, segment_min_tokens=8, segment_mean_tokens=1 << 20, admit_after=2)
    seg = AutoChunks(config, frozenset({0}), FP)
    ids = list(range(10, 30)) + [0] + list(range(40, 70)) + [0] + [99]
    segs = seg.segments(ids, "ns", None)
    both = [(segs.spans[0], segs.keys[0]), (segs.spans[1], segs.keys[1])]
    computed = torch.ones(len(ids), dtype=torch.bool)
    assert seg.to_learn(segs, computed, set(), crowded=True) == []  # seen once, and learning would evict
    other = AutoChunks(config, frozenset({0}), FP)
    assert other.to_learn(segs, computed, set(), crowded=False) == both  # first sight, but the store has room
    computed[30] = False  # a token of the second segment was reused, not computed here
    assert seg.to_learn(segs, computed, set(), crowded=True) == both[:1]  # seen twice now
    assert seg.to_learn(segs, torch.ones(len(ids), dtype=torch.bool), {segs.keys[0]}, crowded=True) == both[1:]


def test_a_stored_segment_computed_exactly_in_a_prompts_head_is_learned_again_as_its_head_form():
    """A passage learned deep leads a prompt: its lead is computed exactly there, and that head-learned KV is kept
    under the segment's head key beside the deep copy; the next prompt it leads reuses it from its first token."""
    _, seg, ids, segs = _three_passages()
    head = segs.heads[0]
    assert segs.heads[1:] == (None, None) and head not in segs.keys  # only a segment starting in the head has one
    assert head == chunk_key(FP, "ns", HEAD_PREFIX, ids[4:24]) and (20, head) in segs.lookup_keys(0)
    deep = dict.fromkeys(segs.keys, 300)
    assert seg.detect(segs, len(ids), 0, deep).exact_until == 25  # learned deep only: the lead
    computed = torch.ones(len(ids), dtype=torch.bool)
    # the lead [0, 25) computed exactly: the deep segment inside it is learned again under its head key
    assert seg.to_learn(segs, computed, set(deep), exact=25) == [((4, 24), head)]
    assert seg.to_learn(segs, computed, set(deep), exact=23) == []  # it reaches past the exact tokens: reused KV
    assert seg.to_learn(segs, computed, {*deep, head}, exact=25) == []  # held already
    found = seg.detect(segs, len(ids), 0, {**deep, head: 4})
    assert found.spans == segs.spans and found.keys == (head, *segs.keys[1:]) and found.exact_until == 4


def test_a_passage_learned_deep_gets_a_head_form_computed_after_its_prompts_head():
    """The passages after a prompt's first (segments starting a paragraph past its first exact_lead_tokens) get head
    forms: their tokens after the prompt's head (its tokens before the last paragraph starting in the head: the
    template and instruction before the first passage), keyed as the head form a lead would store, so that the
    passage, when it leads, is reused from its first token (detect: learned at the head's length)."""
    _, seg, ids, segs = _three_passages()
    t = torch.tensor(ids)
    forms = seg.head_forms(segs, t)
    # (4, 24) starts in the head (its own head form is learned by a lead); (25, 55) and (56, 76) start deep
    assert [(f.start, f.token_ids.tolist(), f.deep_key) for f in forms] == [
        (4, ids[:4] + ids[25:55], segs.keys[1]), (4, ids[:4] + ids[56:76], segs.keys[2])]
    assert [f.key for f in forms] == [chunk_key(FP, "ns", HEAD_PREFIX, ids[25:55]),
                                      chunk_key(FP, "ns", HEAD_PREFIX, ids[56:76])]
    # leading a later prompt, the passage's head form is what a lead would have stored: no lead
    later = ids[:4] + ids[56:77] + ids[4:25] + ids[77:]
    again = seg.segments(later, "ns", None)
    assert again.heads[0] == forms[1].key
    found = seg.detect(again, len(later), 0, {**dict.fromkeys(again.keys, 300), forms[1].key: forms[1].start})
    assert found.keys[0] == forms[1].key and found.exact_until == 4
    # a segment ending at the prompt's last token is never a chunk: no head form
    assert [f.key for f in seg.head_forms(seg.segments(ids[:76], "ns", None), t[:76])] == [forms[0].key]


def test_no_head_forms_when_no_passage_starts_in_the_head_or_they_are_off():
    config, seg, ids, segs = _three_passages()
    t = torch.tensor(ids)
    longer = [0] * 30 + ids  # 30 line breaks first: no segment starts within the 21-token lead
    assert seg.head_forms(seg.segments(longer, "ns", None), torch.tensor(longer)) == []
    off = AutoChunks(replace(config, idle_head_forms=0), frozenset({0}), FP)
    assert off.segments(ids, "ns", None).deep_heads == () and off.head_forms(off.segments(ids, "ns", None), t) == []


def test_auto_config_is_checked(tmp_path):
    assert Config().auto.enabled is False  # off by default: unmarked requests stay exact
    bad = tmp_path / "c.yaml"
    bad.write_text("auto:\n  segment_mean_tokens: 48\n")
    with pytest.raises(ConfigError, match="segment_mean_tokens: must be a power of two"):
        Config.load(bad)
