"""A blend that fails (here: a misconfigured selector) computes the request in full, says so, and keeps serving."""

import pytest

from chunkcache.prompt import build
from conftest import sglang_engine

pytestmark = pytest.mark.slow
DOCS = ["The Vell river flows north through Amber.", "Amber's market opens on Tuesdays.",
        "The archive of Amber holds 4,012 maps."]


@pytest.fixture(scope="module")
def engine(default_model, tmp_path_factory):
    # the model has 30 layers: cacheblend's check layer 99 fails inside the blend
    with sglang_engine(default_model, tmp_path_factory.mktemp("cfg"), "select:\n  options:\n    cacheblend:\n      layer: 99\n",
                       max_total_tokens=3000) as eng:
        yield eng


def test_failed_blend_falls_back_to_full_compute_and_says_so(engine, default_model):
    from transformers import AutoTokenizer

    prompt = build(AutoTokenizer.from_pretrained(default_model), DOCS, "On which day does the market open?")
    params = {"max_new_tokens": 8, "temperature": 0}
    stock = engine.generate(input_ids=prompt.input_ids, sampling_params=params)
    failed = engine.generate(input_ids=prompt.input_ids, sampling_params=params,
                             kv_hints=prompt.kv_hints(selector="cacheblend", namespace="broken"))
    info = failed["meta_info"]["chunkcache"]
    assert info["fallback"] == "error" and "layer 99 outside [0, 30)" in info["detail"]
    assert failed["output_ids"] == stock["output_ids"]
    reordered = build(AutoTokenizer.from_pretrained(default_model), DOCS[::-1], "On which day does the market open?")
    served = engine.generate(input_ids=reordered.input_ids, sampling_params=params,
                             kv_hints=reordered.kv_hints(selector="epic", namespace="broken"))
    assert served["meta_info"]["chunkcache"]["chunk_hits"] == len(DOCS)  # stored by the failed request's pass 1
    assert served["meta_info"]["completion_tokens"] > 0
