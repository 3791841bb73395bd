"""Selectors: one module per selector, all behind `base.Selector`. Importing this package registers them. A module is
named for its selector's registry name but one: `draft_norm` registers `spec` (SpecCache's selector, which scores tokens
by a draft model's hidden-state norms; SpeCache's decode-time offload is chunkcache.specache)."""

# each registers its selectors
from . import cacheblend, clip, draft_norm, epic, mix, oracle, prophet, trivial  # noqa: F401
from .base import REGISTRY, Features, Layout, Selection, Selector

__all__ = ["REGISTRY", "Features", "Layout", "Selection", "Selector", "create"]


def create(name: str, **options) -> Selector:
    return REGISTRY.create(name, **options)
