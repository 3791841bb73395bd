"""Every place chunk reuse enters SGLang exists in the installed SGLang, and none lets a batch with chunks around the
blend."""

import importlib
import types

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry

from chunkcache.blend.request import ChunkRequest
from sglang_patch import lang, plugin
from sglang_patch.decode import specache
from sglang_patch.scheduler import extend, metrics, request_hint


def resolve(target: str):
    """The object a dotted hook target names: the longest importable module prefix, then attributes."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(target)


def test_every_hook_target_exists_in_the_installed_sglang(monkeypatch):
    targets = []
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, target, *a, **k: targets.append(target)))
    plugin.register()
    # the plugin registers exactly its table: no module hooks SGLang on its own
    assert targets == [target for target, _, _ in plugin.hooks()]
    for part in (lang, metrics, specache):
        assert {target for target, _, _ in part.hooks()} <= set(targets)
    missing = []
    for target in targets:
        try:
            assert callable(resolve(target))
        except (ImportError, AttributeError, AssertionError):
            missing.append(target)
    assert not missing, f"hook targets absent from the installed SGLang: {missing}"


@pytest.mark.parametrize("hinted,graph_ok,expected", [(True, True, False), (False, True, True), (False, False, False)])
def test_a_batch_with_chunks_never_replays_the_prefill_cuda_graph(hinted, graph_ok, expected):
    req = types.SimpleNamespace(to_finish=None)
    req.__dict__[request_hint.ATTR] = ChunkRequest(rid="r", hint=object() if hinted else None)
    batch = types.SimpleNamespace(chunkcache_reqs=[types.SimpleNamespace(to_finish=None), req])
    assert extend.eager_for_blends(graph_ok, None, batch) is expected
    assert extend.eager_for_blends(graph_ok, None, types.SimpleNamespace()) is graph_ok  # a stock server's batch
