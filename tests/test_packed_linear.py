"""Linear layers with prepacked weights (sglang_patch.forward.packed_linear) compute SGLang's F.linear bit for bit,
and a model holding one refuses online weight updates through SGLang's own check."""

import pytest
import torch
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.model_executor.model_runner_components.weight_updater import _unsupported_derived_weight_cache_error

from sglang_patch.forward import packed_linear
from sglang_patch.scheduler import model_load

bf16_kernels = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                  reason="oneDNN has no bfloat16 kernel on this CPU")


def model(dtype=torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.qkv = ReplicatedLinear(64, 96, bias=False, params_dtype=dtype)
    m.out = ReplicatedLinear(96, 64, bias=True, params_dtype=dtype)
    for p in m.parameters():
        p.data.normal_(0, 0.05)
    return m


def forward(m, x):
    return m.out(m.qkv(x)[0])[0]


@bf16_kernels
def test_packed_layers_compute_f_linears_bits_and_keep_their_weights():
    m = model()
    xs = [torch.randn(rows, 64, dtype=torch.bfloat16) for rows in (1, 7, 64, 300)]
    expected = [forward(m, x) for x in xs]
    weights = {name: p.clone() for name, p in m.named_parameters()}
    assert packed_linear.pack(m) == 2
    assert all(isinstance(layer.quant_method, packed_linear.PackedLinearMethod) for layer in (m.qkv, m.out))
    for x, e in zip(xs, expected):
        assert torch.equal(forward(m, x), e)
    # what weight loaders and get_weights_by_name read is the plain weight, unchanged
    assert all(torch.equal(p, weights[name]) for name, p in m.named_parameters())
    assert _unsupported_derived_weight_cache_error(m) == packed_linear.UPDATES_REFUSED


@bf16_kernels
def test_a_packed_weight_that_computes_other_bits_is_left_unpacked(monkeypatch):
    m = model()
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(packed_linear, "_reorder", lambda w: reorder(w, packed_linear.PACK_ROWS) * 1.5)
    assert packed_linear.pack(m) == 0
    assert type(m.qkv.quant_method) is UnquantizedLinearMethod
    assert _unsupported_derived_weight_cache_error(m) is None


def test_float32_layers_are_left_to_sglang():
    m = model(torch.float32)
    assert packed_linear.pack(m) == 0
    assert type(m.out.quant_method) is UnquantizedLinearMethod and not hasattr(m.out, "packed_weight")
    assert _unsupported_derived_weight_cache_error(m) is None


@pytest.mark.parametrize("backend,linear,reason", [
    ("chunkcache", "sglang", model_load.STORE_OUTLIVES_UPDATES),
    ("chunkcache", "packed", model_load.STORE_OUTLIVES_UPDATES),  # the model's own reason comes first
    (None, "packed", packed_linear.UPDATES_REFUSED),
    (None, "sglang", None),
])
def test_a_loaded_model_refuses_weight_updates_where_they_would_serve_stale_kv_or_weights(
        monkeypatch, backend, linear, reason):
    from types import SimpleNamespace

    if linear == "packed" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 kernel on this CPU")
    monkeypatch.setenv(model_load.CPU_LINEAR_ENV, linear)
    runner = SimpleNamespace(model=model(), device="cpu", server_args=SimpleNamespace(radix_cache_backend=backend))
    model_load.loaded_model(None, runner)
    assert _unsupported_derived_weight_cache_error(runner.model) == reason
