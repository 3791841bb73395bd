"""chunkcache.prompt: documents map to the same token ids in any order; the hint it makes is valid."""

import pytest
from transformers import AutoTokenizer

from chunkcache.hints import find_payload, parse
from chunkcache.prompt import _SLOT, build

DOCS = ["Paris is the capital of France.", "Bern is the capital of Switzerland.", "Rome is in Italy; 2,000 years."]


@pytest.fixture(scope="module")
def tok(default_model):
    return AutoTokenizer.from_pretrained(default_model)


def test_documents_keep_their_ids_in_any_order(tok):
    a = build(tok, DOCS, "Where is Bern?")
    b = build(tok, DOCS[::-1], "Where is Bern?")
    chunks_a = [a.input_ids[s:e] for s, e in a.token_spans]
    chunks_b = [b.input_ids[s:e] for s, e in b.token_spans]
    assert chunks_a == chunks_b[::-1]
    assert a.token_spans[0][0] == b.token_spans[0][0]  # same shared prefix
    assert a.input_ids[: a.token_spans[0][0]] == b.input_ids[: b.token_spans[0][0]]
    assert [tok.decode(c) for c in chunks_a] == [d + "\n\n" for d in DOCS]


def test_prompt_is_the_chat_template_with_the_documents(tok):
    p = build(tok, DOCS, "Where is Bern?", system="Be brief.")
    text = tok.decode(p.input_ids)
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Documents:\n\n" + "".join(d + "\n\n" for d in DOCS) + "Where is Bern?"}],
        tokenize=False, add_generation_prompt=True)
    assert text == expected


def test_a_base_model_without_a_chat_template_gets_bos_and_plain_text(tok):
    base = AutoTokenizer.from_pretrained(tok.name_or_path)
    base.chat_template = None
    base.bos_token = "<|endoftext|>"  # the default model's id 0: a stand-in for a base model's BOS
    p = build(base, DOCS, "Where is Bern?", system="Be brief.")
    assert p.input_ids[0] == base.bos_token_id
    assert base.decode(p.input_ids[1:]) == "Be brief.\n\nDocuments:\n\n" + "".join(d + "\n\n" for d in DOCS) + "Where is Bern?"
    assert [base.decode(p.input_ids[s:e]) for s, e in p.token_spans] == [d + "\n\n" for d in DOCS]


def test_hint_is_valid_and_carries_options(tok):
    p = build(tok, DOCS, "Where is Bern?")
    hint = parse(find_payload(p.kv_hints(selector="epic", ratio=0.2)), len(p.input_ids))
    assert hint.token_spans == tuple(p.token_spans) and hint.selector == "epic" and hint.ratio == 0.2
    with pytest.raises(ValueError, match="unknown chunkcache payload keys"):
        p.kv_hints(colour="red")
    with pytest.raises(ValueError, match="at least one document"):
        build(tok, [], "Where?")


@pytest.mark.parametrize("question", [_SLOT, f"before {_SLOT} after {_SLOT}", f"{_SLOT[:-1]}_1\x01 and {_SLOT}"])
def test_question_holding_the_placeholder_is_plain_text(tok, question):
    """A chat question containing the internal placeholder is the client's text like any other: the prompt is the
    chat template's, and the documents' spans are where they are for any question."""
    p = build(tok, DOCS, question, system="Be brief.")
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Documents:\n\n" + "".join(d + "\n\n" for d in DOCS) + question}],
        tokenize=False, add_generation_prompt=True)
    assert tok.decode(p.input_ids) == expected
    assert p.token_spans == build(tok, DOCS, "Where is Bern?", system="Be brief.").token_spans
