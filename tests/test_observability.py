"""The observability docs cannot drift from the series: docs/grafana/chunkcache.json charts only series that
sglang_patch.scheduler.metrics defines (chunkcache_*) or SGLang's collector does (sglang:*), each selected by the
dashboard's `model_name` variable, the label both carry; docs/grafana/alerts.yaml's rules are well-formed and name
only such series, per served model; docs/observability.md lists every chunkcache series. What a server says about
itself: its versions (chunkcache_info, /server_info), its store's capacity per tier, the config it runs on with its
secrets masked."""

import ast
import importlib.metadata
import importlib.util
import json
import re
import secrets
import types
from pathlib import Path

import pytest
import requests
import yaml
from prometheus_client import CollectorRegistry

import chunkcache
from chunkcache.config import MASK, REMOTE_SECRET_ENV, Config
from chunkcache.ranks import Ranks
from chunkcache.store import ChunkStore
from sglang_patch.scheduler import metrics
from sglang_patch.scheduler.server import ChunkServer
from sglang_patch.serve.server_process import free_port

DOCS = Path(__file__).resolve().parents[1] / "docs"
DASHBOARD = DOCS / "grafana" / "chunkcache.json"
ALERTS = DOCS / "grafana" / "alerts.yaml"
SGLANG_VERSION = importlib.metadata.version("sglang")
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


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def test_every_alert_is_a_well_formed_rule_over_defined_series_per_model():
    """Prometheus's rule-file shape (promtool is not installed here: checked by structure), each rule's expression
    over series chunkcache or SGLang defines, every aggregation keeping `model_name` (and so alerting per served
    model, as the dashboard selects one)."""
    known = chunkcache_series() | sglang_series()
    rules = alert_rules()
    assert {"ChunkcacheRemoteStoreDown", "ChunkcacheFallbackRateHigh", "ChunkcacheReuseShareFalling"} <= {
        rule["alert"] for rule in rules}
    for rule in rules:
        name, expr = rule["alert"], rule["expr"]
        assert rule.keys() == {"alert", "expr", "for", "labels", "annotations"}, name
        assert re.fullmatch(r"\d+[smhd]", rule["for"]), name
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), name
        assert rule["annotations"]["summary"].strip() and rule["annotations"]["description"].strip(), name
        depth = 0
        for char in expr:  # brackets balanced and closed in order
            depth += {"(": 1, ")": -1}.get(char, 0)
            assert depth >= 0, name
        assert depth == 0 and expr.count("[") == expr.count("]") and expr.count("{") == expr.count("}"), name
        found = SERIES.findall(expr)
        assert found, f"{name}: no series in {expr}"
        for series, _ in found:
            assert series in known, f"{name}: {series} is not a series chunkcache or SGLang defines"
        aggregations = re.findall(r"\b(?:sum|min|max|avg|count)\b\s*(by\s*\([^)]*\))?\s*\(", expr)
        assert aggregations and all("model_name" in by for by in aggregations), f"{name}: aggregated past model_name"


def test_build_info_and_the_stores_capacity_per_tier(tmp_path):
    """chunkcache_info is 1 labelled with both versions; chunkcache_store_capacity_bytes{tier} is the budget of each
    local tier of the store the server's config builds (0 for a tier that is off)."""
    registry = CollectorRegistry()
    metrics.start(True, model_name="m", registry=registry)
    try:
        def value(name, **labels):
            return registry.get_sample_value(name, {"model_name": "m", **labels})

        assert value("chunkcache_info", version=chunkcache.__version__, sglang_version=SGLANG_VERSION) == 1
        assert value("chunkcache_store_capacity_bytes", tier="host") == 0  # until a server is built
        config = Config()
        config.store.host_bytes, config.store.disk_bytes = 3 << 20, 5 << 20
        for disk_dir, disk_bytes in ((str(tmp_path), 5 << 20), (None, 0)):
            config.store.disk_dir = disk_dir
            ChunkServer(types.SimpleNamespace(config=config, ranks=Ranks()))
            store = ChunkStore.from_config(config.store)  # the tiers this config builds
            assert value("chunkcache_store_capacity_bytes", tier="host") == store.memory.budget_bytes == 3 << 20
            assert value("chunkcache_store_capacity_bytes", tier="disk") == disk_bytes
            assert store.disk is None or store.disk.budget_bytes == disk_bytes
    finally:
        metrics.start(False)


@pytest.mark.slow
def test_a_server_shows_the_config_it_serves_with_its_secrets_masked(tmp_path, monkeypatch):
    """/server_info's chunkcache state: both versions and the config the server was started with (the file read as
    every process reads it), the shared tier's URL without its password; neither the password nor the tier's secret
    is anywhere in the answer. /metrics: the build info and the configured budgets. The shared tier is a port nothing
    listens on: a server serves through the remote tier being down. The file holds a knob of a newer version, which
    operator mode (`config.unknown_keys: warn`) logs and skips: the server serves."""
    from conftest import metric, start_server, with_test_defaults

    password, secret = f"pw-{secrets.token_hex(8)}", secrets.token_hex(16)
    url = f"redis://:{password}@127.0.0.1:{free_port()}/0"
    path = tmp_path / "chunkcache.yaml"
    path.write_text(with_test_defaults(yaml.safe_dump({
        "config": {"unknown_keys": "warn"}, "select": {"ratio": 0.2, "a_newer_knob": 1},
        "store": {"host_bytes": "64MiB", "disk_dir": str(tmp_path / "disk"), "disk_bytes": "32MiB",
                  "remote_url": url}})))
    monkeypatch.setenv(REMOTE_SECRET_ENV, secret)  # the server inherits it; Config.load below needs it too
    started = Config.load(path)
    server = start_server(tmp_path / "server.log", "--chunkcache-config", str(path), "--enable-metrics")
    try:
        answer = requests.get(server.url + "/server_info", timeout=30)
        state = answer.json()["internal_states"][0]["chunkcache"]
        assert (state["version"], state["sglang_version"]) == (chunkcache.__version__, SGLANG_VERSION)
        assert state["config"] == json.loads(json.dumps(started.effective()))
        assert state["config"]["select"]["ratio"] == 0.2 and state["config"]["store"]["host_bytes"] == 64 << 20
        assert state["config"]["store"]["remote_url"] == url.replace(password, MASK)
        assert password not in answer.text and secret not in answer.text
        versions = f'{{version="{chunkcache.__version__}",sglang_version="{SGLANG_VERSION}"}}'
        assert metric(server, "chunkcache_info", versions) == 1
        assert metric(server, "chunkcache_store_capacity_bytes", '{tier="host"}') == 64 << 20
        assert metric(server, "chunkcache_store_capacity_bytes", '{tier="disk"}') == 32 << 20
        served = requests.post(server.url + "/generate", timeout=120, json={
            "text": "Hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        assert served.status_code == 200, served.text
        assert "a_newer_knob" in server.log_path.read_text() and "WARNING" in server.log_path.read_text()
    finally:
        server.stop()
