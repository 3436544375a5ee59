"""Tests of the answer verifiers in verl/utils/reward_score (docs/spec.md#training-reward, #evaluation-metrics)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import verl.utils.reward_score as rs
from verl.utils.reward_score import gsm8k, hotpotqa, lenient, ruler
from verl.utils.reward_score.math_normalize import (
    as_answer_list,
    extract_boxed_answer,
    is_equiv,
    last_boxed_only_string,
    remove_boxed,
    strip_string,
)

FAST = settings(max_examples=200, deadline=None)


# ----------------------------------------------------------------------------- strip_string rules


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("a\nb", "ab"),  # 1. linebreaks
        ("a\\!b", "ab"),  # 2. inverse spaces
        ("a\\\\b", "a\\b"),  # 3. \\ -> \
        ("\\tfrac{1}{2}", "\\frac{1}{2}"),  # 4. tfrac
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),  # 4. dfrac
        ("\\left(x\\right)", "(x)"),  # 5. \left \right
        ("90^{\\circ}", "90"),  # 6. degrees, braced
        ("90^\\circ", "90"),  # 6. degrees, bare
        ("\\$5", "5"),  # 7. dollar
        ("50\\%", "50"),  # 8. percent
        ("x .5", "x0.5"),  # 9. " ." -> " 0." then spaces deleted
        ("{.5}", "{0.5}"),  # 9. "{." -> "{0."
        ("", ""),  # 10. empty
        ("Eiffel  Tower ", "EiffelTower"),  # 11. spaces
        ("\\\\left(x\\\\right)", "(x)"),  # order: \\ -> \ happens before \left removal
    ],
)
def test_strip_string_applies_each_listed_rule(raw: str, expected: str) -> None:
    assert strip_string(raw) == expected


@pytest.mark.parametrize("raw", ["k=5", ".5", "0.5", "1/2", "5\\text{cm}", "a\tb"])
def test_strip_string_has_no_rules_beyond_the_spec_list(raw: str) -> None:
    # The full MATH normaliser would strip "k=", prefix "0", rewrite 0.5 and a/b, drop units;
    # the MemAgent reduced version does none of that, and tabs are not whitespace for it.
    assert strip_string(raw) == raw


def test_is_equiv_none_handling_and_normalisation() -> None:
    assert is_equiv(None, None) is True
    assert is_equiv("a", None) is False
    assert is_equiv("\\dfrac{1}{2}", "\\frac {1}{2}") is True
    assert is_equiv("1/2", "\\frac{1}{2}") is False


# ----------------------------------------------------------------------------- boxed extraction


def test_last_boxed_only_string_forms() -> None:
    assert last_boxed_only_string("a \\boxed{x} b \\boxed{y} c") == "\\boxed{y}"
    assert last_boxed_only_string("so \\boxed Paris$ rest") == "\\boxed Paris"
    assert last_boxed_only_string("so \\boxed Paris") == "\\boxed Paris"
    assert last_boxed_only_string("\\fbox{42}") == "\\fbox{42}"
    assert last_boxed_only_string("\\boxed{\\frac{1}{2}} end") == "\\boxed{\\frac{1}{2}}"
    assert last_boxed_only_string("\\boxed{a{b") is None
    assert last_boxed_only_string("no box here") is None
    assert last_boxed_only_string(None) is None
    # The space form wins even over a later brace form (original behaviour).
    assert last_boxed_only_string("\\boxed London$ then \\boxed{Paris}") == "\\boxed London"
    # of several space forms the last one
    assert last_boxed_only_string("\\boxed London$ and \\boxed Paris$ end") == "\\boxed Paris"
    # a stray } before the first { drives the depth to -1 and is skipped: the expression closes at depth 0
    assert last_boxed_only_string("\\boxed}{{a}} x") == "\\boxed}{{a}"


def test_remove_boxed_and_extract_boxed_answer() -> None:
    assert remove_boxed("\\boxed{x}") == "x"
    assert remove_boxed("\\boxed x") == "x"
    assert remove_boxed("\\fbox{x}") == "x"
    assert remove_boxed("\\boxed{}") == ""
    assert remove_boxed("\\boxedx{a}") is None  # located by rfind("\\boxed") but not a wrapper
    assert remove_boxed(None) is None
    assert extract_boxed_answer("Answer: \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert extract_boxed_answer("first \\boxed{A}, finally \\boxed{B}") == "B"
    assert extract_boxed_answer("so \\boxed Paris$") == "Paris"
    assert extract_boxed_answer("\\boxed{a{b") is None
    assert extract_boxed_answer("") is None
    assert extract_boxed_answer("Case \\Boxed{Kept}") is None  # no lower-casing in the lenient extractor
    assert hotpotqa.extract_boxed_answer is extract_boxed_answer


def test_as_answer_list_coerces_gold_containers() -> None:
    assert as_answer_list("ab") == ["ab"]  # a str is one answer, not its characters
    assert as_answer_list(["a", None, ("b", "c")]) == ["a", "b", "c"]
    assert as_answer_list(np.array(["x", "y"], dtype=object)) == ["x", "y"]
    assert as_answer_list(np.array("z")) == ["z"]
    assert as_answer_list(42) == ["42"]
    assert as_answer_list(None) == []


# ----------------------------------------------------------------------------- strict verifier


@pytest.mark.parametrize(
    ("solution", "gold", "expected"),
    [
        ("so \\boxed Paris$", ["Paris"], 1.0),  # space form up to the first $
        ("so \\boxed Paris", ["Paris"], 1.0),
        ("the result is \\fbox{Paris}", ["Paris"], 1.0),  # \fbox fallback (deviation: unwrapped)
        ("x = \\boxed{\\frac{1}{2}}", ["\\frac{1}{2}"], 1.0),  # nested braces
        ("x = \\boxed{\\frac{1}{2}}", ["\\dfrac{1}{2}"], 1.0),
        ("x = \\boxed{\\frac{1}{2}}", ["1/2"], 0.0),
        ("\\boxed{ EIFFEL\n  tower }", ["Eiffel Tower"], 1.0),  # case + whitespace insensitive
        ("\\BOXED{paris}", ["PARIS"], 1.0),  # the whole tail is lower-cased first
        ("\\boxed{Eiffel Tower}", ["the Eiffel Tower"], 0.0),  # articles are NOT ignored
        ("\\boxed{Washington DC}", ["Washington, D.C."], 0.0),  # punctuation is NOT ignored
        ("\\boxed{London} no wait \\boxed{Paris}", ["London"], 0.0),  # last box only
        ("\\boxed{London} no wait \\boxed{Paris}", ["Paris"], 1.0),
        ("\\boxed London$ then \\boxed{Paris}", ["London"], 1.0),  # space form precedence
        ("\\boxed{a{b", ["a{b"], 0.0),  # unbalanced
        ("Paris", ["Paris"], 0.0),  # no box
        ("\\boxed{a}", "ab", 0.0),  # a str gold is one answer, not its characters
        ("\\boxed{a}", "a", 1.0),
        ("\\boxed{Rome}", ("Paris", "Rome"), 1.0),  # max over golds
        ("\\boxed{Rome}", np.array(["Paris", "Rome"], dtype=object), 1.0),
        ("\\boxed{42}", [42], 1.0),
        ("\\boxed{42}", [], 0.0),
        (None, ["Paris"], 0.0),
        ("", ["Paris"], 0.0),
    ],
)
def test_strict_hotpotqa_compute_score(solution, gold, expected) -> None:
    assert hotpotqa.compute_score(solution, gold) == expected


def test_strict_only_reads_the_last_300_characters() -> None:
    box = "\\boxed{Paris}"  # 13 characters
    assert hotpotqa.STRICT_TAIL_CHARS == 300
    assert hotpotqa.compute_score(box + "x" * (300 - len(box)), ["Paris"]) == 1.0
    # One more character pushes the leading backslash out of the window.
    assert hotpotqa.compute_score(box + "x" * (301 - len(box)), ["Paris"]) == 0.0
    assert hotpotqa.compute_score(box + " filler" * 100, ["Paris"]) == 0.0
    # An earlier box outside the window does not count, a later one inside does.
    assert hotpotqa.compute_score("\\boxed{Rome}" + "y" * 400 + "\\boxed{Paris}", ["Rome"]) == 0.0
    assert hotpotqa.extract_strict_answer("\\boxed{Rome}" + "y" * 400 + "\\boxed{Paris}") == "paris"


# ----------------------------------------------------------------------------- lenient: extraction


def test_extract_solution_think_handling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORCE_THINK", raising=False)
    assert lenient.extract_solution("plain") == ("plain", "plain")
    text = "<think>a</think> b </think>  final answer  "
    assert lenient.extract_solution(text) == ("final answer", text)
    assert lenient.extract_solution(None) == (None, None)
    monkeypatch.setenv("FORCE_THINK", "1")
    assert lenient.extract_solution("plain") == (None, "plain")
    assert lenient.extract_solution("x</think>y") == ("y", "x</think>y")
    assert lenient.extract_solution("plain", force_think=False) == ("plain", "plain")


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("Therefore, the answer is **Paris**.", "Paris"),
        ("the answer is A. Wait, the answer is B.", "B"),  # last occurrence
        ("The answer is Paris", None),  # case-sensitive phrase
        ("no phrase at all", None),
        ("the answer is Paris<｜end▁of▁sentence｜>", "Paris"),
        ("the answer is <｜Assistant｜>Paris", "Paris"),
        ("the answer is  . Paris . ", "Paris"),  # strip / strip('.') / strip
        ("the answer is ...", ""),
        (("the answer is X", "raw"), "X"),  # tuple from extract_solution
        (None, None),
    ],
)
def test_extract_answer(response, expected) -> None:
    assert lenient.extract_answer(response) == expected


def test_normalize_answer() -> None:
    assert lenient.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert lenient.normalize_answer("An apple a day") == "apple day"
    assert lenient.normalize_answer("Theatre") == "theatre"  # articles only as whole words
    assert lenient.normalize_answer(None) == ""


# ----------------------------------------------------------------------------- lenient: metrics


def test_exact_and_sub_exact_match() -> None:
    assert lenient.exact_match_score("Eiffel Tower", "the Eiffel Tower") is True
    assert lenient.exact_match_score("Washington DC", "Washington, D.C.") is True
    assert lenient.exact_match_score("Paris, France", "Paris") is False
    # symmetric containment
    assert lenient.sub_exact_match_score("Paris, France", "Paris") is True
    assert lenient.sub_exact_match_score("Paris", "Paris, France") is True
    assert lenient.sub_exact_match_score("Lyon", "Paris") is False
    # non-empty prediction that normalises to "" is contained in any gold; empty/None is not
    assert lenient.sub_exact_match_score("The.", "Paris") is True
    assert lenient.sub_exact_match_score("", "Paris") is False
    assert lenient.sub_exact_match_score(None, "Paris") is False
    assert lenient.exact_match_score("", "the") is False


def test_f1_score_values_and_yes_no_rule() -> None:
    f1, prec, recall = lenient.f1_score("the big red barn", "red barn house")  # 2 of 3 tokens each
    assert (f1, prec, recall) == pytest.approx((2 / 3, 2 / 3, 2 / 3))
    f1, prec, recall = lenient.f1_score("John Smith Jr", "john smith")  # p = 2/3, r = 1
    assert (f1, prec, recall) == pytest.approx((0.8, 2 / 3, 1.0))
    assert lenient.f1_score("yes", "no") == (0.0, 0.0, 0.0)
    assert lenient.f1_score("yes", "yes it is") == (0.0, 0.0, 0.0)  # overlap, but yes/no rule
    assert lenient.f1_score("no answer given", "no") == (0.0, 0.0, 0.0)
    assert lenient.f1_score("Yes.", "yes") == (1.0, 1.0, 1.0)
    assert lenient.f1_score("Lyon", "Paris") == (0.0, 0.0, 0.0)
    assert lenient.f1_score("", "Paris") == (0.0, 0.0, 0.0)


def test_update_answer_and_calc_metrics() -> None:
    preds = ["Paris", "London Bridge", None]
    golds = ["paris", "London", "x"]
    # sample 1: all 1; sample 2: em 0, sub_em 1, p 1/2, r 1, f1 2/3; sample 3: all 0
    metrics = lenient.new_metrics()
    sample = lenient.update_answer(metrics, preds[1], golds[1])
    assert sample == pytest.approx({"em": 0.0, "sub_em": 1.0, "f1": 2 / 3, "prec": 0.5, "recall": 1.0})
    assert metrics["total_num"] == 1

    rounded = lenient.calc_metrics(preds, golds)
    assert rounded == {"em": 0.33, "sub_em": 0.67, "f1": 0.56, "prec": 0.5, "recall": 0.67, "total_num": 3}
    raw = lenient.calc_metrics_unrounded(preds, golds)
    assert raw["em"] == pytest.approx(1 / 3)
    assert raw["f1"] == pytest.approx(5 / 9)
    assert raw["recall"] == pytest.approx(2 / 3)
    assert lenient.calc_metrics([], [])["sub_em"] == 0.0
    with pytest.raises(ValueError, match="2 predictions but 1 gold"):
        lenient.calc_metrics(["a", "b"], ["a"])


def test_score_prediction_methods_and_gold_selection() -> None:
    text = "<think>maybe the answer is London</think>Therefore, the answer is Paris."
    out = lenient.score_prediction(text, ["Paris", "Rome"])
    assert out["pred"] == "Paris"
    assert (out["em"], out["sub_em"], out["f1"]) == (1.0, 1.0, 1.0)
    # only the first gold answer counts by default; all_golds takes the max
    assert lenient.score_prediction("Therefore, the answer is Rome.", ["Paris", "Rome"])["sub_em"] == 0.0
    assert lenient.score_prediction("Therefore, the answer is Rome.", ["Paris", "Rome"], all_golds=True)["em"] == 1.0
    # boxed methods read \boxed{}
    boxed = "I think \\boxed{Eiffel Tower}"
    assert lenient.score_prediction(boxed, "the Eiffel Tower", method="recurrent-boxed")["em"] == 1.0
    assert lenient.score_prediction(boxed, "the Eiffel Tower", method="boxed")["sub_em"] == 1.0
    assert lenient.score_prediction(boxed, "the Eiffel Tower", method="recurrent")["sub_em"] == 0.0  # no phrase
    # extracted empty prediction -> all zeros; extracted "the" -> sub_em 1 (quirk), em/f1 0
    assert lenient.score_prediction("Therefore, the answer is .", "Paris")["sub_em"] == 0.0
    quirk = lenient.score_prediction("Therefore, the answer is the.", "Paris")
    assert (quirk["pred"], quirk["em"], quirk["sub_em"], quirk["f1"]) == ("the", 0.0, 1.0, 0.0)
    assert lenient.score_prediction(None, "Paris")["sub_em"] == 0.0
    # the answer is read after the reasoning block only: a phrase inside <think> alone gives no prediction
    assert lenient.score_prediction("<think>the answer is London</think>I cannot tell.", "London")["pred"] is None
    assert lenient.score_prediction("   ", "Paris")["pred"] is None
    assert lenient.score_prediction("Therefore, the answer is Paris", [])["em"] == 0.0
    with pytest.raises(ValueError, match="unknown evaluation method 'nope'"):
        lenient.score_prediction("x", "y", method="nope")


def test_strict_vs_lenient_gap_on_articles() -> None:
    solution = "Based on memory, the tower is \\boxed{Eiffel Tower}"
    assert hotpotqa.compute_score(solution, ["the Eiffel Tower"]) == 0.0
    lenient_scores = lenient.score_prediction(solution, ["the Eiffel Tower"], method="recurrent-boxed")
    assert lenient_scores["sub_em"] == 1.0 and lenient_scores["em"] == 1.0


# ----------------------------------------------------------------------------- RULER


def test_string_match_single_functions() -> None:
    assert ruler.string_match_all_single("The numbers are 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert ruler.string_match_all_single("ALPHA-beta", ["alpha-BETA"]) == 1.0
    assert ruler.string_match_all_single("hello world", "WORLD") == 1.0
    assert ruler.string_match_all_single("anything", []) == 0.0
    assert ruler.string_match_all_single(None, ["a"]) == 0.0
    assert ruler.string_match_part_single("only 456 here", ["123", "456"]) == 1.0
    assert ruler.string_match_part_single("nothing", ["123", "456"]) == 0.0


def test_string_match_batch_functions_are_percentages() -> None:
    assert ruler.string_match_all(["123 456", "nothing"], [["123", "456"], ["1", "2"]]) == 50.0
    assert ruler.string_match_all(["a b"], [["a", "b", "c"]]) == 66.67
    assert ruler.string_match_part(["123", "x"], [["123", "456"], ["y"]]) == 50.0
    assert ruler.string_match_part(["123 and 456"], [["123", "456", "789"]]) == 100.0
    assert ruler.string_match_all([], []) == 0.0
    with pytest.raises(ValueError, match="string_match_all: 1 predictions but 2 reference lists"):
        ruler.string_match_all(["a"], [["a"], ["b"]])


def test_score_ruler_response() -> None:
    qa = ruler.score_ruler_response("Therefore, the answer is Denver Broncos.", ["Denver", "Denver Broncos"], "qa_1")
    assert (qa["sub_em"], qa["em"]) == (1.0, 0.0)  # scored against the first gold only
    multi = ruler.score_ruler_response(
        "Therefore, the answer is 1234567, 7654321.", ["1234567", "7654321", "1111111", "2222222"], "niah_multivalue"
    )
    assert multi["sub_em"] == 0.5
    assert ruler.score_ruler_response("1234567", ["1234567"], "niah_single_1")["sub_em"] == 0.0  # no phrase


# ----------------------------------------------------------------------------- GSM8K


def test_gsm8k_extract_strict_and_flexible() -> None:
    assert gsm8k.extract_solution("so ... #### 1,234", "strict") == "1234"
    assert gsm8k.extract_solution("#### $56", "strict") is None  # upstream's rule: digits, '.', ',' after '#### '
    assert gsm8k.extract_solution("#### 42.", "strict") == "42."  # the period is kept, as upstream
    assert gsm8k.extract_solution("#### 1\n#### -2", "strict") == "-2"
    assert gsm8k.extract_solution("the total is 72", "strict") is None
    assert gsm8k.extract_solution("I had 3 apples, then 5. So 8.", "flexible") == "8"
    assert gsm8k.extract_solution("answer: -12", "flexible") == "-12"
    assert gsm8k.extract_solution("it costs $1,000,000 today", "flexible") == "1000000"
    assert gsm8k.extract_solution("3.5 hours", "flexible") == "3.5"
    assert gsm8k.extract_solution("values 3,4", "flexible") == "4"  # not a thousands separator
    assert gsm8k.extract_solution("no digits", "flexible") is None
    assert gsm8k.extract_solution(None, "flexible") is None
    with pytest.raises(ValueError, match="'loose'"):
        gsm8k.extract_solution("1", "loose")


def test_gsm8k_compute_score() -> None:
    assert gsm8k.compute_score("The answer is 42.", "42") == 0.0  # strict by default (upstream): no ####
    assert gsm8k.compute_score("The answer is 42.", "42", method="flexible") == 1.0
    assert gsm8k.compute_score("#### 42.", "42") == 0.0  # upstream scores the trailing period 0 too
    assert gsm8k.compute_score("work... #### 42", "42", method="strict") == 1.0
    assert gsm8k.compute_score("it is 41", "42", format_score=0.1, method="flexible") == 0.1
    assert gsm8k.compute_score("no number", "42", format_score=0.1, method="flexible") == 0.0
    assert gsm8k.compute_score("it is 42", "42", score=2.0, method="flexible") == 2.0
    assert gsm8k.compute_score("it is 1,234", "1,234", method="flexible") == 1.0
    assert gsm8k.compute_score("it is 42", 42, method="flexible") == 1.0


# ----------------------------------------------------------------------------- dispatch


@pytest.fixture()
def restore_registry():
    saved = dict(rs._SCORERS)
    yield
    rs._SCORERS.clear()
    rs._SCORERS.update(saved)


def test_dispatch_routes() -> None:
    boxed = "... \\boxed{Paris}"
    for source in ("hotpotqa", "hotpotqa_dev", "ruler_hotpotqa_200", "ruler_hqa", "ruler_qa_1", "synthetic_kv"):
        assert rs.default_compute_score(source, boxed, ["Paris"]) == 1.0, source
        # strict route: unboxed text scores 0 even though it contains the gold
        assert rs.default_compute_score(source, "Paris", ["Paris"]) == 0.0, source
    # other RULER tasks: string_match_all on the whole response
    assert rs.default_compute_score("ruler_niah_multivalue", "123 and 456", ["123", "456", "789"]) == pytest.approx(
        2 / 3
    )
    assert rs.default_compute_score("ruler_vt", "Paris", ["Paris"]) == 1.0
    for source in ("openai/gsm8k", "gsm8k"):
        assert rs.default_compute_score(source, "so it is 18", "18") == 0.0  # strict by default, as upstream
        assert rs.default_compute_score(source, "so it is 18", "18", method="flexible") == 1.0
        assert rs.default_compute_score(source, "work\n#### 18", "18") == 1.0
    score = rs.default_compute_score("hotpotqa", boxed, ["Paris"], extra_info={"index": 3})
    assert type(score) is float
    assert rs._default_compute_score is rs.default_compute_score


def test_dispatch_unknown_source_error_names_it_and_lists_known() -> None:
    with pytest.raises(ValueError) as info:
        rs.default_compute_score("my_unknown_set", "x", "y")
    message = str(info.value)
    assert "'my_unknown_set'" in message
    for prefix in ("hotpotqa", "gsm8k", "openai/gsm8k", "ruler_"):
        assert repr(prefix) in message
    with pytest.raises(ValueError, match="data_source=None"):
        rs.default_compute_score(None, "x", "y")


def test_register_scorer(restore_registry) -> None:
    seen = {}

    @rs.register_scorer("my_task")
    def my_scorer(solution_str, ground_truth, extra_info=None, **kwargs):
        seen["extra_info"] = extra_info
        return {"score": 0.5, "acc": True}

    assert rs.default_compute_score("my_task_v2", "x", "y", extra_info={"k": 1}) == {"score": 0.5, "acc": True}
    assert seen["extra_info"] == {"k": 1}
    assert "my_task" in rs.known_data_sources()
    # longest prefix wins over the built-in "hotpotqa"
    rs.register_scorer("hotpotqa_custom", lambda s, g, **kw: 7)
    assert rs.default_compute_score("hotpotqa_custom_x", "x", "y") == 7.0
    assert rs.default_compute_score("hotpotqa_other", "\\boxed{y}", "y") == 1.0
    with pytest.raises(ValueError, match="'my_task' is already bound"):
        rs.register_scorer("my_task", lambda s, g, **kw: 0)
    rs.register_scorer("my_task", lambda s, g, **kw: 0.25, overwrite=True)
    assert rs.default_compute_score("my_task", "x", "y") == 0.25
    with pytest.raises(ValueError, match="non-empty str"):
        rs.register_scorer("", my_scorer)


# ----------------------------------------------------------------------------- robustness (properties)

_TRICKY_PIECES = [
    "\\boxed{",
    "\\boxed ",
    "\\boxed",
    "\\fbox{",
    "{",
    "}",
    "$",
    "\\",
    "the answer is",
    "The answer is",
    "</think>",
    "<think>",
    "*",
    ".",
    "#### ",
    "-",
    ",",
    "1",
    "42",
    "Paris",
    " ",
    "\n",
    "a",
    "the",
    "é",
    "Σ",
    "<｜end▁of▁sentence｜>",
    "\\dfrac",
    "yes",
    "no",
]
tricky_text = st.lists(st.sampled_from(_TRICKY_PIECES), max_size=60).map("".join)
any_text = st.one_of(st.text(max_size=400), tricky_text)
maybe_text = st.one_of(st.none(), any_text)
gold_values = st.one_of(any_text, st.lists(any_text, max_size=4))


def _check_all_scorers(solution, gold) -> None:
    assert hotpotqa.compute_score(solution, gold) in (0.0, 1.0)
    for method in lenient.EVAL_METHODS:
        for all_golds in (False, True):
            out = lenient.score_prediction(solution, gold, method=method, all_golds=all_golds)
            assert all(0.0 <= out[key] <= 1.0 for key in lenient.METRIC_KEYS)
    assert 0.0 <= ruler.string_match_all_single(solution, gold) <= 1.0
    assert 0.0 <= ruler.string_match_part_single(solution, gold) <= 1.0
    assert gsm8k.compute_score(solution, gold, format_score=0.5) in (0.0, 0.5, 1.0)
    assert gsm8k.compute_score(solution, gold, method="strict") in (0.0, 1.0)
    for source in rs.known_data_sources():
        assert 0.0 <= rs.default_compute_score(source, solution, gold) <= 1.0


@FAST
@given(solution=maybe_text, gold=gold_values)
def test_no_scorer_raises_on_arbitrary_output(solution, gold) -> None:
    _check_all_scorers(solution, gold)


@FAST
@given(text=maybe_text, gold=st.one_of(st.none(), any_text))
def test_no_helper_raises_on_arbitrary_text(text, gold) -> None:
    extracted = extract_boxed_answer(text)
    assert extracted is None or isinstance(extracted, str)
    assert isinstance(lenient.normalize_answer(text), str)
    answer = lenient.extract_answer(text)
    assert answer is None or isinstance(answer, str)
    f1, prec, recall = lenient.f1_score(text, gold)
    assert 0.0 <= f1 <= 1.0 and 0.0 <= prec <= 1.0 and 0.0 <= recall <= 1.0
    assert isinstance(lenient.sub_exact_match_score(text, gold), bool)
    if text is not None:
        assert isinstance(strip_string(text), str)
        assert lenient.extract_solution(text, force_think=False)[1] == text


_SAFE_ALPHABET = st.characters(
    blacklist_characters="{}\\$", blacklist_categories=("Cs",), min_codepoint=32, max_codepoint=0x2FF
)
balanced = st.recursive(
    st.text(_SAFE_ALPHABET, max_size=8),
    lambda inner: st.builds(lambda a, b, c: a + "{" + b + "}" + c, inner, inner, inner),
    max_leaves=6,
)


@FAST
@given(prefix=st.text(_SAFE_ALPHABET, max_size=200), content=balanced, suffix=st.text(_SAFE_ALPHABET, max_size=40))
def test_boxed_extraction_round_trips_balanced_content(prefix, content, suffix) -> None:
    assert extract_boxed_answer(prefix + "\\boxed{" + content + "}" + suffix) == content


@FAST
@given(noise=st.text(_SAFE_ALPHABET, max_size=2000), gold=st.text(_SAFE_ALPHABET, min_size=1, max_size=40))
def test_strict_accepts_its_own_boxed_gold(noise, gold) -> None:
    # The box sits inside the 300-character tail, so noise before it never matters.
    assert hotpotqa.compute_score(noise + " \\boxed{" + gold + "} ", [gold]) == 1.0


def test_megabytes_of_hostile_text_are_fast_and_safe() -> None:
    hostile = [  # about 1 MB each
        "\\boxed{" * 150_000,  # unclosed boxes
        "\\boxed{" + "{" * 1_000_000,  # one box, a million unmatched braces
        "\\boxed{" + "{}" * 500_000,  # a million brace pairs that never close the box
        "the answer is " + "x y " * 250_000,  # a 1 MB extracted answer
        "é Σ 12,345 \\fbox{a} $ " * 50_000,
        "\\boxed " + "z" * 1_000_000,
    ]
    start = time.perf_counter()
    for text in hostile:
        assert hotpotqa.compute_score(text, ["x y", "a"]) in (0.0, 1.0)
        for method in lenient.EVAL_METHODS:
            out = lenient.score_prediction(text, ["x y", "a"], method=method, all_golds=True)
            assert all(0.0 <= out[key] <= 1.0 for key in lenient.METRIC_KEYS)
        assert lenient.calc_metrics([text], ["x"])["total_num"] == 1
        assert ruler.string_match_all([text], [["z"]]) in (0.0, 100.0)
        assert gsm8k.compute_score(text, "1") in (0.0, 1.0)
        assert gsm8k.compute_score(text, "1", method="strict") in (0.0, 1.0)
        for source in ("hotpotqa", "ruler_niah_single_1", "gsm8k"):
            assert 0.0 <= rs.default_compute_score(source, text, ["a"]) <= 1.0
    assert time.perf_counter() - start < 20.0


@FAST
@given(prediction=maybe_text, gold=st.one_of(st.none(), any_text))
def test_batched_sample_metrics_match_the_public_scorers(prediction, gold) -> None:
    metrics = lenient.new_metrics()
    sample = lenient.update_answer(metrics, prediction, gold)
    assert sample["em"] == float(lenient.exact_match_score(prediction, gold))
    assert sample["sub_em"] == float(lenient.sub_exact_match_score(prediction, gold))
    assert (sample["f1"], sample["prec"], sample["recall"]) == lenient.f1_score(prediction, gold)
