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


def test_a_process_that_missed_a_hook_refuses_to_build_the_backend(monkeypatch):
    """SGLang's hook loader only logs a target it cannot resolve: the backend's factory refuses to serve then, naming
    the targets, and builds once every target of the table was applied in its process."""
    targets = {target for target, _, _ in plugin.hooks()}
    assert isinstance(HookRegistry._patched, set)  # where SGLang keeps what it patched (plugin.unapplied reads it)
    built = plugin.whole(lambda ctx: ("built", ctx))
    missed = sorted(targets)[:2]
    monkeypatch.setattr(HookRegistry, "_patched", targets - set(missed))
    with pytest.raises(RuntimeError, match="did not apply 2 of chunkcache's hooks") as refused:
        built("ctx")
    assert all(target in str(refused.value) for target in missed)
    monkeypatch.setattr(HookRegistry, "_patched", targets)
    assert built("ctx") == ("built", "ctx")


def test_an_sglang_other_than_the_tested_one_is_refused_with_the_version_to_install():
    from importlib.metadata import version

    from sglang_patch.serve.launcher import sglang_problems

    assert sglang_problems() is None  # the installed one is the pinned one
    refused = sglang_problems("0.5.22")
    assert refused.startswith("SGLang 0.5.22") and f"install sglang=={version('sglang')}" in refused
