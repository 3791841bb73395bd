"""Answer scoring (SQuAD-style normalisation, F1, EM) and the summary's per-pair arithmetic, on hand-computed cases."""

import pytest

from chunkbench import scoring
from chunkbench.serving import ab_report
from chunkbench.serving.ab import first_line


@pytest.mark.parametrize("text, expected", [
    ("The  Quick, brown fox!", "quick brown fox"),
    ("An apple a day", "apple day"),
    ("Theatre of the Absurd", "theatre of absurd"),  # articles only as whole words
    ("U.S.A. (1776)", "usa 1776"),
    ("  \n\t ", ""),
])
def test_normalize(text, expected):
    assert scoring.normalize(text) == expected


@pytest.mark.parametrize("prediction, gold, expected", [
    ("Exeter College, Oxford", "Exeter College", 0.8),  # P = 2/3, R = 1
    ("the cat sat", "a cat", 2 / 3),  # P = 1/2, R = 1
    ("paris paris", "Paris", 2 / 3),  # a repeated token counts once per gold occurrence
    ("Berlin", "Paris", 0.0),
    ("the", "a", 1.0),  # both empty after normalisation
    ("Paris", "the", 0.0),
])
def test_f1(prediction, gold, expected):
    assert scoring.f1(prediction, gold) == pytest.approx(expected)


def test_exact_match_and_best_over_golds():
    assert scoring.exact_match("The Eiffel Tower.", "eiffel tower") == 1.0
    assert scoring.exact_match("Eiffel Tower in Paris", "eiffel tower") == 0.0
    assert scoring.best_f1("Tokyo", ["Kyoto", "Tokyo, Japan"]) == pytest.approx(2 / 3)
    assert scoring.best_em("tokyo japan", ["Kyoto", "Tokyo, Japan"]) == 1.0
    assert scoring.best_f1("anything", []) == 0.0 and scoring.best_em("anything", []) == 0.0


def test_first_line_is_scored():
    assert first_line("\n  Paris.\nThe capital of France is Paris, which") == "Paris."
    assert first_line("") == ""


def test_ratios_are_per_request_pair_and_goodput_counts_good_requests_over_the_span():
    stock = [{"request": "a", "ttft_s": 2.0}, {"request": "b", "ttft_s": 10.0}]
    cc = [{"request": "b", "ttft_s": 5.0}, {"request": "a", "ttft_s": 0.5}]
    assert ab_report.ratios(cc, stock, "ttft_s") == [0.5, 0.25]
    rows = [{"arrival_s": 1.0, "finish_s": 3.0, "f1": 0.9, "output_tokens": 4},
            {"arrival_s": 2.0, "finish_s": 5.0, "f1": 0.1, "output_tokens": 6}]
    assert ab_report.goodput(rows, threshold=0.5) == pytest.approx((2 / 4, 1 / 4, 10 / 4))
    assert ab_report.pct([1.0, 2.0, 3.0, float("nan")], 50) == 2.0
