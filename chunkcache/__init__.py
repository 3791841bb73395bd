"""chunkcache: selective KV-cache reuse for RAG serving (engine-agnostic core; never imports sglang)."""

__version__ = "0.1.0"  # the one place the version is written: pyproject.toml reads it (CHANGELOG.md)
