"""Re-rotation against the model itself: layer-0 K depends only on the token and its position, so K computed by the
HF model directly at position p must equal K computed at another position and re-rotated by the difference.

Tolerances. fp32: 1e-5 absolute at any position when `rerotate` is told the cached positions (it then reproduces
transformers' float32 rounding of p * inv_freq); without them, the exact-delta rotation differs from the model's own
rounding by ~p * 6e-8 rad, so that path is checked at positions below ~300 only. bf16: the model computes K in bf16
(projection, cos/sin and rotation each rounded to 8 mantissa bits), so the direct K is itself only good to a few bf16
ulps; we allow 3 * 2**-8 * max|K| (1.5 to 3 bf16 ulps of the largest key; observed: 1 ulp).
"""

import types

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from chunkcache.rope import RopeSpec, Rotation, UnsupportedRope, rerotate

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    # wavelengths of a 16-dim head span 6..2e4, so all three llama3 regimes (kept, smoothed, scaled) occur
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 2048},
}


def tiny_llama(rope: dict, dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         rope_parameters=dict(rope), initializer_range=0.1)
    # from_config keeps the rotary inv_freq in float32 whatever the dtype, as from_pretrained does
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


@torch.inference_mode()
def layer0_keys(model, ids: torch.Tensor, start: int) -> torch.Tensor:
    """[T, H, D] post-RoPE layer-0 keys from the model's own cache, tokens placed at start, start + 1, ..."""
    pos = torch.arange(start, start + ids.numel())[None]
    cache = model(input_ids=ids[None], position_ids=pos, use_cache=True).past_key_values
    return cache.layers[0].keys[0].transpose(0, 1)


def test_inv_freq_matches_transformers_bit_for_bit():
    for name, rope in ROPES.items():
        model = tiny_llama(rope)
        assert torch.equal(RopeSpec.from_config(model.config).inv_freq, model.model.rotary_emb.inv_freq), name
    spec = RopeSpec.from_config(tiny_llama(ROPES["llama3"]).config)
    base = RopeSpec.from_config(tiny_llama(ROPES["default"]).config)
    ratio = base.inv_freq / spec.inv_freq
    assert ratio.min() == 1.0 and ratio.max() == 8.0 and ((ratio > 1) & (ratio < 8)).any()


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("cached_at,moved_to", [(7, 7), (7, 300), (300, 7), (0, 1000), (517, 33), (5000, 8000), (8100, 3)])
def test_rerotated_keys_equal_direct_keys_fp32(rope, cached_at, moved_to):
    model = tiny_llama(ROPES[rope])
    spec = RopeSpec.from_config(model.config)
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1))
    direct = layer0_keys(model, ids, moved_to)
    cached = layer0_keys(model, ids, cached_at)
    moved = rerotate(cached, moved_to - cached_at, spec, positions=torch.arange(cached_at, cached_at + 24))
    assert moved.dtype == torch.float32
    torch.testing.assert_close(moved, direct, atol=1e-5, rtol=0)
    if cached_at != moved_to:  # the test can fail: without re-rotation the keys differ
        assert (cached - direct).abs().max() > 1e-2
    if max(cached_at, moved_to) <= 300:
        torch.testing.assert_close(rerotate(cached, moved_to - cached_at, spec), direct, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rerotated_keys_equal_direct_keys_bf16(rope):
    model = tiny_llama(ROPES[rope], torch.bfloat16)
    spec = RopeSpec.from_config(model.config)
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1))
    direct = layer0_keys(model, ids, 400)
    moved = rerotate(layer0_keys(model, ids, 12), 388, spec, positions=torch.arange(12, 36))
    assert moved.dtype == torch.bfloat16
    tol = 3 * 2**-8 * direct.float().abs().max().item()
    torch.testing.assert_close(moved.float(), direct.float(), atol=tol, rtol=0)


def test_per_token_delta():
    """Tokens cached at scattered positions move to consecutive ones in one call (a [T] delta)."""
    model = tiny_llama(ROPES["llama3"])
    spec = RopeSpec.from_config(model.config)
    ids = torch.randint(0, 512, (6,), generator=torch.Generator().manual_seed(2))
    cached_pos = torch.tensor([3, 90, 17, 400, 5, 64])
    cached = torch.stack([layer0_keys(model, ids[i : i + 1], int(p))[0] for i, p in enumerate(cached_pos)])
    direct = layer0_keys(model, ids, 100)
    torch.testing.assert_close(rerotate(cached, torch.arange(100, 106) - cached_pos, spec, cached_pos), direct,
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(rerotate(cached, torch.arange(100, 106) - cached_pos, spec), direct, atol=1e-5, rtol=0)


def test_keys_moved_into_a_pools_slots_equal_keys_moved_apart_and_touch_nothing_else():
    """Rotation.apply(out=...) writes the moved keys straight into their slots of a pool (the blend's copy): the same
    values bit for bit as moving them apart, in the pool's dtype, and every other slot untouched."""
    spec = RopeSpec.from_config(tiny_llama(ROPES["llama3"]).config)
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(6, 2, spec.head_dim, generator=g).bfloat16()
    rotation = Rotation.of(torch.arange(100, 106) - 7, spec, torch.full((6,), 7))
    pool = torch.full((20, 2, spec.head_dim), 5.0, dtype=torch.bfloat16)
    moved = rotation.apply(keys, out=pool[4:10])
    assert moved.data_ptr() == pool[4:10].data_ptr()
    assert torch.equal(pool[4:10], rotation.apply(keys))
    assert not torch.equal(pool[4:10], keys)  # they moved
    assert bool((pool[:4] == 5).all()) and bool((pool[10:] == 5).all())
    with pytest.raises(ValueError, match="do not fit"):
        rotation.apply(keys, out=pool[4:9])


def test_layer_dimensions_broadcast_and_zero_delta_is_identity():
    spec = RopeSpec.from_config(tiny_llama(ROPES["default"]).config)
    k = torch.randn(3, 10, 2, 16)  # [L, T, H, D], the store's layout
    assert rerotate(k, 0, spec) is k
    there_and_back = rerotate(rerotate(k, 250, spec), -250, spec)
    torch.testing.assert_close(there_and_back, k, atol=1e-5, rtol=0)
    torch.testing.assert_close(rerotate(rerotate(k, 5, spec), 7, spec), rerotate(k, 12, spec), atol=1e-5, rtol=0)
    per_layer = torch.stack([rerotate(k[l], 9, spec) for l in range(3)])
    torch.testing.assert_close(rerotate(k, 9, spec), per_layer, atol=0, rtol=0)
    with pytest.raises(ValueError, match="head_dim"):
        rerotate(torch.randn(4, 2, 8), 1, spec)


def per_layer_model(family: str):
    """Tiny random models whose layers rotate differently: Gemma 3 (local layers at base 1e4, global at 1e6) and
    SmolLM3 (every fourth layer without RoPE)."""
    from transformers import Gemma3TextConfig, SmolLM3Config

    torch.manual_seed(0)
    dims = dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, initializer_range=0.1,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = (Gemma3TextConfig(sliding_window=16, **dims) if family == "gemma3" else SmolLM3Config(**dims))
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@torch.inference_mode()
def every_layers_keys(model, token: int, position: int) -> torch.Tensor:
    """[L, 1, H, D]: one token alone attends only to itself, so below RoPE every layer's key is the same at any
    position and the keys at two positions differ by each layer's own rotation."""
    cache = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]), use_cache=True)
    return torch.stack([layer.keys[0].transpose(0, 1) for layer in cache.past_key_values.layers])


@pytest.mark.parametrize("family,rope_type", [("gemma3", "default"), ("smollm3", "default+nope")])
def test_per_layer_rope_moves_each_layers_keys_by_its_own_rotation(family, rope_type):
    model = per_layer_model(family)
    spec = RopeSpec.from_config(model.config)
    assert spec.per_layer and spec.rope_type == rope_type and spec.inv_freq.shape == (6, 8)
    cached, direct = every_layers_keys(model, 7, 30), every_layers_keys(model, 7, 900)
    torch.testing.assert_close(rerotate(cached, 870, spec, torch.tensor([30])), direct, atol=1e-5, rtol=0)
    moved = (cached - direct).flatten(1).abs().amax(1)
    if family == "smollm3":  # the NoPE layers' keys do not move; the others do
        assert [bool(m > 1e-2) for m in moved] == list(map(bool, model.config.no_rope_layers))
    else:  # with one base for every layer, the global layer's keys come out wrong
        one_base = RopeSpec(spec.rope_type, spec.inv_freq[0], spec.head_dim)
        wrong = (rerotate(cached, 870, one_base, torch.tensor([30])) - direct).flatten(1).abs().amax(1)
        assert [bool(w > 1e-2) for w in wrong] == [t == "full_attention" for t in model.config.layer_types]
    with pytest.raises(ValueError, match="per-layer RoPE"):
        rerotate(cached[0], 1, spec)


@pytest.mark.parametrize("params,name", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, "yarn"),
    ({"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 2048}, "longrope"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial rotary"),
    ({"rope_type": "default", "mrope_section": [2, 3, 3]}, "mrope"),
    ({"type": "yarn", "factor": 2.0}, "yarn"),  # pre-5.x key name
])
def test_unsupported_rope_is_refused_by_name(params, name):
    config = types.SimpleNamespace(rope_parameters={"rope_theta": 10000.0, **params}, head_dim=16, hidden_size=64,
                                   num_attention_heads=4, max_position_embeddings=8192)
    with pytest.raises(UnsupportedRope, match=f"'{name}"):
        RopeSpec.from_config(config)


def test_old_style_config_attributes():
    """Configs that still carry `rope_scaling` + `rope_theta` (pre-5.x objects) are read the same way."""
    old = types.SimpleNamespace(rope_scaling={"type": "linear", "factor": 4.0}, rope_theta=10000.0, head_dim=16,
                                hidden_size=64, num_attention_heads=4, max_position_embeddings=8192)
    assert torch.equal(RopeSpec.from_config(old).inv_freq, RopeSpec.from_config(tiny_llama(ROPES["linear"]).config).inv_freq)
    real = tiny_llama({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}).config
    with pytest.raises(UnsupportedRope, match="'yarn'"):
        RopeSpec.from_config(real)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_model_keys(dtype):
    from chunkcache.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"), dtype=dtype).eval()
    model.model.layers = model.model.layers[:1]  # layer-0 keys only
    model.config.num_hidden_layers = 1
    spec = RopeSpec.from_config(model.config)
    ids = torch.randint(0, model.config.vocab_size, (32,), generator=torch.Generator().manual_seed(3))
    direct = layer0_keys(model, ids, 6000)
    moved = rerotate(layer0_keys(model, ids, 40), 5960, spec, positions=torch.arange(40, 72))
    tol = 1e-5 if dtype == torch.float32 else 3 * 2**-8 * direct.float().abs().max().item()
    torch.testing.assert_close(moved.float(), direct.float(), atol=tol, rtol=0)
