"""The fast tier's guard (tests/conftest.py): a test not marked slow that starts a server or an engine, or loads a
real model's weights, fails before doing it. This test is not marked slow, so each attempt below must be refused."""

import sys

import pytest
from conftest import sglang_engine, start_server

from chunkcache.models import DEFAULT_MODEL, resolve_model, tiny_model
from sglang_patch.serve.server_process import ServerProcess

REFUSED = pytest.fail.Exception


def test_servers_and_engines_are_refused_outside_the_slow_tier(tmp_path):
    with pytest.raises(REFUSED, match=r"starts a server \(.*sglang.launch_server.*not marked slow"):
        ServerProcess([sys.executable, "-m", "sglang.launch_server", "--model-path", str(tmp_path)])
    with pytest.raises(REFUSED, match="starts a server, but is not marked slow"):
        start_server(tmp_path / "server.log")
    with pytest.raises(REFUSED, match="starts an SGLang engine, but is not marked slow"):
        with sglang_engine(tmp_path, tmp_path):
            pass
    # a stand-in server process (tests/test_server_process.py) is neither
    with ServerProcess([sys.executable, "-c", "pass"]) as stand_in:
        assert stand_in.wait() == 0


def test_real_weights_are_refused_outside_the_slow_tier():
    from transformers import AutoModelForCausalLM

    with pytest.raises(REFUSED, match=f"loads the weights of {DEFAULT_MODEL}, but is not marked slow"):
        AutoModelForCausalLM.from_pretrained(resolve_model(DEFAULT_MODEL))
    assert AutoModelForCausalLM.from_pretrained(tiny_model("llama")).config.hidden_size == 64  # tiny ones are fast
