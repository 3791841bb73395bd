"""chunkbench.kernels.gpu_blend runs on GPU machines that CI never sees, so its correctness self-check runs here on the
CPU at a tiny shape, in float32 (tight tolerances): every attention variant that exists here matches the float32
reference on the selected rows, FlashInfer's are skipped with a reason when it is absent, and the blended whole
prefill (re-rotated KV copy + sparse pass) reproduces the full prefill's logits. A blend that forgets to move the
cached keys must fail the check, or the check proves nothing."""

import importlib
import json

import pytest
import torch

from sglang_patch.forward import paged_attention

TINY = ["--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--sizes", "512", "--rhos", "0.15", "--chunk",
        "64", "--model-sizes", "512", "--layers", "2", "--repeats", "1", "--model-repeats", "1"]


@pytest.fixture
def gpu_blend():
    return importlib.import_module("chunkbench.kernels.gpu_blend")


def test_self_check_on_cpu(gpu_blend, tmp_path):
    out = tmp_path / "rows.json"
    assert gpu_blend.main(TINY + ["--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    attention = {r["variant"]: r for r in rows["attention"]}
    assert set(attention) == set(gpu_blend.VARIANTS)
    for name, row in attention.items():
        if name.startswith("flashinfer") and not paged_attention.available(torch.device("cpu")):
            assert "flashinfer" in row["skipped"]
        else:
            assert row["ok"] and row["max_err"] < 1e-4, row
    measured = [r for r in rows["model"] if "skipped" not in r]
    assert {r["attention"] for r in measured} == {"flex_mask", "torch_blocks"}
    exact = [r for r in measured if not r["kv_from"].endswith("int8")]
    assert {r["kv_from"] for r in exact} == {"device", "pinned"}
    assert all(r["ok"] and r["err"] < 1e-4 for r in exact), exact
    # int8 codes of an 8-bit range: the logits move, but by a codec's rounding, not by a misplaced key; a quarter of
    # the bytes of float32 KV plus the groups' parameters
    compressed = [r for r in measured if r["kv_from"] == "pinned-int8"]
    assert compressed and all(1e-6 < r["err"] < 1e-2 for r in compressed), compressed
    assert all(r["bytes_per_token"] < 0.3 * exact[0]["bytes_per_token"] for r in compressed)
    link = rows["link"]["table"]
    assert {r["codec"] for r in link} == {"none", "int8", "int4"}
    for r in link:  # fetching wins at every link rate above the flip, and loses below it
        for gbps, us in r["fetch_us"].items():
            assert (us < r["compute_us"]) == (float(gbps) > r["flip_gbps"]), r


def test_a_blend_that_does_not_move_the_keys_fails(gpu_blend, monkeypatch):
    class Unmoved:  # copy_chunks' move to each chunk's place is skipped (the store is still built moved)
        @classmethod
        def of(cls, *args, **kwargs):
            return cls()

        def layers(self, which):
            return self

        def apply(self, k):
            return k
    monkeypatch.setattr(gpu_blend, "Rotation", Unmoved)
    args = TINY + ["--sizes", "0", "--model-attention", "torch_blocks"]
    assert gpu_blend.main(args) == 1
