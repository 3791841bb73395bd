"""Selectors: one module per selector, all behind `base.Selector`. Importing this package registers them."""

from . import cacheblend, clip, epic, mix, oracle, prophet, spec, trivial  # noqa: F401  (each registers its selectors)
from .base import REGISTRY, Features, Layout, Selection, Selector

__all__ = ["REGISTRY", "Features", "Layout", "Selection", "Selector", "create"]


def create(name: str, **options) -> Selector:
    return REGISTRY.create(name, **options)
