"""`chunkcache calibrate` on a tiny random-weight llama (a qwen2 is calibrated before its server starts:
tests/test_architectures.py): it measures cases on the reference engine, fits on a third, judges the rest, writes an
estimator the server's lookup finds by the weights' fingerprint (and no other model's), goes on from its work
directory, reads a user's documents and a server's audited prompts (the end-to-end run of those:
tests/test_audit_serving.py), and refuses bad input with a message."""

import json
import shutil

import pytest

from chunkbench.quality import calibration
from chunkbench.quality.fidelity_fit import measured
from chunkbench.workloads import WorkloadConfig, items
from chunkcache.blend import fidelity
from chunkcache.hashing import model_fingerprint
from chunkcache.models import tiny_model

TINY = dict(initializer_range=0.1)  # random weights whose greedy continuation depends on the context
SMALL = ["--families", "multikey", "--cases", "6", "--covers", "4", "--threads", "1"]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", **TINY)


@pytest.fixture(scope="module")
def calibrated(llama, tmp_path_factory):
    """One run of the command on the tiny llama: (its work directory, the calibrations file, what it printed)."""
    root = tmp_path_factory.mktemp("calibrate")
    work, out = root / "work", root / "fidelity.json"
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert calibration.main(["--model", str(llama), *SMALL, "--workdir", str(work), "--out", str(out)]) == 0
    return work, out, printed.getvalue()


def test_calibrate_writes_an_estimator_the_lookup_finds_by_fingerprint(calibrated, llama, tmp_path):
    _, out, printed = calibrated
    data = json.loads(out.read_text())
    fidelity.parse(data)  # what a server reads
    (label, entry), = data["models"].items()
    assert entry["fingerprint"] == model_fingerprint(llama) and label.endswith("@" + entry["fingerprint"][:12])
    assert entry["covers"] == 4 and "KL over 4 answer token(s)" in entry["fitted_on"]
    # beside it, the first-token estimator a request's kl_over: first_token reads, fitted on the same cases
    assert entry["first_token"]["covers"] == 1 and "KL over 1 answer token(s)" in entry["first_token"]["fitted_on"]
    assert entry["ratios"] == entry["first_token"]["ratios"] == list(fidelity.RATIOS)
    found = fidelity.coefficients(out).model(llama)
    assert found is not None and found.name == label and found.covers == 4
    # the same weights under another directory name: found by their fingerprint
    renamed = shutil.copytree(llama, tmp_path / "my-finetune")
    assert fidelity.coefficients(out).model(renamed).name == label
    # other weights: none, not this one's, though the shipped ones stay (looked up by name)
    assert fidelity.coefficients(out).model(tiny_model("llama", seed=1, **TINY)) is None
    assert fidelity.coefficients(out).model("smollm2-135m-instruct").name == "smollm2-135m-instruct"
    # the table: one line per bound, judged on the cases not fitted (4 of 6: seeds 1001, 1002, 1004, 1005)
    lines = [line for line in printed.splitlines() if line.startswith("| multikey |")]
    assert [float(line.split("|")[2]) for line in lines] == list(calibration.ANSWER_BOUNDS)  # covers > 1
    assert all(line.split("|")[3].strip() == "4" for line in lines)


def test_the_rows_hold_the_kl_at_each_token_of_fulls_answer(calibrated):
    work, _, _ = calibrated
    rows = [json.loads(line) for line in (work / "multikey.jsonl").read_text().splitlines()[1:]]
    assert len(rows) == 6 * len(fidelity.RATIOS)
    for row in rows:
        kls = row["answer_kls"]
        assert 1 <= len(kls) <= calibration.MAX_NEW_TOKENS and min(kls) >= 0
        assert kls[0] == pytest.approx(row["kl"], rel=1e-4, abs=1e-7)  # row 0 is the first token's distribution
        assert measured(row, 1) == row["kl"] and measured(row, 3) == max(kls[:3])
        assert row["blend_s"] > 0 and row["full_s"] > 0


def test_a_second_run_goes_on_from_its_work_directory(calibrated, llama, monkeypatch, capsys):
    work, out, _ = calibrated

    def measure(*args):
        raise AssertionError("a measured case was measured again")

    monkeypatch.setattr(calibration, "measure", measure)
    again = out.parent / "again.json"
    assert calibration.main(["--model", str(llama), *SMALL, "--workdir", str(work), "--out", str(again)]) == 0
    assert "measuring" not in capsys.readouterr().out
    assert json.loads(again.read_text())["models"] == json.loads(out.read_text())["models"]  # the same fit
    # more cases asked than measured, measuring none: the measured ones fitted and judged
    more = [*SMALL[:3], "9", *SMALL[4:]]
    assert calibration.main(["--model", str(llama), *more, "--workdir", str(work), "--out", str(again),
                             "--measured-only"]) == 0
    assert "6 of 9 cases measured; fitting and judging those" in capsys.readouterr().out
    # a family with nothing measured: a message, not a traceback
    assert calibration.main(["--model", str(llama), "--families", "realkey", "--cases", "6", "--workdir", str(work),
                             "--out", str(again), "--measured-only"]) == 1
    assert "0 fit and 0 judged cases measured" in capsys.readouterr().err


def test_a_work_directory_of_the_earlier_grid_is_measured_at_the_rho_it_lacks_only(calibrated, llama, monkeypatch,
                                                                                      tmp_path):
    work, _, _ = calibrated
    old = tmp_path / "work"
    shutil.copytree(work, old)
    lines = (old / "multikey.jsonl").read_text().splitlines()
    identity = json.loads(lines[0])["identity"]
    rows = [json.loads(line) for line in lines[1:]]
    kept = [r for r in rows if r["ratio"] in fidelity.EARLIER_RATIOS]
    (old / "multikey.jsonl").write_text("\n".join(
        [json.dumps({"identity": {**identity, "ratios": list(fidelity.EARLIER_RATIOS)}}),
         *map(json.dumps, kept)]) + "\n")
    asked = []

    def measure(blender, item, file, task, max_new_tokens, ratios):
        asked.append((item.id, tuple(ratios)))
        return [r for r in rows if r["item"] == item.id and r["ratio"] in ratios]

    monkeypatch.setattr(calibration, "measure", measure)
    assert calibration.main(["--model", str(llama), *SMALL, "--workdir", str(old), "--out",
                             str(tmp_path / "f.json")]) == 0
    new = sorted(set(fidelity.RATIOS) - set(fidelity.EARLIER_RATIOS))
    assert sorted(asked) == sorted((r["item"], tuple(new)) for r in rows if r["ratio"] == new[0])
    assert json.loads((old / "multikey.jsonl").read_text().splitlines()[0])["identity"] == identity


def test_a_users_documents_make_needle_cases(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    words = "the river carried grain and timber past the old mill toward the harbour every spring".split()
    for f in range(3):
        paragraphs = [" ".join(" ".join(words[(i + j + k) % len(words)] for j in range(12)) + "." for k in range(5))
                      for i in range(4)]
        (folder / f"notes{f}.txt").write_text("\n\n".join(paragraphs))
    cases = items(WorkloadConfig(f"documents:{folder}", requests=3, docs=3, words=50, seed=1000))
    assert [c.id for c in cases] == ["documents1000", "documents1001", "documents1002"]
    for case in cases:  # a needle hidden in the user's paragraphs, asked for
        assert len(case.documents) == 3 and case.answers and any(case.answers[0] in d for d in case.documents)
    # what the command measures with --documents (a tiny qwen2 is calibrated end to end in test_architectures)
    planned = calibration.plan(calibration.parse(["--documents", str(folder), "--cases", "6"]))
    (family, cases), = planned.values()
    assert list(planned) == ["documents"] and family.spec == f"documents:{folder.resolve()}"
    assert [c.id for c in cases] == [f"documents{n}" for n in range(1000, 1006)]


def test_a_jsonl_of_passages_and_questions_is_read_as_given(tmp_path):
    path = tmp_path / "cases.jsonl"
    path.write_text(json.dumps({"passages": ["alpha " * 80, "beta gamma"], "question": "Which?", "answers": ["a"]})
                    + "\n\n" + json.dumps({"passages": ["delta"], "question": "What?"}) + "\n")
    first, second = items(WorkloadConfig(f"documents:{path}", requests=2, docs=4, words=10))
    assert first.documents == (" ".join(["alpha"] * 10), "beta gamma") and first.answers == ("a",)
    assert second.question == "Question: What?\nAnswer:" and second.answers == ()
    path.write_text('{"passages": ["x"]}\n')
    with pytest.raises(ValueError, match=r"cases.jsonl:1: expected"):
        items(WorkloadConfig(f"documents:{path}", requests=1))


@pytest.mark.parametrize("argv, message", [
    (["--cases", "2"], "at least 3"),
    (["--families", "multikey,nonsense"], "unknown families"),
    (["--bounds", "0.1,x"], "--bounds: comma-separated numbers"),
    (["--bounds", "0,0.1"], "--bounds must be > 0"),
    (["--fresh", "--measured-only"], "give one"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        calibration.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("make", ["missing", "few paragraphs"])
def test_documents_that_cannot_make_cases_are_refused_before_anything_runs(make, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "docs"
    if make == "few paragraphs":
        folder.mkdir()
        (folder / "a.txt").write_text("too short")
    monkeypatch.setattr(calibration, "measure", None)  # nothing is measured
    assert calibration.main(["--documents", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("chunkcache calibrate: ") and ("no such file" in err or "paragraphs" in err)


def test_the_rows_signals_are_their_evidences_and_pack_writes_them(calibrated, tmp_path):
    """Rows carry the signals fidelity.signals computes from the case's evidence, so they fit and judge without it;
    `pack` writes them into rows collected without."""
    from types import SimpleNamespace

    from chunkbench.quality.fidelity_fit import load_points, pack

    work, _, _ = calibrated
    path = work / "multikey.jsonl"
    of = (lambda paths: {(p.item, p.row["ratio"]): p.signals for p in load_points(paths)})
    from_rows = of([str(path)])
    assert len(from_rows) == 6 * len(fidelity.RATIOS)
    bare = tmp_path / "multikey.jsonl"
    head, *rows = path.read_text().splitlines()
    bare.write_text("\n".join([head, *(json.dumps({k: v for k, v in json.loads(r).items() if k != "signals"})
                                       for r in rows)]) + "\n")
    assert of([str(bare)]) == {}  # neither signals nor evidence
    shutil.copytree(work / "multikey.evidence", tmp_path / "multikey.evidence")
    assert of([str(bare)]) == from_rows
    pack(SimpleNamespace(paths=[str(bare)]))
    shutil.rmtree(tmp_path / "multikey.evidence")
    assert of([str(bare)]) == from_rows


def served_line(ids: list[int], spans) -> str:
    """A line of a server's audit.cases file written with audit.keep_prompts (sglang_patch.scheduler.audit)."""
    return json.dumps({"rid": "r", "kl": 0.01, "prompt_ids": ids, "chunk_spans": [list(s) for s in spans]})


def test_a_servers_audited_prompts_are_split_at_the_chunks_it_blended(tmp_path):
    path = tmp_path / "cases.jsonl"
    ids = list(range(100, 120))
    path.write_text("\n".join([json.dumps({"rid": "no prompt kept", "kl": 0.01}),
                               served_line(ids, [(3, 8), (10, 15)]), ""]) + "\n")
    (case,) = calibration.served_cases(path, limit=5)
    prefix, chunks, query = case.parts
    # the separator between the chunks goes with the chunk before it: the blend reuses none of it either way
    assert (prefix, chunks, query) == (ids[:3], [ids[3:10], ids[10:15]], ids[15:]) and case.id == "served0"
    assert prefix + sum(chunks, []) + query == ids
    for spans in ([(3, 8), (7, 15)], [(3, 20)], [(5, 5)], []):
        path.write_text(served_line(ids, spans) + "\n")
        with pytest.raises(ValueError, match=r"cases.jsonl:1: chunk_spans"):
            calibration.served_cases(path, limit=5)
    path.write_text(json.dumps({"rid": "r"}) + "\n")
    with pytest.raises(ValueError, match="audit.keep_prompts"):
        calibration.served_cases(path, limit=5)
