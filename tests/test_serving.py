"""SGLang on this host (CPU when no GPU) with the chunkcache plugin: engine and `chunkcache serve`."""

import pytest
import requests
from conftest import sglang_engine

pytestmark = pytest.mark.slow


def test_engine_answers_capital_of_france(default_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    with sglang_engine(default_model, tmp_path) as engine:
        out = engine.generate(prompt, {"max_new_tokens": 20, "temperature": 0})
    assert "Paris" in out["text"]


def test_server_health_and_generate(server):
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    r = requests.post(server.url + "/generate", timeout=300,
                      json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["meta_info"]["completion_tokens"] > 0 and body["text"].strip()


def test_server_uses_chunkcache_backend_in_scheduler(server):
    info = requests.get(server.url + "/server_info", timeout=30).json()
    states = info["internal_states"]
    assert states and all(s["chunkcache"]["tree_cache"] == "ChunkRadixCache" for s in states)
    assert info["radix_cache_backend"] == "chunkcache"
    pid = states[0]["chunkcache"]["scheduler_pid"]
    assert f"radix cache backend 'chunkcache' active in scheduler pid {pid}" in server.log()


def test_online_weight_updates_are_refused_and_the_server_keeps_serving(server, default_model):
    """Stored chunks hold KV of the loaded weights: an update would serve the old model's KV (sglang_patch.plugin)."""
    from sglang_patch.scheduler import model_load

    r = requests.post(server.url + "/update_weights_from_disk", json={"model_path": str(default_model)}, timeout=300)
    body = r.json()
    assert body["success"] is False and body["message"] == model_load.STORE_OUTLIVES_UPDATES, body
    test_server_health_and_generate(server)


def test_linear_weights_are_prepacked_on_a_cpu_without_amx(server):
    """The default model's bfloat16 linear layers (4 a layer: qkv, o, gate_up, down) are packed where oneDNN runs
    bfloat16 and SGLang's AMX path does not (sglang_patch.forward.packed_linear)."""
    import torch
    from sglang.srt.utils import cpu_has_amx_support

    if torch.cuda.is_available() or cpu_has_amx_support() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("SGLang's own linear path serves on this host")
    info = requests.get(server.url + "/server_info", timeout=30).json()
    if info["dtype"] != "bfloat16":
        pytest.skip(f"this host serves {info['dtype']}")
    assert "120 linear layers' weights prepacked" in server.log()
