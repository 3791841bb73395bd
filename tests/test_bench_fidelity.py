"""`chunkcache eval`'s measurement on tiny random-weight models: the fidelity metrics against their oracles (full
recompute is teacher-forced agreement 1.0 and KL 0 with itself; the bucketed KL is a lower bound of the exact one),
bootstrap intervals, case counts, and `--resume` (it skips finished rows and gives the uninterrupted table)."""

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from chunkbench import intervals, workloads
from chunkbench.quality import fidelity_measures, quality
from chunkbench.quality.quality import COLUMNS, EvalConfig
from chunkbench.quality.reference_path import ReferenceMeasure, greedy_ids, kl_logits
from chunkbench.workloads import WorkloadConfig
from chunkcache.models import tiny_model
from chunkcache.reference import ReferenceBlender

# random weights large enough that the continuation depends on the context (tests/test_reference.py)
TINY = dict(initializer_range=0.1)


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model("llama", **TINY)


def config(model_dir, out=None, **kw) -> EvalConfig:
    return EvalConfig(workload=WorkloadConfig("synthetic:multikey", requests=3, docs=2, words=40),
                      selectors=("full", "none", "epic"), ratios=(0.2,), max_new_tokens=8, model=str(model_dir),
                      resamples=999, out=out, **kw)


# ---- bootstrap intervals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [[0.25] * 40, [1.0], [0.0] * 7])
def test_interval_of_a_constant_is_the_constant(values):
    assert intervals.mean_interval(values) == (values[0], values[0])


def test_interval_of_a_proportion_matches_the_normal_approximation():
    values = [1.0] * 60 + [0.0] * 40  # p = 0.6, n = 100: mean +- 1.96 * sqrt(p (1 - p) / n) = 0.6 +- 0.096
    low, high = intervals.mean_interval(values)
    assert low == pytest.approx(0.504, abs=0.02) and high == pytest.approx(0.696, abs=0.02)
    assert intervals.mean_interval(values) == (low, high)  # seeded


# ---- fidelity metrics -------------------------------------------------------------------------------------------


def test_agreement_counts_matching_positions():
    assert fidelity_measures.agreement([5, 6, 7, 8], [5, 6, 0, 8]) == 0.75
    with pytest.raises(ValueError):
        fidelity_measures.agreement([1], [1, 2])


def test_bucketed_kl_is_exact_on_a_full_support_and_a_lower_bound_otherwise():
    g = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(50, generator=g) * 2, torch.randn(50, generator=g) * 2
    p, q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    exact = kl_logits(p_logits, q_logits)
    assert exact == pytest.approx(float((p.exp() * (p - q)).sum()))
    everything = {t: float(p[t]) for t in range(50)}
    assert fidelity_measures.kl_top(everything, {t: float(q[t]) for t in range(50)}) == pytest.approx(exact, rel=1e-9)
    for k in (1, 5, 20):
        top = {int(t): float(p[t]) for t in p.topk(k).indices}
        assert 0.0 <= fidelity_measures.kl_top(top, {t: float(q[t]) for t in top}) <= exact + 1e-12
    assert fidelity_measures.kl_top(top, top) == 0.0 and kl_logits(p_logits, p_logits) == 0.0


# ---- teacher forcing on the reference blender ------------------------------------------------------------------


def random_case(seed: int, chunk_sizes: tuple[int, int]) -> tuple[list[int], list[list[int]], list[int]]:
    """A prefix of 7 random tokens, two chunks of `chunk_sizes`, a query of 9."""
    g = torch.Generator().manual_seed(seed)
    prefix, chunks, query = (torch.randint(3, 1000, (n,), generator=g).tolist() for n in (7, sum(chunk_sizes), 9))
    return prefix, [chunks[:chunk_sizes[0]], chunks[chunk_sizes[0]:]], query


def test_teacher_forced_logits_are_the_hf_forward_over_prompt_and_continuation(model_dir):
    blender = ReferenceBlender.from_pretrained(model_dir)
    prefix, chunks, query = random_case(1, (25, 15))
    full = blender.full_prefill(prefix, chunks, query)
    continuation = blender.generate(full, 10)
    forced = blender.teacher_forced_logits(full, continuation)
    ids = torch.tensor([prefix + chunks[0] + chunks[1] + query + continuation])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        oracle = model(input_ids=ids).logits[0, full.layout.n - 1: -1].float()
    torch.testing.assert_close(forced, oracle, atol=1e-4, rtol=1e-5)
    assert forced.argmax(-1).tolist() == continuation  # greedy decoding agrees with its own teacher forcing
    blended = blender.blend(prefix, chunks, query, selector="none")
    assert blender.teacher_forced_logits(blended, continuation).shape == forced.shape


def test_greedy_ids_are_step_by_step_greedy_decoding(model_dir):
    """One teacher-forced pass stands in for decoding only when it agrees with the reference at every position:
    full recompute against its own answer (the shortcut) and naive reuse that answers otherwise (decoded)."""
    blender = ReferenceBlender.from_pretrained(model_dir)
    prefix, chunks, query = random_case(2, (30, 30))
    full = blender.full_prefill(prefix, chunks, query)
    reference = blender.generate(full, 12)
    naive = blender.blend(prefix, chunks[::-1], query, selector="none")
    decoded = blender.generate(naive, 12)
    assert decoded != reference  # the premise: this blend answers otherwise
    for result, oracle in ((full, reference), (naive, decoded)):
        ids, forced = greedy_ids(blender, result, reference, 12)
        assert ids == oracle
        assert forced == blender.teacher_forced_logits(result, reference).argmax(-1).tolist()


# ---- eval on the reference path ---------------------------------------------------------------------------------


def test_full_recompute_has_agreement_one_and_kl_zero(model_dir):
    result = quality.run(config(model_dir))
    rows = {(r["item"], r["selector"]): r for r in result["rows"]}
    assert len(rows) == 3 * 4
    for (_, selector), r in rows.items():
        if selector in ("full", "full-blend"):  # the oracle, and the blender recomputing every token
            assert r["tf_agreement"] == 1.0 and r["kl_first"] < 1e-6 and r["same"] == 1.0
    table = {t["selector"]: t for t in result["table"]}
    assert table["full"]["ci"]["tf_agreement"] == [1.0, 1.0]
    # naive reuse of a random model's chunks moves its distributions: the metrics are not trivially perfect
    assert table["none"]["kl_first"] > 1e-4
    for t in result["table"]:
        for key, _ in COLUMNS:
            low, high = t["ci"][key]
            assert low <= t[key] + 1e-12 and t[key] <= high + 1e-12
    text = quality.markdown(result)
    assert "| full-blend | - | 3 |" in text and "exact, over the vocabulary" in text and "[1.000, 1.000]" in text


def test_resume_runs_only_missing_rows_and_gives_the_same_table(model_dir, tmp_path, monkeypatch):
    whole = quality.run(config(model_dir, out=tmp_path / "a" / "eval.json"))
    lines = (tmp_path / "a" / "eval.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 12 and (tmp_path / "a" / "eval.md").read_text() == quality.markdown(whole)
    # cut short inside case 1 (its full row written, its blends not), the next row half written
    cut = tmp_path / "b" / "eval.jsonl"
    cut.parent.mkdir()
    cut.write_text("\n".join(lines[:6]) + "\n" + lines[6][:30])
    fulls = []
    original = ReferenceMeasure.full
    monkeypatch.setattr(ReferenceMeasure, "full", lambda self, item: fulls.append(item.id) or original(self, item))
    resumed = quality.run(config(model_dir, out=tmp_path / "b" / "eval.json", resume=True))
    assert fulls == ["multikey1", "multikey2"]  # case 0 was complete
    again = cut.read_text().splitlines()
    assert len(again) == 1 + 12 and again[:6] == lines[:6]  # finished rows kept as they were, timings included

    def quality_only(table):
        return [({k: v for k, v in t.items() if k not in quality.TIMINGS and k != "ci"},
                 {k: v for k, v in t["ci"].items() if k not in quality.TIMINGS}) for t in table]

    assert quality_only(resumed["table"]) == quality_only(whole["table"])
    other = replace(config(model_dir, out=tmp_path / "b" / "eval.json", resume=True), max_new_tokens=4)
    with pytest.raises(ValueError, match="another measurement"):
        quality.run(other)
    assert json.loads(cut.read_text().splitlines()[0])["identity"]["max_new_tokens"] == 8  # refused, not rewritten


def test_compression_study_resumed_with_another_codec_adds_only_that_codecs_rows(model_dir, tmp_path):
    from chunkbench.studies import compression
    out = tmp_path / "compression.jsonl"
    compression.quality(["multikey"], 2, ["none"], out, model=str(model_dir))
    first = out.read_text().splitlines()
    compression.quality(["multikey"], 2, ["none", "int8"], out, model=str(model_dir))
    rows = compression.read_rows([out])
    assert out.read_text().splitlines()[:len(first)] == first  # rows written before are kept as they were
    assert sorted((r["item"], r["codec"]) for r in rows) == sorted(
        (f"multikey{i}", c) for i in range(2) for c in ("full", "none", "int8"))  # each once


# ---- case counts ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["synthetic:multikey", "synthetic:multivalue", "synthetic:vartrack",
                                  "synthetic:bridge", "musique"])
def test_every_family_has_100_distinct_cases(spec):
    cases = workloads.items(WorkloadConfig(spec, requests=100, docs=3, words=120))
    assert len({c.id for c in cases}) == len({(c.documents, c.question) for c in cases}) == 100
    assert all(c.answers for c in cases)


def test_musique_draws_are_other_cases_of_the_same_records():
    first = workloads.items(WorkloadConfig("musique", requests=100, docs=5, words=120))
    drawn = workloads.items(WorkloadConfig("musique", requests=100, docs=5, words=120, seed=1))
    assert [c.question for c in drawn] == [c.question for c in first]  # the same records, in order
    assert not {c.id for c in drawn} & {c.id for c in first}  # never confused with the first cases
    assert sum(c.documents != f.documents for c, f in zip(drawn, first)) == 100
    records = json.loads(workloads.DEFAULT_MUSIQUE.read_text())
    for case, record in zip(drawn, records):  # 5 distinct passages of the record's own, each cut to 120 words
        assert len(set(case.documents)) == 5
        assert set(case.documents) <= {workloads._paragraph(c, 120) for c in record["ctxs"]}
    assert workloads.items(WorkloadConfig("musique", requests=100, docs=5, words=120, seed=1)) == drawn
