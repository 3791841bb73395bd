"""chunkcache: selective KV-cache reuse for RAG serving (engine-agnostic core; never imports sglang)."""

__version__ = "0.1.0"
