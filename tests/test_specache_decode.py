"""The reference SpeCache decode loop on tiny random-weight models: with k at least the prompt length every
low-bit pair is replaced by its full-precision one, so decoding equals full-precision greedy decoding."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from chunkcache.config import Config, SpeCacheConfig
from chunkcache.models import tiny_model
from chunkcache.specache.decode import SpeCacheDecoder, greedy, prefill
from chunkcache.specache.layer_cache import full_bytes, lowbit_bytes

# random weights large enough that the continuation depends on the context (see tests/test_reference.py)
TINY = dict(initializer_range=0.1)
PROMPT, NEW = 90, 16


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return AutoModelForCausalLM.from_pretrained(tiny_model(request.param, **TINY), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pre(model):
    torch.manual_seed(0)
    return prefill(model, torch.randint(3, model.config.vocab_size, (PROMPT,)).tolist())


@pytest.mark.parametrize("bits", [1, 2])
def test_topk_covering_the_context_is_full_precision(model, pre, bits):
    full = greedy(model, pre, NEW)
    cfg = SpeCacheConfig(bits=bits, group=8, residual=16, topk=PROMPT + NEW)
    run = SpeCacheDecoder(model, cfg).generate(pre, NEW, probe=True)
    assert run.tokens == full.tokens and len(run.tokens) == NEW
    # the same sums in another order (two rows, float32 einsum against HF's one-row SDPA)
    assert torch.allclose(run.logits, full.logits, atol=1e-4, rtol=0)
    assert run.hits == [1.0] * (NEW - 1)  # every exact top-k pair is among the prefetched ones


@pytest.mark.parametrize("bits", [1, 2])
def test_lowbit_decoding_reports(model, pre, bits):
    cfg = SpeCacheConfig(bits=bits, group=8, residual=16, topk=4)
    run = SpeCacheDecoder(model, cfg).generate(pre, NEW, probe=True)
    assert len(run.tokens) == NEW and len(run.logits) == NEW
    assert len(run.guesses) == NEW - 1 and 0 <= run.speculative_match()[0] <= NEW - 1
    assert len(run.read_bytes) == len(run.fetch_bytes) == len(run.hits) == len(run.stale_hits) == NEW - 1
    assert all(0.0 <= h <= 1.0 for h in run.hits + run.stale_hits)
    n = PROMPT + NEW - 1  # x_NEW is output, never fed
    assert run.full_bytes == n * model.config.num_key_value_heads * 16 * 2 * 2 * model.config.num_hidden_layers
    H, L = model.config.num_key_value_heads, model.config.num_hidden_layers
    Q = (n - 16) // 8 * 8  # quantised: whole groups older than the residual window
    assert run.device_bytes == L * (lowbit_bytes(cfg, H, 16, Q) + (n - Q + 4) * full_bytes(H, 16))
    assert max(run.fetch_bytes) <= 4 * model.config.num_key_value_heads * 16 * 2 * 2 * model.config.num_hidden_layers


def test_refusals(model, tmp_path):
    with pytest.raises(ValueError, match="must divide head_dim"):
        SpeCacheDecoder(model, SpeCacheConfig(group=12)).generate(prefill(model, [5, 6, 7]), 2)
    with pytest.raises(ValueError, match="model types"):
        SpeCacheDecoder(SimpleNamespace(config=SimpleNamespace(model_type="gpt2")), SpeCacheConfig())
    with pytest.raises(ValueError, match="context"):
        SpeCacheDecoder(model, SpeCacheConfig(group=8)).generate(prefill(model, [5, 6, 7]), 8190)
    assert Config().decode.specache.enabled is False
    path = tmp_path / "c.yaml"
    path.write_text("decode: {specache: {bits: 3, group: 0}}")
    with pytest.raises(ValueError, match="specache:bits: must be 1, 2 or 4"):
        Config.load(path)
    path.write_text("decode: {specache: {enabled: true}}")  # the server runs it (tests/test_specache_server.py)
    assert Config.load(path).decode.specache.enabled is True
