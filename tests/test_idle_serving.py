"""Idle work sliced (config idle.slice_tokens): a paragraph a prompt taught, encoded a slice per idle step (each
slice's forward attending to the K/V the earlier slices kept, `Segment.ctx_kv`), is stored as the paragraph encoded
in one forward is, up to float32 rounding. The oracle: the same server with slices longer than any paragraph. On
SGLang's CPU engine, a tiny random-weight model in float32."""

import pytest
import torch
import transformers
from conftest import Rag, gen, sglang_engine

from chunkcache.models import tiny_model
from chunkcache.store.disk import SUFFIX
from chunkcache.store.wire import decode

pytestmark = pytest.mark.slow


def _learned(model, rag, tmp_path_factory, slice_tokens: int) -> dict:
    """Every entry the server stored after one unmarked prompt, by key, once its idle work is done."""
    from chunkbench.serving.http_client import wait_measured

    store_dir = tmp_path_factory.mktemp(f"store-{slice_tokens}")
    config = (f"store:\n  host_bytes: 0\n  compress: none\n  disk_dir: {store_dir}\n"
              f"auto:\n  enabled: true\n  admit_after: 1\n  min_reuse_tokens: 32\n"
              f"idle:\n  slice_tokens: {slice_tokens}\n")
    with sglang_engine(model, tmp_path_factory.mktemp(f"cfg-{slice_tokens}"), config, max_total_tokens=4000,
                       dtype="float32") as engine:
        gen(engine, rag.build([0, 1, 2], "Which code comes first?")[0])
        wait_measured(engine.get_server_info, 300)
    return {p.name.removesuffix(SUFFIX): decode(bytearray(p.read_bytes())) for p in store_dir.glob(f"*/*{SUFFIX}")}


def test_a_paragraph_encoded_a_slice_at_a_time_is_stored_as_one_forward_stores_it(default_model, tmp_path_factory):
    model = tiny_model("llama", initializer_range=0.1)
    rag = Rag(transformers.AutoTokenizer.from_pretrained(default_model), n_docs=3, words=60)
    whole, sliced = (_learned(model, rag, tmp_path_factory, n) for n in (100_000, 16))
    assert whole and whole.keys() == sliced.keys()
    assert max(e.num_tokens for e in whole.values()) > 16  # the sliced server cut some paragraph
    for key, e in whole.items():
        s = sliced[key]
        assert (e.start_pos, e.token_ids.tolist()) == (s.start_pos, s.token_ids.tolist()), key
        torch.testing.assert_close(s.k, e.k, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s.v, e.v, rtol=1e-4, atol=1e-5)
