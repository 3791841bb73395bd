"""The model support table (chunkcache.architectures): every family either blended correctly or refused with its
reason, by the server, the CLI and the reference path alike."""

import json
import random
import subprocess
import sys
import types

import pytest
import transformers
from conftest import Rag, gen, hints, sglang_engine

from chunkcache import architectures
from chunkcache.architectures import FAMILIES, UnsupportedModel, check
from chunkcache.blend import fidelity
from chunkcache.models import TINY_ARCHITECTURES, tiny_model

TINY = dict(initializer_range=0.1)  # random weights whose greedy continuation depends on the context
DIMS = dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# family -> (tiny architecture, where it is blended, what its refusal names)
EXPECTED = {
    "LlamaForCausalLM": ("llama", ("sglang", "reference"), None),
    "Qwen2ForCausalLM": ("qwen2", ("sglang", "reference"), None),
    "Qwen3ForCausalLM": ("qwen3", ("sglang", "reference"), None),
    "MistralForCausalLM": ("mistral", ("sglang", "reference"), None),
    "Phi3ForCausalLM": ("phi3", ("sglang",), "fused qkv"),
    "SmolLM3ForCausalLM": ("smollm3", ("reference",), "no SmolLM3 model"),
    "Gemma2ForCausalLM": ("gemma2", (), "soft-capping"),
    "Gemma3ForCausalLM": ("gemma3", ("sglang", "reference"), None),
}


def config_of(arch: str, **overrides):
    name, extra = TINY_ARCHITECTURES[arch]
    config = getattr(transformers, name)(**{**DIMS, **extra, "head_dim": 16, **overrides})
    config.architectures = [next(a for a, (t, _, _) in EXPECTED.items() if t == arch)]
    return config


def test_every_family_in_the_table_is_decided_as_documented():
    assert {a for f in FAMILIES for a in f.architectures} == set(EXPECTED) | {"DeepseekV2ForCausalLM",
                                                                              "DeepseekV3ForCausalLM"}
    for architecture, (arch, paths, refusal) in EXPECTED.items():
        config = config_of(arch)
        for path in architectures.PATHS:
            if path in paths:
                assert check(config, path).head_dim == 16, (architecture, path)
            else:
                with pytest.raises(UnsupportedModel, match=refusal) as exc:
                    check(config, path)
                assert architecture in str(exc.value)


def test_mla_and_unknown_architectures_are_refused():
    mla = types.SimpleNamespace(architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=512)
    with pytest.raises(UnsupportedModel, match="latent attention"):
        check(mla)
    with pytest.raises(UnsupportedModel, match="FalconForCausalLM is not in chunkcache's support table"):
        check(types.SimpleNamespace(architectures=["FalconForCausalLM"]))
    with pytest.raises(UnsupportedModel, match="none in config.json"):
        check(types.SimpleNamespace())


@pytest.mark.parametrize("arch,overrides,reason", [
    ("llama", {"attn_logit_softcapping": 50.0}, "soft-capping"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "'yarn'"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                  "long_factor": [2.0] * 8, "original_max_position_embeddings": 4096}}, "'longrope'"),
])
def test_a_supported_family_with_a_feature_the_blend_lacks_is_refused(arch, overrides, reason):
    with pytest.raises(UnsupportedModel, match=reason):
        check(config_of(arch, **overrides))


def test_the_reference_path_refuses_a_model_wide_window_the_sglang_path_takes_from_sglangs_layers():
    """transformers' Mistral holds its window in the mask only, where the reference loop cannot read it; windows per
    layer type (Qwen2's `use_sliding_window`, Gemma 3's local layers) sit on each attention module and are taken."""
    config = config_of("mistral", sliding_window=4096)
    with pytest.raises(UnsupportedModel, match="sliding window of 4096 tokens \\(context 8192\\) for the whole"):
        check(config, "reference")
    assert check(config, "sglang").head_dim == 16
    windowed = config_of("qwen2", use_sliding_window=True, sliding_window=1024, max_window_layers=0)
    assert check(windowed, "reference").head_dim == check(windowed, "sglang").head_dim == 16
    assert check(config_of("mistral", sliding_window=8192), "reference").head_dim == 16  # the context never reaches
    assert check(config_of("mistral", sliding_window=4096), "reference", context_len=4096).head_dim == 16


def test_chunkcache_serve_refuses_an_unsupported_model_before_starting_sglang():
    proc = subprocess.run([sys.executable, "-m", "sglang_patch.serve.cli", "serve",
                           "--model", str(tiny_model("gemma2"))], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot be served with chunk reuse" in proc.stderr and "soft-capping" in proc.stderr
    assert "Traceback" not in proc.stderr and "sglang.launch_server" not in proc.stdout


# ---- every family the server blends, on SGLang's CPU engine against stock SGLang ------------------------------------

SERVED = [arch for arch, paths, _ in EXPECTED.values() if "sglang" in paths and arch != "llama"]  # llama: the default


CALIBRATED = "qwen2"  # the served family `chunkcache calibrate` fits an estimator for, before its server starts


@pytest.fixture(scope="module", params=SERVED)
def family(request, tmp_path_factory):
    model = tiny_model(request.param, **TINY)
    config = tmp_path_factory.mktemp("cfg")
    yaml = "select:\n  ratio: 0.15\n"
    if request.param == CALIBRATED:
        from chunkbench.quality import calibration

        assert calibration.main(["--model", str(model), "--families", "multikey", "--cases", "6", "--covers", "4",
                                 "--workdir", str(config / "work"), "--out", str(config / "fidelity.json")]) == 0
        yaml += f"  calibration: {config / 'fidelity.json'}\n"
    with sglang_engine(model, config, yaml, max_total_tokens=4000, dtype="float32") as engine:
        yield request.param, model, engine


@pytest.fixture(scope="module")
def rag(default_model):
    return Rag(transformers.AutoTokenizer.from_pretrained(default_model), n_docs=4, words=60)


@pytest.mark.slow
def test_a_blend_recomputing_every_token_equals_stock_on_every_served_family(family, rag):
    arch, _, engine = family
    rng = random.Random(2)
    outputs = set()
    for k in range(3):
        order = rng.sample(range(4), 3)
        ids, spans = rag.build(order, f"What is the code of document {order[k]}?")
        stock = gen(engine, ids)
        blended = gen(engine, ids, hints(spans, selector="epic", ratio=1.0, namespace=f"full-{k}"))
        info = blended["meta_info"]["chunkcache"]
        assert info["selector"] == "epic" and info["chunk_misses"] == 3 and info["reused_tokens"] == 0, info
        assert blended["output_ids"] == stock["output_ids"], (arch, order)
        outputs.add(json.dumps(stock["output_ids"]))
    assert len(outputs) > 1  # the tiny model's answer depends on the prompt: equality above means something


@pytest.mark.slow
def test_reused_chunks_match_the_reference_blender_where_it_runs(family, rag):
    """`none` reuses every chunk token: SGLang's blend (each chunk computed after the prefix, its KV copied into the
    pool and re-rotated to the chunk's place, the query computed over it) against the reference blender's."""
    arch, model, engine = family
    if "reference" not in next(paths for a, paths, _ in EXPECTED.values() if a == arch):
        pytest.skip(f"{arch} has no reference path (the table says so)")
    from chunkcache.reference import ReferenceBlender

    ids, spans = rag.build([2, 0, 1], "What is the code of document 0?")
    served = gen(engine, ids, hints(spans, selector="none", namespace="reference"), n=8)
    info = served["meta_info"]["chunkcache"]
    assert info["radix_tokens"] == 0 and info["reused_tokens"] == spans[-1][1] - spans[0][0], info
    ref = ReferenceBlender.from_pretrained(model)
    result = ref.blend(ids[: spans[0][0]], [ids[s:e] for s, e in spans], ids[spans[-1][1]:], selector="none")
    assert ref.generate(result, 8) == served["output_ids"], arch


@pytest.mark.slow
def test_gemma_3_270m_blends_every_token_to_stocks_greedy_output(tmp_path):
    """The second real model (chunkcache model gemma-3-270m): local layers' windows of 512 and two RoPE bases, on
    prompts longer than the window; ratio 1 recomputes every token through the blend's own passes."""
    from chunkcache.models import resolve_model

    model = resolve_model("gemma-3-270m")
    rag = Rag(transformers.AutoTokenizer.from_pretrained(model), n_docs=6, words=120)
    with sglang_engine(model, tmp_path, "", max_total_tokens=6000, dtype="float32") as engine:
        for k, order in enumerate(([0, 1, 2, 3, 4], [4, 2, 0, 5, 1])):
            ids, spans = rag.build(order, f"What is the code of document {order[2]}?")
            assert len(ids) > 600  # past the local layers' window
            stock = gen(engine, ids)
            blended = gen(engine, ids, hints(spans, selector="epic", ratio=1.0, namespace=f"gemma-{k}"))
            assert blended["meta_info"]["chunkcache"]["selector"] == "epic"
            assert blended["output_ids"] == stock["output_ids"], (order, blended["text"], stock["text"])


@pytest.mark.slow
def test_a_model_nobody_calibrated_gets_no_estimate_and_a_quality_floor_is_computed_in_full(family, rag):
    """No fidelity estimator was fitted for a tiny random model: mix's blends report none (`fitted_for: null`) rather
    than another model's, and a request bounded by max_kl is computed by the model's own forward, saying why."""
    arch, _, engine = family
    if arch == CALIBRATED:
        pytest.skip("calibrated before its server started: test_a_calibrated_model_is_estimated_with_its_own_fit")
    ids, spans = rag.build([2, 3, 1], "What is the code of document 1?")
    plain = gen(engine, ids, hints(spans, selector="mix", namespace="uncalibrated"), n=1)["meta_info"]["chunkcache"]
    assert "fallback" not in plain and plain["fidelity"] == {"fitted_for": None}, (arch, plain)
    ids, spans = rag.build([1, 2, 3], "What is the code of document 2?")
    bounded = gen(engine, ids, hints(spans, selector="mix", namespace="uncalibrated", max_kl=1e6), n=1)
    info = bounded["meta_info"]["chunkcache"]
    assert info["fallback"] == "uncalibrated" and "chunkcache calibrate" in info["detail"], (arch, info)
    assert "ratio" not in info, info  # not blended at rho 1: SGLang's own forward


@pytest.mark.slow
def test_a_calibrated_model_is_estimated_with_its_own_fit(family, rag):
    """`chunkcache calibrate` wrote an estimator for these weights into the file `select.calibration` names: the
    server estimates with it (by the weights' fingerprint), so a max_kl request is bounded by it, not computed in full
    as uncalibrated."""
    arch, model, engine = family
    if arch != CALIBRATED:
        pytest.skip(f"only {CALIBRATED} is calibrated")
    for order in ([2, 3, 1], [1, 2, 3]):  # the first stores the chunks, the second reuses them
        ids, spans = rag.build(order, "What is the code of document 1?")
        info = gen(engine, ids, hints(spans, selector="mix", namespace="calibrated", max_kl=0.05), n=1)
    info = info["meta_info"]["chunkcache"]
    assert info["chunk_hits"] == 3 and info.get("fallback") != "uncalibrated", info
    assert info["fidelity"]["fitted_for"].startswith(f"{model.name}@") and info["fidelity"]["covers"] == 4, info
    # the rho it chose is the estimate's: the smallest whose KL estimate meets the bound, else all recomputed
    assert (info["ratio"] in fidelity.RATIOS) == (info.get("fallback") is None), info


@pytest.mark.slow
@pytest.mark.parametrize("selector", ["epic", "prophet", "mix"])
def test_every_selector_blends_on_every_served_family(family, rag, selector):
    """Their feature passes run inside SGLang's model too (mix's stops after its first layers): a blend, never the
    fallback to full compute."""
    arch, _, engine = family
    ids, spans = rag.build([1, 3, 0], "What is the code of document 3?")
    info = gen(engine, ids, hints(spans, selector=selector, namespace=f"sel-{selector}"), n=2)["meta_info"]["chunkcache"]
    assert "fallback" not in info and info["selector"] == selector, (arch, info)
    assert 0 < info["recomputed_tokens"] < len(ids) and info["reused_tokens"] > 0, (arch, info)
