"""Every refusal the request validators can give has a case in the live-server probe's tables (tests/test_bad_input.py).

The refusals are read from the code: every `raise` in the validators of the three surfaces (the chunk hint of
/generate, the documents of /v1/chat/completions and /chunkcache/ingest). Each table case is then driven in-process
through the same glue functions the server runs (SGLang's envelope decoding, hint_validation.check_request,
chat.handle_request, ingest.ingest), and the `raise` statement that refused it is read from the traceback. A new
check without a case, or a case that no longer reaches the check it was written for, fails here in seconds, without
the server that the probe itself needs. No server and no model weights: the default model's tokenizer only.
"""

import ast
import asyncio
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from test_bad_input import CHAT, CHAT_QUESTION, GENERATE, IN_FLIGHT, INGEST, MAX_DOCS, MAX_SPANS

import chunkcache.documents
import chunkcache.hints
from sglang_patch.http import chat, hint_validation, ingest

VALIDATORS = [chunkcache.hints, chunkcache.documents, hint_validation, chat]
CLIENT_SIDE = {"envelope"}  # chunkcache.hints.envelope builds a client's hint; it is not a server check

# Checks no request to the probe's server can reach, each driven by a unit test with a stand-in instead:
# (module, a fragment of the raise statement's source) -> why
UNREACHABLE = {
    ("hint_validation", "not input_embeds"): "SGLang refuses input_embeds while the radix cache is on, before the "
                                             "hook runs (tests/test_hints_glue.py)",
    ("hint_validation", "need a fast tokenizer"): "the default model's tokenizer is fast (tests/test_hints_glue.py)",
    ("hint_validation", "not a plain tokenization"): "only a multimodal processor rewrites a text's ids "
                                                     "(tests/test_hints_glue.py)",
    ("hints", "covers no token"): "the default model's byte-level tokenizer covers every character "
                                  "(tests/test_hints.py)",
    ("hints", "payload must be an object"): "SGLang's envelope struct types the payload as an object: it refuses "
                                            "the request first (tests/test_hints.py)",
    ("chat", "without a chat template"): "the default model has a chat template (tests/test_documents_prompt.py)",
}
# Cases refused by SGLang itself, before or after chunkcache's checks: they reach none of the raises above
SGLANG_REFUSES = {("generate", "envelope without message_id"), ("generate", "payload not an object"),
                  ("ingest", "document over the context")}


class ReachedSGLang(Exception):
    """Raised by the stand-ins for what runs after validation: the case passed every chunkcache check."""


def raise_sites() -> dict[tuple[str, int], str]:
    """(file, line) of every line of every `raise <call>` in the validators -> "module: first line of the raise"."""
    sites = {}
    for module in VALIDATORS:
        path = Path(module.__file__)
        source = path.read_text()
        name = module.__name__.rsplit(".", 1)[-1]
        for func in ast.walk(ast.parse(source)):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or func.name in CLIENT_SIDE:
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                    text = f"{name}: {ast.get_source_segment(source, node)}"
                    for line in range(node.lineno, node.end_lineno + 1):
                        sites[(str(path), line)] = text
    return sites


def sites_of(exc: BaseException, sites: dict) -> set[str]:
    """The validator raises along the exception's chain (a documents error re-raises the hint error it caught)."""
    found = set()
    while exc is not None:
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None and (site := sites.get((tb.tb_frame.f_code.co_filename, tb.tb_lineno))):
            found.add(site)
        exc = exc.__context__
    return found


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from chunkcache.models import DEFAULT_MODEL, resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))


@pytest.fixture
def glue(monkeypatch, tokenizer):
    """The probe server's limits, and stand-ins for what runs after the checks."""
    limits = SimpleNamespace(max_spans=MAX_SPANS, ingest_in_flight=IN_FLIGHT, ingest_max_documents=MAX_DOCS)
    for module in (hint_validation, chat, ingest):
        monkeypatch.setattr(module, "server_limits", lambda: limits)

    async def build_prompt(*args, **kwargs):
        raise ReachedSGLang("the prompt would be built now")

    monkeypatch.setattr(chat, "build_prompt", build_prompt)
    server = ModuleType("sglang.srt.entrypoints.http_server")  # ingest reads the tokenizer manager from it

    def get_global_state():
        raise ReachedSGLang("the documents would be sent to the scheduler now")

    server.get_global_state = get_global_state
    monkeypatch.setitem(sys.modules, server.__name__, server)
    # the routes turn a refusal into a 400 inside their `except`: keep the exception itself, traceback included
    monkeypatch.setattr(ingest, "error_response", lambda message, status: sys.exc_info()[1])
    return SimpleNamespace(tokenizer=tokenizer)


def run_generate(glue, body) -> BaseException | None:
    """/generate as SGLang runs it: the envelope decoded into its struct (io_struct), the text tokenized, then
    chunkcache's hook on TokenizerManager._create_tokenized_object."""
    from sglang.srt.managers.kv_hints import decode_kv_hints_envelope

    try:
        envelope = decode_kv_hints_envelope(body["kv_hints"]) if body.get("kv_hints") else None
        text = body.get("text")
        ids = body["input_ids"] if "input_ids" in body else glue.tokenizer(text)["input_ids"]
        tokenized = SimpleNamespace(kv_hints=envelope, extra_key=body.get("extra_key"))
        obj = SimpleNamespace(input_ids=body.get("input_ids"), input_embeds=body.get("input_embeds"))
        hint_validation.check_request(tokenized, SimpleNamespace(tokenizer=glue.tokenizer), obj, text, ids)
    except ValueError as exc:
        return exc
    return None


def run_chat(glue, documents, extra) -> BaseException | None:
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    body = {"messages": CHAT_QUESTION, "max_tokens": 4, "chunkcache": documents, **extra}
    raw = SimpleNamespace(json=lambda: asyncio.sleep(0, body), state=SimpleNamespace())
    serving = SimpleNamespace(create_error_response=lambda message: sys.exc_info()[1],
                              tokenizer_manager=SimpleNamespace(tokenizer=glue.tokenizer))
    request = ChatCompletionRequest(**{k: v for k, v in body.items() if k != "chunkcache"})
    async def sglang_templates(*args):
        raise ReachedSGLang("SGLang would render the conversation now")

    try:
        return asyncio.run(chat.handle_request(sglang_templates, serving, request, raw))
    except ReachedSGLang:
        return None


def run_ingest(glue, body) -> BaseException | None:
    request = SimpleNamespace(json=lambda: asyncio.sleep(0, body))
    try:
        return asyncio.run(ingest.ingest(request))
    except ReachedSGLang:
        return None


def test_every_refusal_of_the_validators_has_a_case_in_the_probe(glue):
    sites = raise_sites()
    assert len(set(sites.values())) >= 30, "the raise statements were not found"  # the parse itself works
    cases = [("generate", name, lambda body=body: run_generate(glue, body), message)
             for name, (body, message) in GENERATE.items()]
    cases += [("chat", name, lambda docs=docs, extra=extra: run_chat(glue, docs, extra[0] if extra else {}), message)
              for name, (docs, message, *extra) in CHAT.items()]
    cases += [("ingest", name, lambda body=body: run_ingest(glue, body), message)
              for name, (body, message) in INGEST.items()]
    covered, not_ours = set(), set()
    for surface, name, run, message in cases:
        exc = run()
        reached = sites_of(exc, sites) if exc is not None else set()
        if not reached:
            not_ours.add((surface, name))
            continue
        assert message in str(exc), (surface, name, str(exc))  # the table's message is this check's
        covered |= reached
    assert not_ours == SGLANG_REFUSES, "cases that reach no chunkcache check"
    unreachable = {site for site in set(sites.values()) for (module, fragment) in UNREACHABLE
                   if site.startswith(module + ":") and fragment in site}
    assert len(unreachable) == len(UNREACHABLE), "an UNREACHABLE entry names no raise statement"
    missing = set(sites.values()) - covered - unreachable
    assert not missing, "checks no case of tests/test_bad_input.py reaches:\n" + "\n".join(sorted(missing))
