"""RAG prompts built off the HTTP server's event loop.

Tokenizing a document takes time in proportion to its length (a 5 MB document: seconds), and the routes that build
prompts (/v1/chat/completions with documents, /chunkcache/ingest) run on the event loop that serves every client,
/health included. So prompts are built on one worker thread (HF fast tokenizers release the GIL while encoding),
with a tokenizer of its own: a fast tokenizer must not be used by two threads at once, and SGLang's tokenizer
manager keeps using the server's on the event loop.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from chunkcache.prompt import RagPrompt, build

_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunkcache-prompt")
_tokenizer = None  # the worker's copy, made on the event loop (while nothing else can use the original)


async def build_prompt(tokenizer, documents: Sequence[str], question: str, system: str) -> RagPrompt:
    """chunkcache.prompt.build(tokenizer, documents, question, system=system), run on the worker thread."""
    global _tokenizer
    if _tokenizer is None:
        _tokenizer = copy.deepcopy(tokenizer)
    return await asyncio.get_running_loop().run_in_executor(
        _EXECUTOR, lambda: build(_tokenizer, documents, question, system=system))
