"""A Hugging Face hub id where chunkcache needs a local model directory: `chunkcache serve --model org/name` stops
before it starts anything, and a server started by SGLang's own command with one stops in the radix-cache factory,
before the chunk store fingerprints the model's files; both say the same: what the id is and what to pass instead."""

import argparse

import pytest

from chunkcache.models import KNOWN_MODELS, ModelError, hub_id_problem, resolve_model
from sglang_patch.serve import cli

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_serve_refuses_a_hub_id_naming_what_to_pass_before_starting_anything(capsys, monkeypatch):
    from sglang_patch.serve import server_process

    monkeypatch.setattr(server_process, "ServerProcess", lambda *a, **k: pytest.fail("a server was started"))
    assert cli.main(["serve", "--model", HUB_ID]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"chunkcache: error: the model '{HUB_ID}', a Hugging Face hub id and not a local "
                          f"directory: ")
    assert f"`hf download {HUB_ID} --local-dir DIR`, then --model-path DIR" in err
    assert all(name in err for name in KNOWN_MODELS) and "`chunkcache serve --model NAME`" in err


def test_the_backend_refuses_a_hub_id_before_fingerprinting_the_model(monkeypatch):
    """SGLang's own command keeps `--model-path org/name` as the server's model_path (it downloads the files
    itself); the chunkcache backend's factory refuses it with the same words before ChunkRadixCache reads
    model_path/config.json for the fingerprint."""
    from sglang_patch.scheduler import cache

    monkeypatch.setattr(cache, "model_fingerprint", lambda path: pytest.fail(f"fingerprinted {path}"))
    ctx = argparse.Namespace(server_args=argparse.Namespace(model_path=HUB_ID),
                             model_config=argparse.Namespace(hf_config=None))
    with pytest.raises(ValueError) as refused:
        cache.factory(ctx)
    assert f"chunk reuse cannot be served with {hub_id_problem(HUB_ID)}" in str(refused.value)


def test_only_an_org_name_that_is_no_local_path_is_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub_id_problem(HUB_ID) and hub_id_problem("meta-llama/Llama-3.2-1B")
    with pytest.raises(ModelError, match="^unknown model 'nothing-here': not one of"):
        resolve_model("nothing-here")
    for not_an_id in ("/models/m", "./org/name", "~/org/name", "a/b/c", "smollm2-135m-instruct"):
        assert hub_id_problem(not_an_id) is None, not_an_id
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    assert hub_id_problem("org/name") is None and resolve_model("org/name") == local.relative_to(tmp_path)
