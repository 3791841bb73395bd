"""RAG primitives for SGLang frontend programs, and the backend that sends their chunks for reuse.

    import sglang as sgl
    from sglang_patch import lang

    @sgl.function
    def qa(s, question, docs):
        s += sgl.user(lang.documents(docs) + "Question: " + question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=32))

    sgl.set_default_backend(lang.ChunkcacheEndpoint("http://127.0.0.1:30000"))

A chunk is program text (an `SglConstantText`), so roles, `fork`, tracing and the stock interpreter handle it as
text; two hooks on the interpreter (`hooks()`, part of plugin.hooks()'s table) record where it lands in the
program's text. `ChunkcacheEndpoint` sends a program that
holds chunks as token ids, each chunk tokenized on its own (so it maps to the same ids wherever it sits), with a
`chunkcache.chunks` hint; a program without chunks is sent exactly as `RuntimeEndpoint` sends it. The shared prefix
of the chunks is everything the program wrote before its first chunk.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Sequence

import requests
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.interpreter import StreamExecutor
from sglang.lang.ir import SglConstantText, SglExprList
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from chunkcache.prompt import assemble

SPANS = "chunkcache_spans"  # StreamExecutor attribute: character spans of the chunks in its text_
_SELECTING = "chunkcache_selecting"  # StreamExecutor attribute: set while select() runs
_EXECUTOR = "sglang.lang.interpreter.StreamExecutor"


class Chunk(SglConstantText):
    """Program text to reuse as a chunk."""

    def __init__(self, value: str):
        _install_hooks()
        super().__init__(value)

    def __repr__(self) -> str:
        return f"Chunk({self.value!r})"


def chunk(text: str) -> Chunk:
    if not isinstance(text, str) or not text:
        raise ValueError(f"a chunk must be a non-empty string, got {text!r}")
    return Chunk(text)


def documents(docs: Sequence[str], sep: str = "\n\n") -> SglExprList:
    """One chunk per document, each followed by `sep` (inside the chunk, as chunkcache.prompt.build does)."""
    if isinstance(docs, str) or not isinstance(docs, Sequence) or not docs:
        raise ValueError(f"documents() needs a non-empty list of strings, got {docs!r:.80}")
    for i, doc in enumerate(docs):
        if not isinstance(doc, str) or not doc.strip():
            raise ValueError(f"documents[{i}] must be a non-empty string, got {doc!r:.80}")
    return SglExprList([Chunk(doc + sep) for doc in docs])


def chunk_spans(executor: StreamExecutor) -> list[tuple[int, int]]:
    return executor.__dict__.setdefault(SPANS, [])


def hooks() -> list[tuple[str, object, HookType]]:
    """The interpreter's hooks, (target, hook, kind) as in plugin.hooks(), which lists them with the server's: its
    `_execute` is a closed isinstance chain (a Chunk runs as the text it is), and `fork` copies a program's state
    field by field."""
    return [(f"{_EXECUTOR}._execute", _record_chunk, HookType.AROUND),
            (f"{_EXECUTOR}.fork", _copy_spans, HookType.AFTER)]


def _record_chunk(execute, executor: StreamExecutor, expr: Any) -> None:
    start = len(executor.text_)
    execute(executor, expr)
    if isinstance(expr, Chunk) and len(executor.text_) > start:
        chunk_spans(executor).append((start, len(executor.text_)))


def _copy_spans(children: list[StreamExecutor], executor: StreamExecutor, *args: Any, **kwargs: Any) -> None:
    for child in children:
        setattr(child, SPANS, list(chunk_spans(executor)))


_installed = False
_install_lock = threading.Lock()


def _install_hooks() -> None:
    """Register and apply `hooks()` once per process, when its first chunk is made. A frontend program runs no
    SGLang plugin loader, so nothing else would; a chunk is what needs them, and by the time one exists no loader is
    half-way through (applying hooks then would apply other plugins' before they are all registered). In a process
    that also runs the loader (an in-process Engine), it installs them from plugin.hooks() too, and whichever of
    the two comes second finds the targets patched: SGLang applies a target once."""
    global _installed
    with _install_lock:
        if not _installed:
            for target, hook, kind in hooks():
                HookRegistry.register(target, hook, kind)
            HookRegistry.apply_hooks()
            _installed = True


class ChunkcacheEndpoint(RuntimeEndpoint):
    """A `RuntimeEndpoint` for a chunkcache server. `selector`, `ratio` and `namespace` go into every chunk hint
    (None: the server's config); other keyword arguments are RuntimeEndpoint's (api_key, chat_template_name, ...).
    Tokenization is the server's own (`/tokenize`), so the client needs no model files."""

    def __init__(self, base_url: str, *, selector: str | None = None, ratio: float | None = None,
                 namespace: str | None = None, **kwargs: Any):
        super().__init__(base_url, **kwargs)
        self.hint_options = {k: v for k, v in {"selector": selector, "ratio": ratio, "namespace": namespace}.items()
                             if v is not None}
        self._head: list[int] | None = None

    def generate_stream(self, s: StreamExecutor, sampling_params: Any) -> Iterator[tuple[str, dict]]:
        # the chunk report comes with a streamed request's first chunk; the program keeps the last chunk's meta_info
        report = None
        for text, meta_info in super().generate_stream(s, sampling_params):
            report = meta_info.get("chunkcache", report)
            yield text, meta_info if report is None else {**meta_info, "chunkcache": report}

    def select(self, s: StreamExecutor, *args: Any, **kwargs: Any) -> Any:
        # select() scores the choices with text requests at a token offset taken from its own prefix request, so
        # that one must be tokenized as text too: no chunks while it runs
        s.__dict__[_SELECTING] = True
        try:
            return super().select(s, *args, **kwargs)
        finally:
            del s.__dict__[_SELECTING]

    def _add_images(self, s: StreamExecutor, data: dict) -> None:
        # Every request that carries the program's text (gen, streamed gen, fork's commit) passes here right before
        # it is posted: the one place to swap the text for token ids and a chunk hint.
        super()._add_images(s, data)
        if (data.get("text") != s.text_ or "image_data" in data or data.get("return_logprob")
                or s.__dict__.get(_SELECTING)):
            return
        spans = [span for span in chunk_spans(s) if span[1] <= len(s.text_)]
        if not spans:
            return
        prompt = assemble(s.text_, spans, self._encode, head=self._special_head())
        if prompt.token_spans:
            del data["text"]
            data.update(input_ids=prompt.input_ids, kv_hints=prompt.kv_hints(**self.hint_options))

    def _special_head(self) -> list[int]:
        """What the server's tokenizer puts before a text prompt (e.g. BOS), as it does for stock text requests."""
        if self._head is None:
            self._head = self._tokenize("", add_special_tokens=True)
        return self._head

    def _encode(self, pieces: list[str]) -> list[list[int]]:
        return self._tokenize(pieces, add_special_tokens=False)

    def _tokenize(self, prompt: str | list[str], *, add_special_tokens: bool) -> Any:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        res = requests.post(self.base_url + "/tokenize", json={"prompt": prompt, "add_special_tokens": add_special_tokens},
                            headers=headers, verify=self.verify if self.verify is not None else True, timeout=60)
        self._assert_success(res)
        return res.json()["tokens"]
