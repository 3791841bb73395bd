"""The observability docs cannot drift from the series: docs/grafana/chunkcache.json charts only series that
sglang_patch.scheduler.metrics defines (chunkcache_*) or SGLang's collector does (sglang:*), each selected by the
dashboard's `model_name` variable, the label both carry; docs/observability.md lists every chunkcache series."""

import ast
import importlib.util
import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from sglang_patch.scheduler import metrics

DOCS = Path(__file__).resolve().parents[1] / "docs"
DASHBOARD = DOCS / "grafana" / "chunkcache.json"
SERIES = re.compile(r"\b(chunkcache_\w+|sglang:[\w:]+)(\{[^}]*\})?")
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created")}


def sample_names(kind: str, name: str) -> set[str]:
    """The names a family's samples are exposed under (a counter's family name is without `_total`)."""
    base = name.removesuffix("_total") if kind == "counter" else name
    return {base + suffix for suffix in SUFFIXES[kind]}


def chunkcache_families() -> dict[str, str]:
    """name -> type of every family sglang_patch.scheduler.metrics defines."""
    registry = CollectorRegistry()
    metrics.start(True, model_name="m", registry=registry)
    try:
        return {family.name: family.type for family in registry.collect()}
    finally:
        metrics.start(False)


def chunkcache_series() -> set[str]:
    return {n for name, kind in chunkcache_families().items() for n in sample_names(kind, name)}


def sglang_series() -> set[str]:
    """Every sglang:* series SGLang's metrics collector defines, read from its source (nothing started)."""
    path = importlib.util.find_spec("sglang.srt.observability.metrics_collector").origin
    names = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.Call):
            kind = getattr(node.func, "id", getattr(node.func, "attr", ""))
            name = next((k.value.value for k in node.keywords if k.arg == "name"
                         and isinstance(k.value, ast.Constant)), None)
            if kind in ("Counter", "Gauge", "Histogram", "Summary") and isinstance(name, str):
                names |= sample_names(kind.lower(), name)
    return names


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, query) of every panel, those inside rows too."""
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def test_every_series_the_dashboard_charts_is_defined_and_selected_by_model():
    dashboard = json.loads(DASHBOARD.read_text())
    assert "model_name" in {v["name"] for v in dashboard["templating"]["list"]}
    known = chunkcache_series() | sglang_series()
    assert "sglang:time_to_first_token_seconds_bucket" in known  # SGLang's source was read
    charted = set()
    for title, query in queries(dashboard):
        found = SERIES.findall(query)
        assert found, f"{title}: no series in {query}"
        for name, selector in found:
            assert name in known, f"{title}: {name} is not a series chunkcache or SGLang defines"
            assert 'model_name=~"$model_name"' in selector, f"{title}: {name} is not selected by $model_name"
            charted.add(name)
    assert {"sglang:time_to_first_token_seconds_bucket", "sglang:cached_tokens_total"} <= charted


def test_every_chunkcache_series_is_documented():
    text = (DOCS / "observability.md").read_text()
    missing = [name for name, kind in chunkcache_families().items()
               if f"`{name}{'_total' if kind == 'counter' else ''}`" not in text]
    assert not missing, f"docs/observability.md does not list {missing}"
