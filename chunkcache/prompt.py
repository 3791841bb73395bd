"""RAG prompts as token ids whose document chunks tokenize the same whatever surrounds them.

The chat template is rendered once around a placeholder; the text before the first document (system turn, user
turn header, instruction) is the shared prefix, each document is tokenized on its own (with its separator) and the
ids are concatenated, then the question and the assistant header follow. So a document always maps to the same
token ids, and the same documents in any order give chunk keys that match (keys also hash the shared prefix:
requests share chunks only when they share the system prompt and instruction). `assemble` does the same for a
prompt already rendered as text (an SGLang frontend program), its chunks given as character spans.

A whole conversation (history, tool calls and results, tools) is rendered by the server's own chat templating with a
special token in the documents' place (`slot_token`, in the first user turn as `user_turn` writes it); `splice` puts
the documents' chunks where that token landed. A special token is split from the text before tokenization, so the
text on each side of it is tokenized on its own, as `build` tokenizes the shared prefix and the tail: the chunks and
the prefix are `build`'s, and every other token is the template's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .hints import envelope

DEFAULT_SYSTEM = "You are a helpful assistant. Answer the question using the documents."
DEFAULT_INSTRUCTION = "Documents:\n\n"
# Placeholder for the documents while the template renders. It starts with \x00 and ends with \x01, each found
# nowhere else in it, so two occurrences can never overlap: one not inside the client's text is the inserted one.
_SLOT = "\x00CHUNKCACHE_DOCUMENTS\x01"


@dataclass(frozen=True)
class RagPrompt:
    input_ids: list[int]
    token_spans: list[tuple[int, int]]  # one per document, end exclusive

    def kv_hints(self, **options: Any) -> dict:
        """The request's `kv_hints` (options: hints.OPTIONAL_KEYS)."""
        return envelope(self.token_spans, **options)


def chunk_ids(tokenizer, text: str) -> list[int]:
    """A document's token ids, independent of its neighbours."""
    return tokenizer.encode(text, add_special_tokens=False)


def chunks_of(tokenizer, documents: Sequence[str], sep: str = "\n\n") -> list[list[int]]:
    """Each document's chunk: the document and the separator after it, tokenized on its own."""
    return [chunk_ids(tokenizer, doc + sep) for doc in documents]


def user_turn(question: str, slot: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The text of the user turn that holds the documents: the instruction, the documents' `slot`, the question."""
    return f"{instruction}{slot}{question}"


def build(tokenizer, documents: Sequence[str], question: str, *, system: str | None = DEFAULT_SYSTEM,
          instruction: str = DEFAULT_INSTRUCTION, sep: str = "\n\n") -> RagPrompt:
    """The chat-template prompt `system` + user(`instruction` + documents + `question`) + assistant header; for a
    tokenizer without a chat template (a base model: gemma-3-270m), the plain text BOS + `system` + blank line +
    `instruction` + documents + `question`."""
    if not documents:
        raise ValueError("a RAG prompt needs at least one document")
    # the placeholder must occur once in the rendered text: a client's text that contains it gets another one
    slot, n = _SLOT, 0
    while any(slot in part for part in (system or "", instruction, question)):
        n += 1
        slot = f"{_SLOT[:-1]}_{n}\x01"
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user_turn(question, slot, instruction)}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = (tokenizer.bos_token or "") + (f"{system}\n\n" if system else "") + messages[-1]["content"]
    head, tail = text.split(slot)
    ids = tokenizer.encode(head, add_special_tokens=False)
    spans = []
    for chunk in chunks_of(tokenizer, documents, sep):
        spans.append((len(ids), len(ids) + len(chunk)))
        ids += chunk
    ids += tokenizer.encode(tail, add_special_tokens=False)
    return RagPrompt(ids, spans)


def slot_token(tokenizer, text: str) -> str:
    """A special token to hold the documents' place while a chat template renders a conversation: an added special
    token (kept whole, the text on each side tokenized on its own), none of the named ones (BOS, EOS, UNK, PAD: the
    tokenizer or the template may add them), found neither in the chat template nor in `text` (everything of the
    request the template renders), so it occurs once in the rendered prompt. The last added one that fits: the first
    ones are the template's role markers."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    named = set(tokenizer.special_tokens_map.values())
    for _, added in sorted(tokenizer.added_tokens_decoder.items(), reverse=True):
        token = added.content
        if added.special and token not in named and token not in template and token not in text:
            return token
    raise ValueError("the tokenizer has no special token that neither its chat template nor the request holds, to mark "
                     "the documents' place in the rendered conversation")


def splice(ids: Sequence[int], slot_id: int, chunks: Sequence[Sequence[int]]) -> RagPrompt:
    """The rendered prompt `ids`, which holds the slot token `slot_id` once, with the chunks' ids in its place, one
    span each. A chunk that would hold the prompt's last token gets no span (that token is always recomputed)."""
    if list(ids).count(slot_id) != 1:
        raise ValueError(f"the rendered conversation holds the documents' place {list(ids).count(slot_id)} times, "
                         f"not once: the chat template dropped or repeated the first user message")
    at = list(ids).index(slot_id)
    out, spans = list(ids[:at]), []
    for chunk in chunks:
        spans.append((len(out), len(out) + len(chunk)))
        out += chunk
    out += ids[at + 1:]
    return RagPrompt(out, [(s, e) for s, e in spans if e < len(out)])


def assemble(text: str, chunks: Sequence[tuple[int, int]], encode: Callable[[list[str]], list[list[int]]], *,
             head: Sequence[int] = ()) -> RagPrompt:
    """Token ids of an already rendered `text` whose chunks (sorted, disjoint character spans) are tokenized each on
    its own; each stretch of text between chunks is tokenized as one piece, as a plain prompt would be.

    `encode` tokenizes a list of strings without special tokens; `head` (e.g. a BOS id) goes first. A chunk that
    would hold the prompt's last token stays plain text: that token is always recomputed, so no hint may cover it.
    """
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for start, end in chunks:
        if start < pos or end <= start or end > len(text):
            raise ValueError(f"chunk [{start}, {end}) is not a sorted, disjoint, non-empty span of the text")
        if start > pos:
            pieces.append((text[pos:start], False))
        pieces.append((text[start:end], True))
        pos = end
    if pos < len(text):
        pieces.append((text[pos:], False))
    ids, spans = list(head), []
    for (_, is_chunk), piece_ids in zip(pieces, encode([p for p, _ in pieces])):
        if is_chunk and piece_ids:
            spans.append((len(ids), len(ids) + len(piece_ids)))
        ids += piece_ids
    return RagPrompt(ids, [(s, e) for s, e in spans if e < len(ids)])
