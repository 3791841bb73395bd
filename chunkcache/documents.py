"""The documents a client hands the server to reuse: the `"chunkcache"` object of a /v1/chat/completions request
and the body of POST /chunkcache/ingest.

    {"documents": ["...", "..."], "selector": "prophet", "ratio": 0.15, "namespace": "kb1"}

Each document becomes one chunk (see prompt.build). A chat request may leave the documents out and send only options
(`{"exact": true}`, `{"namespace": "kb1", "learn": false}`): computed by the model's own prefill, no reused KV (hints: `exact`). Pure Python: validated here, so both routes answer a malformed
body with the same HTTP 400 message. Ingest also takes `cache_salt` (SGLang's per-tenant isolation salt; chat
requests carry theirs in the OpenAI body): chunks stored under a salt are found only by requests with that salt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .hints import HintError, SelectorNames, parse_options

CHAT_KEYS = ("documents", "selector", "ratio", "namespace", "exact", "max_kl", "learn", "kl_over")
INGEST_KEYS = ("documents", "system", "namespace", "cache_salt")


class DocumentsError(ValueError):
    """A malformed documents body (a ValueError: the routes answer it with HTTP 400 and this message)."""


@dataclass(frozen=True)
class Documents:
    documents: tuple[str, ...]  # empty only for an `exact` request without documents
    namespace: str | None = None
    selector: str | None = None
    ratio: float | None = None
    system: str | None = None
    cache_salt: str | None = None
    exact: bool | None = None
    max_kl: float | None = None
    learn: bool | None = None
    kl_over: str | None = None

    def hint_options(self) -> dict[str, Any]:
        """The chunk hint's optional keys (prompt.RagPrompt.kv_hints), None values left out."""
        options = {"namespace": self.namespace, "selector": self.selector, "ratio": self.ratio, "exact": self.exact,
                   "max_kl": self.max_kl, "learn": self.learn, "kl_over": self.kl_over}
        return {k: v for k, v in options.items() if v is not None}


def parse(body: Any, *, where: str, allowed: tuple[str, ...], max_documents: int | None = None,
          limit: str = "", selectors: SelectorNames | None = None, options_only: bool = False) -> Documents:
    """Validate a documents body; `where` names it in errors (e.g. "chunkcache" for the chat extra body). More than
    `max_documents` documents is an error naming `limit`, the config key that sets it; `selectors` judges a
    `selector` (hints.parse_options). `options_only`: a body without `documents` is options alone (chat)."""
    if not isinstance(body, dict):
        raise DocumentsError(f'{where} must be an object like {{"documents": ["..."]}}, got {_kind(body)}')
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise DocumentsError(f"unknown key(s) {', '.join(map(repr, unknown))} in {where}; "
                             f"allowed: {', '.join(map(repr, allowed))}")
    try:
        namespace, selector, ratio, exact, max_kl, learn, kl_over = parse_options(body, selectors)
    except HintError as exc:
        raise DocumentsError(f"{where}: {str(exc).removeprefix('chunkcache hint: ')}") from None
    docs = body.get("documents")
    if docs is None and options_only:  # the messages are templated as usual (a tenant, `exact`, `learn: false`)
        return Documents((), namespace, selector, ratio, exact=exact, max_kl=max_kl, learn=learn, kl_over=kl_over)
    if not isinstance(docs, list) or not docs:
        raise DocumentsError(f"{where}.documents must be a non-empty list of strings, got {_kind(docs)}")
    if max_documents is not None and len(docs) > max_documents:
        raise DocumentsError(f"{where}.documents has {len(docs)} documents; at most {max_documents} per request "
                             f"(server {limit})")
    for i, doc in enumerate(docs):
        if not isinstance(doc, str) or not doc.strip():
            raise DocumentsError(f"{where}.documents[{i}] must be a non-empty string, got {_kind(doc)}")
    system, salt = body.get("system"), body.get("cache_salt")
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise DocumentsError(f"{where}.system must be a non-empty string, got {_kind(system)}")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise DocumentsError(f"{where}.cache_salt must be a non-empty string, got {_kind(salt)}")
    return Documents(tuple(docs), namespace, selector, ratio, system, salt, exact, max_kl, learn, kl_over)


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, str):
        return "an empty string" if not value.strip() else f"a string ({value[:40]!r})"
    if isinstance(value, list):
        return "an empty list" if not value else f"a list of {len(value)}"
    return f"{type(value).__name__} {str(value)[:40]}"
