"""`verify_answer` on real answer endings (GSM8K, MATH), cut completions, the old extractor's bugs, and the cases where
our own code steps in because math-verify alone fails them."""

from __future__ import annotations

import pytest

pytest.importorskip("math_verify")

from hf_rockopd.evaluation.answers import check_verifier, extract_answer, reference_answer, verify_answer  # noqa: E402

GSM8K_GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"

GSM8K_CASES = [
    # (completion, expected) against the gold 72
    ("She sold 48 + 24 = 72 clips.\n#### 72", True),
    ("She sold 48 + 24 = 72 clips in all, so \\boxed{72}.", True),
    ("Adding them, the answer is $72.", True),
    ("The answer is 72 dollars.", True),
    ("The final answer is 72.", True),
    ("Final answer: 1,072", False),
    ("The answer is 71.", False),
    ("**Answer:** 72", True),
]


@pytest.mark.parametrize("completion, expected", GSM8K_CASES)
@pytest.mark.parametrize("verifier", ["gsm8k", "math"])
def test_gsm8k_endings(completion, expected, verifier):
    assert verify_answer(completion, GSM8K_GOLD, verifier) is expected


MATH_CASES = [
    # (completion, reference, expected)
    ("So the probability is \\boxed{0.5}.", "\\frac{1}{2}", True),
    ("So the probability is \\boxed{\\frac{1}{2}}.", "0.5", True),
    ("Thus $\\boxed{\\sqrt{2}/2}$.", "\\frac{\\sqrt2}{2}", True),
    ("Thus $\\boxed{\\frac{\\sqrt{2}}{2}}$.", "\\frac{\\sqrt{2}}{3}", False),
    ("The solution set is \\boxed{(1, 3]}.", "(1,3]", True),
    ("The solution set is \\boxed{[1, 3]}.", "(1,3]", False),
    ("The point is \\boxed{(2, -5)}.", "(2,-5)", True),
    ("The point is \\boxed{(-5, 2)}.", "(2,-5)", False),
    ("The day is \\boxed{\\text{Monday}}.", "\\text{Monday}", True),
    ("The day is \\boxed{\\text{Tuesday}}.", "\\text{Monday}", False),
    ("The answer is \\(\\frac{3}{4}\\).", "\\frac34", True),
]


@pytest.mark.parametrize("completion, reference, expected", MATH_CASES)
def test_math_answers(completion, reference, expected):
    assert verify_answer(completion, reference, "math") is expected


def test_math_reference_may_be_a_worked_solution():
    solution = "The roots are 1 and 2, so their sum is $\\boxed{3}$."
    assert reference_answer(solution) == "3"
    assert verify_answer("The answer is 3.", solution) is True


@pytest.mark.parametrize(
    "completion",
    [
        "Natalia sold 48/2 = 24 clips in May. Then 48 + 24 =",  # cut mid-derivation
        "First, 50 - 15 = 35, and then 35 + 37 = 72",  # its last number equals the gold, but it never answered
        "",
    ],
)
def test_no_marker_is_no_prediction(completion):
    assert verify_answer(completion, GSM8K_GOLD, "gsm8k") is None
    assert extract_answer(completion) is None


def test_regression_subtraction_is_not_a_negative_number():
    """The old extractor read "50 - 15" as -15 through its last-number fallback."""
    assert extract_answer("The total is 50 - 15", last_number=True)[-1] == "15"
    assert verify_answer("The total is 50 - 15", "15", last_number=True) is True
    assert verify_answer("The total is 50 - 15", "-15", last_number=True) is False
    assert extract_answer("The answer is -4.")[-1] == "-4"


def test_regression_cut_answer_is_not_credited_by_its_last_number():
    """The old fallback credited a cut-off completion whose last number happened to equal the gold; now it needs the
    option, and the evaluation never applies it to a cut completion (test_evaluation covers that side)."""
    cut = "She sold 48 clips in April and 24 in May: 48 + 24 = 72, and then in June she sold 72"
    assert verify_answer(cut, GSM8K_GOLD, "gsm8k") is None
    assert verify_answer(cut, GSM8K_GOLD, "gsm8k", last_number=True) is True


# -- where our own code steps in: each case math-verify alone fails ---------------------------------------------------


def test_math_verify_alone_misses_the_gsm8k_marker():
    from math_verify import parse

    assert parse("She sold 72 clips.\n#### 72", extraction_config=_anchored()) == []
    assert verify_answer("She sold 72 clips.\n#### 72", "72") is True


def test_math_verify_alone_misreads_markdown_bold():
    from math_verify import parse

    assert parse("The answer is **42**.", extraction_config=_anchored())[-1] == "42**."
    assert verify_answer("The answer is **42**.", "42") is True


def test_math_verify_alone_reads_a_subtraction_as_the_last_number():
    from math_verify import ExprExtractionConfig, parse

    assert parse("The total is 50 - 15", extraction_config=[ExprExtractionConfig()])[-1] == "50 - 15"
    assert extract_answer("The total is 50 - 15", last_number=True)[-1] == "15"


def _anchored():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [
        LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False),
        ExprExtractionConfig(try_extract_without_anchor=False),
    ]


# -- references and bad input ------------------------------------------------------------------------------------------


def test_gsm8k_reference_needs_its_marker():
    assert reference_answer("#### 1,072", "gsm8k") == "1072"
    assert reference_answer(72.0, "gsm8k") == "72" and reference_answer("72", "gsm8k") == "72"
    with pytest.raises(ValueError, match="#### <number>"):
        reference_answer("The answer is 7", "gsm8k")


def test_verifier_none_scores_nothing():
    assert verify_answer("\\boxed{72}", "72", "none") is None


def test_bad_verifier_names_the_choices():
    with pytest.raises(ValueError, match="'exact'.*'math'"):
        check_verifier("exact")
    with pytest.raises(ValueError, match="verifier"):
        verify_answer("\\boxed{1}", "1", "exact")
    with pytest.raises(TypeError, match="string"):
        extract_answer(None)


def test_commands_check_the_verifier_before_loading():
    from hf_rockopd.commands.evaluate import EvalArguments
    from hf_rockopd.commands.lab import KnockoutArguments

    with pytest.raises(ValueError, match="verifier must be one of"):
        EvalArguments(model="m", problems="p.jsonl", verifier="exact")
    with pytest.raises(ValueError, match="knockout measures accuracy"):
        KnockoutArguments(model="m", problems="p.jsonl", rock_set="r.json", verifier="none")
