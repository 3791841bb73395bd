"""The request contract (chunkcache.hints): envelope lookup, payload validation, char -> token span mapping."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from chunkcache import hints
from chunkcache.hints import (
    ACTION_TYPE,
    MAX_NAMESPACE_CHARS,
    ChunkHint,
    HintError,
    char_spans_to_token_payload,
    char_to_token_spans,
    find_payload,
    parse,
)
from chunkcache.select import REGISTRY


def action(payload, action_type=ACTION_TYPE, version="1", action_id="a1"):
    return {"action_id": action_id, "action_type": action_type, "action_version": version, "payload": payload}


def envelope(*actions):
    return {"protocol_version": "1", "message_id": "m1", "actions": list(actions)}


# --- find_payload ---------------------------------------------------------------------------------------------------

def test_no_chunkcache_action_means_no_payload():
    assert find_payload(None) is None
    assert find_payload({}) is None
    assert find_payload(envelope()) is None
    assert find_payload(envelope(action({"x": 1}, action_type="other.thing"))) is None


def test_payload_found_among_other_actions():
    p = {"token_spans": [[0, 2]]}
    assert find_payload(envelope(action({"y": 2}, action_type="other.thing", version="9"), action(p))) is p


def test_payload_found_on_typed_envelope():
    """SGLang hands the scheduler a msgspec struct, read by attribute."""
    p = {"token_spans": [[0, 2]]}
    typed = SimpleNamespace(protocol_version="1", actions=[
        SimpleNamespace(action_id="a", action_type=ACTION_TYPE, action_version="1", payload=p)])
    assert find_payload(typed) is p


@pytest.mark.parametrize("hints, message", [
    (envelope(action({}, action_id="x"), action({}, action_id="y")), "2 chunkcache.chunks actions (action_id 'x', 'y')"),
    (envelope(action({}, version="2")), "action_version '2' is not supported (supported: '1')"),
    (envelope(action([[0, 2]])), "payload must be an object, got list"),
])
def test_bad_action(hints, message):
    with pytest.raises(HintError, match="^chunkcache hint: ") as e:
        find_payload(hints)
    assert message in str(e.value)


# --- parse ----------------------------------------------------------------------------------------------------------

def test_parse_full_payload():
    hint = parse({"token_spans": [[2, 5], [5, 9]], "namespace": "docs", "selector": "full", "ratio": 0.15}, 10)
    assert hint == ChunkHint(((2, 5), (5, 9)), "docs", "full", 0.15)


def test_parse_defaults_and_integer_ratio():
    assert parse({"token_spans": [(0, 1)]}, 2) == ChunkHint(((0, 1),), None, None, None)
    assert parse({"token_spans": [[0, 1]], "ratio": 1}, 2).ratio == 1.0


def test_payload_round_trip():
    hint = parse({"token_spans": [[1, 3], [4, 6]], "selector": "none", "ratio": 0}, 8)
    assert hint.to_payload() == {"token_spans": [[1, 3], [4, 6]], "selector": "none", "ratio": 0.0}
    assert parse(hint.to_payload(), 8) == hint


@pytest.mark.parametrize("payload, message", [
    ({"token_spans": [[5, 3]]}, "token_spans[0] = [5, 3] is empty: end 3 must be greater than start 5"),
    ({"token_spans": [[3, 3]]}, "token_spans[0] = [3, 3] is empty"),
    ({"token_spans": [[-1, 3]]}, "token_spans[0] = [-1, 3]: start -1 is negative"),
    ({"token_spans": [[0, 11]]}, "token_spans[0] = [0, 11]: end 11 is past the prompt (10 prompt tokens)"),
    ({"token_spans": [[2, 10]]}, "token_spans[0] = [2, 10] contains the last prompt token (index 9)"),
    ({"token_spans": [[0, 4], [3, 6]]}, "token_spans[1] = [3, 6] starts at 3, before the end 4 of token_spans[0]"),
    ({"token_spans": [[4, 6], [0, 2]]}, "token_spans[1] = [0, 2] starts at 0, before the end 6 of token_spans[0]"),
    ({"token_spans": []}, "token_spans must be a non-empty list"),
    ({"token_spans": "0,3"}, "token_spans must be a non-empty list"),
    ({"token_spans": [[0, 1.5]]}, "token_spans[0] must be a pair of integers [start, end], got [0, 1.5]"),
    ({"token_spans": [[True, 2]]}, "token_spans[0] must be a pair of integers"),
    ({"token_spans": [[0, 1, 2]]}, "token_spans[0] must be a pair of integers"),
    ({"token_spans": [[0, 2]], "foo": 1}, "unknown payload key(s) 'foo'; allowed: 'token_spans', 'namespace'"),
    ({"char_spans": [[0, 2]]}, "char_spans is for a text request; this request must mark its chunks with token_spans"),
    ({"token_spans": [[0, 2]], "namespace": ""}, "namespace must be a non-empty string, got ''"),
    ({"token_spans": [[0, 2]], "namespace": 3}, "namespace must be a non-empty string, got 3"),
    ({"token_spans": [[0, 2]], "selector": "nope"}, "selector 'nope' is not registered; known: "),
    ({"token_spans": [[0, 2]], "selector": 5}, "selector must be a string, got 5"),
    ({"token_spans": [[0, 2]], "ratio": 1.5}, "ratio must be in [0, 1], got 1.5"),
    ({"token_spans": [[0, 2]], "ratio": -0.1}, "ratio must be in [0, 1], got -0.1"),
    ({"token_spans": [[0, 2]], "ratio": "0.2"}, "ratio must be a number in [0, 1], got '0.2'"),
    ({"token_spans": [[0, 2]], "ratio": True}, "ratio must be a number in [0, 1], got True"),
    ({"token_spans": [[0, 2]], "ratio": float("nan")}, "ratio must be a number in [0, 1], got nan"),
    ({"token_spans": [[0, 2]], "exact": 1}, "exact must be true or false, got 1"),
    ({"token_spans": [[0, 2]], "exact": "true"}, "exact must be true or false, got 'true'"),
    ({"exact": True, "selector": "mix"}, "selector 'mix' cannot apply with exact: true"),
    ({"exact": True, "ratio": 0.2}, "ratio cannot apply with exact: true"),
    ({"token_spans": [[0, 2]], "learn": "no"}, "learn must be true or false, got 'no'"),
    ({"exact": True, "token_spans": [[0, 11]]}, "end 11 is past the prompt"),
    ({"exact": True, "char_spans": [[0, 2]]}, "char_spans is for a text request"),
    ({"token_spans": [[0, 2]], "max_kl": 0}, "max_kl must be a number > 0 (nats of KL over what kl_over names), got 0"),
    ({"token_spans": [[0, 2]], "max_kl": -0.1}, "max_kl must be a number > 0"),
    ({"token_spans": [[0, 2]], "max_kl": "0.1"}, "max_kl must be a number > 0"),
    ({"token_spans": [[0, 2]], "max_kl": float("inf")}, "max_kl must be a number > 0"),
    ({"token_spans": [[0, 2]], "max_kl": True}, "max_kl must be a number > 0"),
    ({"token_spans": [[0, 2]], "max_kl": 0.1, "ratio": 0.2}, "max_kl and ratio both set the recompute budget"),
    ({"exact": True, "max_kl": 0.1}, "max_kl cannot apply with exact: true"),
    ({"token_spans": [[0, 2]], "max_kl": 0.1, "kl_over": "tokens"}, "kl_over must be one of 'answer', 'first_token'"),
    ({"token_spans": [[0, 2]], "max_kl": 0.1, "kl_over": 1}, "kl_over must be one of"),
    ({"token_spans": [[0, 2]], "ratio": 0.2, "kl_over": "first_token"}, "kl_over says what a quality floor"),
    ({"exact": True, "kl_over": "answer"}, "cannot apply with exact: true"),
])
def test_parse_rejects(payload, message):
    with pytest.raises(HintError) as e:
        parse(payload, 10, selectors=REGISTRY)
    assert message in str(e.value)


def test_max_kl_is_kept_as_a_float():
    hint = parse({"token_spans": [[0, 2]], "max_kl": 1}, 10)
    assert hint.max_kl == 1.0 and isinstance(hint.max_kl, float)


def test_kl_over_is_kept_and_forwarded():
    hint = parse({"token_spans": [[0, 2]], "max_kl": 0.1, "kl_over": "first_token"}, 10)
    assert hint.kl_over == "first_token" and hint.to_payload()["kl_over"] == "first_token"
    assert parse({"token_spans": [[0, 2]], "max_kl": 0.1}, 10).kl_over is None
    assert parse(hint.to_payload(), 10) == hint


def test_a_payload_of_options_needs_no_spans():
    """`exact: true` alone is a whole hint, and so are options alone (a tenant, `learn: false`, a selector for what
    automatic detection finds): no spans, the canonical payload keeps only the options."""
    hint = parse({"exact": True}, 10, selectors=REGISTRY)
    assert hint == ChunkHint((), exact=True) and hint.to_payload() == {"exact": True}
    assert parse({"exact": True, "selector": "full"}, 10).selector == "full"
    assert hints.envelope(exact=True)["actions"][0]["payload"] == {"exact": True}
    options = parse({"namespace": "kb1", "learn": False, "ratio": 0.3}, 10, selectors=REGISTRY)
    assert options == ChunkHint((), namespace="kb1", ratio=0.3, learn=False)
    assert options.to_payload() == {"namespace": "kb1", "ratio": 0.3, "learn": False}
    assert parse({}, 10) == ChunkHint(())
    assert hints.envelope(namespace="kb1")["actions"][0]["payload"] == {"namespace": "kb1"}


def test_selector_names_are_judged_by_the_registry_passed_in():
    """The contract holds no registry of its own: an unknown name passes without one, fails with one."""
    assert parse({"token_spans": [[0, 2]], "selector": "nope"}, 10).selector == "nope"
    with pytest.raises(HintError, match="known: .*mix"):
        parse({"token_spans": [[0, 2]], "selector": "nope"}, 10, selectors=REGISTRY)


def test_request_contract_loads_without_the_model_stack():
    """The hint contract, the documents body and the prompt builder (imported by clients' frontend programs) need
    neither torch nor transformers."""
    code = ("import sys, chunkcache.hints, chunkcache.documents, chunkcache.prompt; "
            "print(sorted(m for m in ('torch', 'transformers', 'sglang') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_selector_registered_later_is_accepted(monkeypatch):
    with pytest.raises(HintError, match="'later' is not registered"):
        parse({"token_spans": [[0, 1]], "selector": "later"}, 4, selectors=REGISTRY)
    monkeypatch.setattr(REGISTRY, "_classes", dict(REGISTRY._classes))  # the registration ends with the test
    REGISTRY.register(type("Later", (), {"name": "later"}))
    assert parse({"token_spans": [[0, 1]], "selector": "later"}, 4, selectors=REGISTRY).selector == "later"


def test_hint_error_is_a_value_error():
    """SGLang's /generate maps ValueError to HTTP 400."""
    assert issubclass(HintError, ValueError)


# --- char spans -> token spans --------------------------------------------------------------------------------------

# "Hello world.\n\nDoc two?" with a BOS: token index, piece, (start, end)
#   0 <s> (0, 0)   1 Hello (0, 5)   2 " world" (5, 11)   3 "." (11, 12)   4 "\n\n" (12, 14)
#   5 Doc (14, 17)   6 " two" (17, 21)   7 "?" (21, 22)
OFFSETS = [(0, 0), (0, 5), (5, 11), (11, 12), (12, 14), (14, 17), (17, 21), (21, 22)]
TEXT_LEN = 22


@pytest.mark.parametrize("char_spans, token_spans", [
    ([[0, 12]], [(1, 4)]),  # the BOS (0, 0) belongs to no chunk
    ([[14, 21]], [(5, 7)]),
    ([[0, 12], [14, 21]], [(1, 4), (5, 7)]),
    ([[0, 5], [5, 11]], [(1, 2), (2, 3)]),  # adjacent chunks
    ([[12, 14]], [(4, 5)]),
    ([[0, 22]], [(1, 8)]),
])
def test_char_to_token_spans(char_spans, token_spans):
    assert char_to_token_spans(char_spans, OFFSETS, TEXT_LEN) == token_spans


@pytest.mark.parametrize("char_spans, message", [
    ([[6, 12]], "char_spans[0] = [6, 12]: start offset 6 falls inside token 2 (characters [5, 11)); "
                "a chunk must start and end on token boundaries, e.g. 5 or 11"),
    ([[0, 8]], "char_spans[0] = [0, 8]: end offset 8 falls inside token 2 (characters [5, 11))"),
    ([[0, 5], [14, 16]], "char_spans[1] = [14, 16]: end offset 16 falls inside token 5 (characters [14, 17))"),
    ([[0, 30]], "char_spans[0] = [0, 30]: end 30 is past the prompt (22 characters)"),
    ([[5, 12], [0, 5]], "char_spans[1] = [0, 5] starts at 0, before the end 12 of char_spans[0]"),
    ([[3, 3]], "char_spans[0] = [3, 3] is empty"),
])
def test_char_spans_rejected(char_spans, message):
    with pytest.raises(HintError) as e:
        char_to_token_spans(char_spans, OFFSETS, TEXT_LEN)
    assert message in str(e.value)


def test_char_span_over_uncovered_characters():
    """Some tokenizers leave characters (a dropped space) outside every token: a span of only those has no token."""
    offsets = [(0, 1), (2, 3)]  # "A B", the space uncovered
    with pytest.raises(HintError, match=r"char_spans\[0\] = \[1, 2\] covers no token"):
        char_to_token_spans([[1, 2]], offsets, 3)
    assert char_to_token_spans([[1, 3]], offsets, 3) == [(1, 2)]


def test_char_span_over_tokens_sharing_a_character():
    """Byte-level pieces of one multi-byte character all report that character's range."""
    offsets = [(0, 1), (0, 1), (1, 2), (2, 3)]  # "é" as two byte tokens, then "x", "y"
    assert char_to_token_spans([[0, 2]], offsets, 3) == [(0, 3)]


def test_char_payload_becomes_token_payload():
    payload = {"char_spans": [[0, 12], [14, 21]], "selector": "full", "ratio": 0.2, "namespace": "kb"}
    token_payload = char_spans_to_token_payload(payload, OFFSETS, TEXT_LEN)
    assert token_payload == {"token_spans": [(1, 4), (5, 7)], "selector": "full", "ratio": 0.2, "namespace": "kb"}
    assert payload["char_spans"] == [[0, 12], [14, 21]]  # the request's own payload is left as it was
    assert parse(token_payload, len(OFFSETS)).token_spans == ((1, 4), (5, 7))


def test_char_span_ending_on_the_last_token_is_rejected_after_mapping():
    with pytest.raises(HintError, match=r"token_spans\[0\] = \[1, 8\] contains the last prompt token \(index 7\)"):
        parse(char_spans_to_token_payload({"char_spans": [[0, 22]]}, OFFSETS, TEXT_LEN), len(OFFSETS))


@pytest.mark.parametrize("payload, message", [
    ({"token_spans": [[0, 2]]}, "token_spans is for an input_ids request; this request must mark its chunks with "
                                "char_spans"),
    ({"char_spans": [[0, 5]], "ratio": 0.1, "draft": "x"}, "unknown payload key(s) 'draft'"),
])
def test_text_request_payload_rejected(payload, message):
    with pytest.raises(HintError) as e:
        char_spans_to_token_payload(payload, OFFSETS, TEXT_LEN)
    assert message in str(e.value)


def test_unknown_protocol_version_is_refused():
    """An envelope of a protocol_version this server does not speak ("99") is refused, not read as its own."""
    env = {**envelope(action({"token_spans": [[0, 1]]})), "protocol_version": "99"}
    with pytest.raises(HintError, match="protocol_version '99' is not supported"):
        find_payload(env)


def test_namespace_length_is_bounded():
    """A namespace is bounded: it becomes the radix key, so a 1 MB namespace would be kept in the tree."""
    assert parse({"token_spans": [[0, 1]], "namespace": "n" * MAX_NAMESPACE_CHARS}, 4).namespace
    with pytest.raises(HintError, match=f"namespace is 1000000 characters; at most {MAX_NAMESPACE_CHARS}"):
        parse({"token_spans": [[0, 1]], "namespace": "n" * 1_000_000}, 4)


def test_span_count_is_bounded_before_the_spans_are_read():
    spans = [[i, i + 1] for i in range(400)]
    with pytest.raises(HintError, match="token_spans has 400 spans; at most 64"):
        parse({"token_spans": spans}, 1000, max_spans=64)
    with pytest.raises(HintError, match="char_spans has 400 spans; at most 8"):
        char_spans_to_token_payload({"char_spans": spans}, [(i, i + 1) for i in range(500)], 500, max_spans=8)
    assert len(parse({"token_spans": spans}, 1000).token_spans) == 400  # the bound is the server's, not the contract's
