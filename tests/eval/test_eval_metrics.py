"""Scores of the accuracy harness on known cases (and RULER's metrics against the package's own)."""

import math

import pytest

from elastic_vllm.eval import metrics as M


def test_string_match_all_and_part():
    refs = ["8790261", "1234567"]
    assert M.string_match_all("the numbers are 8790261 and 1234567.", refs) == 100.0
    assert M.string_match_all("only 8790261", refs) == 50.0
    assert M.string_match_all("none", refs) == 0.0
    assert M.string_match_part("only 8790261", refs) == 100.0
    assert M.string_match_part("none", refs) == 0.0
    assert M.string_match_all("Alpha-Beta", ["alpha-beta"]) == 100.0  # case-insensitive
    with pytest.raises(ValueError):
        M.string_match_all("x", [])


def test_ruler_metrics_equal_the_packages():
    from long_context_eval.eval.synthetic.constants import (
        string_match_all_per_sample,
        string_match_part_per_sample,
    )

    preds = ["A: 8790261, 42", "\x07nothing\n", "QA answer Denver Broncos", "blue-sky and RED-SEA"]
    refs = [["8790261", "42"], ["8790261"], ["Denver Broncos", "Broncos"], ["blue-sky", "red-sea", "x"]]
    ours_all = [M.string_match_all(M.postprocess_pred(p), r) for p, r in zip(preds, refs)]
    ours_part = [M.string_match_part(M.postprocess_pred(p), r) for p, r in zip(preds, refs)]
    assert ours_all == pytest.approx(string_match_all_per_sample(preds, refs))
    assert ours_part == pytest.approx(string_match_part_per_sample(preds, refs))


def test_postprocess_like_ruler():
    assert M.postprocess_pred("  a\tb\x00c \n") == "a\nb\nc"
    assert M.postprocess_pred(None) == ""


def test_rouge_l_known_cases():
    # LCS("the cat sat on the mat", "the cat on the mat") = 5 -> P = 5/6, R = 5/5
    p, r = "The cat sat on the mat.", "the cat on the mat"
    f = 2 * (5 / 6) * 1.0 / (5 / 6 + 1.0)
    assert M.rouge_l(p, r) == pytest.approx(100 * f)
    assert M.rouge_l("a b c", "a b c") == 100.0
    assert M.rouge_l("a b c", "d e f") == 0.0
    assert M.rouge_l("", "") == 100.0
    assert M.rouge_l("", "x") == 0.0
    assert M.rouge_l("police killed the gunman", "the gunman police killed") == pytest.approx(50.0)  # LCS 2 of 4
    assert M.lcs_length(list("ABCBDAB"), list("BDCABA")) == 4  # the textbook example


def test_levenshtein_and_edit_similarity():
    assert M.levenshtein("kitten", "sitting") == 3
    assert M.levenshtein("", "abc") == 3
    assert M.levenshtein("flaw", "lawn") == 2
    assert M.edit_similarity("kitten", "sitting") == pytest.approx(100 * (1 - 3 / 7))
    assert M.edit_similarity("x = f(a)", "x = f(a)") == 100.0
    assert M.edit_similarity("", "") == 100.0
    assert M.edit_similarity("", "abcd") == 0.0


def test_first_code_line_and_nll_score():
    assert M.first_code_line("\n   \n    return x  # done\n    y = 2") == "return x  # done"
    assert M.first_code_line("") == ""
    assert M.nll_score(3.0, 3.0) == 100.0
    assert M.nll_score(3.1, 3.0) == pytest.approx(100 * math.exp(-0.1))
