"""Text-quality measures: loops are flagged, ordinary GSM8K solutions are not, intervals match Wilson's formula."""

import json
import math
import os
import re

import numpy as np
import pytest
import torch

from hf_rockopd.evaluation.quality import (
    Proportion,
    TextQuality,
    accuracy_interval,
    completion_quality,
    distinct_n,
    find_loop,
    is_clipped,
    is_finished,
    loop_rate,
    repeated_ngram_fraction,
    split_text,
    strip_stop,
    text_quality,
)


GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k", "train.jsonl")

# The loops the distilled SmolLM2 student wrote, each as the student kept going.
COOKIES = "She bakes 20 cookies, 20 cookies, 20 cookies"
AMOUNT = "So she pays " + "50% of the amount, " * 17 + "and"
GALLONS = "The answer is " + "the number of gallons in the first gallon, which is " * 3 + "so"
SOLUTION = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May.\n#### 72"


def _gsm8k_solutions(limit=None):
    """Reference solutions without the calculator annotations ("<<48/2=24>>"), which no model writes."""
    with open(GSM8K) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return [re.sub(r"<<[^>]*>>", "", row["answer"]) for row in rows[:limit]]


# ------------------------------------------------------------------------------------------------ loops ----
def test_split_text_joins_back_and_splits_digits():
    for text in (COOKIES, AMOUNT, SOLUTION, "  two  spaces\n\nand $1,000,000."):
        assert "".join(split_text(text)) == text
    assert split_text("1000") == ["1", "0", "0", "0"]


@pytest.mark.parametrize("text", [COOKIES, AMOUNT, GALLONS], ids=["cookies", "amount", "gallons"])
def test_the_students_loops_are_flagged(text):
    loop = find_loop(split_text(text))
    assert loop is not None
    assert math.floor(loop.repeats + 0.5) >= 3
    assert loop.span >= 12


def test_the_longest_loop_is_reported_with_its_period():
    loop = find_loop(split_text(AMOUNT))
    span = "".join(split_text(AMOUNT)[loop.start : loop.start + loop.span])
    assert span.count("50% of the amount") >= 16
    assert loop.period == len(split_text("50% of the amount, "))


def test_loops_in_token_ids():
    ids = [101, 102] + [7, 8, 9, 10] * 5 + [2]
    loop = find_loop(ids)
    assert (loop.start, loop.period, loop.span, loop.repeats) == (2, 4, 20, 5.0)
    # Tensors and arrays, as generation returns them, give the same answers (a tensor's elements hash by identity).
    for as_array in (torch.tensor, np.array):
        assert find_loop(as_array(ids)) == loop
        assert repeated_ngram_fraction(as_array(ids)) == repeated_ngram_fraction(ids)
        assert distinct_n([as_array(ids)], 2) == distinct_n([ids], 2)
        assert completion_quality(as_array(ids), [2], 30) == completion_quality(ids, [2], 30)
    assert find_loop([7, 8, 9, 10] * 2) is None  # said twice is a restatement, not a loop


@pytest.mark.parametrize(
    "text",
    [
        SOLUTION,
        "He has $1,000,000 and spends $100,000.",  # digit runs are short and single-token periods need 12 tokens
        "The answer is the number of gallons in the first gallon, which is the number of gallons in the first gallon",
        "2L + 11 = 35\n2L + 11 = 35\n2L = 24\nL = 12",  # a restated equation line
        "20 + 20 = 40",
    ],
)
def test_ordinary_text_is_not_a_loop(text):
    assert find_loop(split_text(text)) is None


def test_thresholds_are_honoured_and_checked():
    tokens = [1, 2] * 4  # 8 tokens, 4 copies of a period-2 span
    assert find_loop(tokens) is None  # under the 12-token span
    assert find_loop(tokens, min_span=8).period == 2
    assert find_loop(tokens, min_span=8, max_period=1) is None
    assert find_loop([1, 2, 3, 1, 2, 3, 1, 2], min_span=8).repeats == pytest.approx(8 / 3, abs=1e-4)  # 2.67 copies: 3
    assert find_loop([1, 2, 3, 4, 1, 2, 3, 4, 1], min_span=8) is None  # 2.25 copies do not
    assert find_loop([]) is None
    for bad in ({"max_period": 0}, {"min_repeats": 1}, {"min_span": 0}):
        with pytest.raises(ValueError, match="find_loop needs"):
            find_loop([1, 2], **bad)


def _reference_loop(tokens, max_period, min_repeats, min_span):
    """The definition, written plainly: for each period, each maximal run of tokens[i] == tokens[i + p]."""
    best = None
    for p in range(1, min(max_period, len(tokens) // 2) + 1):
        i = 0
        while i < len(tokens) - p:
            j = i
            while j < len(tokens) - p and tokens[j] == tokens[j + p]:
                j += 1
            span = j - i + p
            is_loop = j > i and span >= min_span and math.floor(span / p + 0.5) >= min_repeats
            if is_loop and (best is None or span > best[2]):
                best = (i, p, span)
            i = max(j, i + 1)
    return best


def test_find_loop_matches_its_definition_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(500):
        tokens = rng.integers(0, rng.integers(1, 5), size=rng.integers(0, 60)).tolist()
        settings = {"max_period": int(rng.integers(1, 12)), "min_repeats": int(rng.integers(2, 5))}
        settings["min_span"] = int(rng.integers(1, 14))
        loop = find_loop(tokens, **settings)
        expected = _reference_loop(tokens, **settings)
        assert (None if loop is None else (loop.start, loop.period, loop.span)) == expected, (tokens, settings)


@pytest.mark.skipif(not os.path.isfile(GSM8K), reason="needs ../shared/data/gsm8k/train.jsonl")
def test_gsm8k_reference_solutions_are_not_loops():
    """The defaults' calibration (see `DEFAULT_MIN_SPAN`): at most 0.3 % of GSM8K's reference solutions are flagged,
    and those are written-out sums and products, which have the very shape of a short loop."""
    solutions = _gsm8k_solutions()
    flagged = []
    for text in solutions:
        tokens = split_text(text)
        loop = find_loop(tokens)
        if loop is not None:
            flagged.append("".join(tokens[loop.start : loop.start + loop.span]))
    assert len(solutions) > 1000
    assert len(flagged) / len(solutions) <= 0.003, flagged
    assert all(re.search(r"[+*×x/-]|plus|times", span) for span in flagged), flagged
    # …while a loop spliced into the same solutions is found in every one of them.
    assert loop_rate([split_text(t + " " + COOKIES + ", 20 cookies") for t in solutions[:200]]) == 1.0


@pytest.mark.skipif(not os.path.isfile(GSM8K), reason="needs ../shared/data/gsm8k/train.jsonl")
def test_gsm8k_solutions_repeat_few_4grams():
    values = [repeated_ngram_fraction(split_text(t)) for t in _gsm8k_solutions(500)]
    assert np.nanmean(values) < 0.1
    assert repeated_ngram_fraction(split_text(AMOUNT)) > 0.7


# ------------------------------------------------------------------------------------------- repetition ----
def test_repeated_ngram_fraction():
    assert repeated_ngram_fraction(list(range(10))) == 0.0
    assert repeated_ngram_fraction([1, 2, 3, 4] * 10) == pytest.approx(1 - 4 / 37)
    assert math.isnan(repeated_ngram_fraction([1, 2, 3]))  # no 4-gram: undefined, not "no repetition"
    assert repeated_ngram_fraction(["a", "b", "a", "b"], n=1) == 0.5
    with pytest.raises(ValueError, match="n must be >= 1"):
        repeated_ngram_fraction([1, 2], n=0)


def test_distinct_n_is_over_the_corpus():
    same = [[1, 2, 3, 4]] * 5
    assert distinct_n(same, 1) == pytest.approx(4 / 20)
    assert distinct_n(same, 2) == pytest.approx(3 / 15)
    assert distinct_n([[1, 2], [3, 4]], 2) == 1.0
    assert math.isnan(distinct_n([[1]], 2)) and math.isnan(distinct_n([], 1))


# --------------------------------------------------------------------------------------- finished/clipped ----
def test_finished_and_clipped():
    stop = [2, 3]
    assert strip_stop([5, 3, 2, 2], stop) == [5] and strip_stop([5, 6], stop) == [5, 6]
    assert is_finished([5, 6, 3, 0], stop, 4)
    assert not is_finished([5, 6, 7, 2], stop, 3)  # a stop id after the limit does not count
    assert is_clipped([5, 6, 7, 8], stop, 4) and not is_clipped([5, 6, 2, 2], stop, 4)
    assert not is_finished([5], stop, 4) and not is_clipped([5], stop, 4)  # cut short another way: neither
    completions = [[5, 2, 2, 2], [5, 6, 7, 8], [5, 6, 7, 3], [5]]
    quality = text_quality(completions, stop, 4)
    assert (quality.finished_rate, quality.clipped_rate) == (0.5, 0.25)
    with pytest.raises(ValueError, match="max_new_tokens"):
        is_finished([5], stop, 0)


# ------------------------------------------------------------------------------------------------ accuracy ----
def _wilson(successes, trials, z=1.959963984540054):
    """Wilson's score interval from its formula, independent of scipy."""
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return centre - half, centre + half


@pytest.mark.parametrize(
    "successes, trials, low, high",
    [
        (0, 16, 0.0, 0.1936),
        (3, 8, 0.1368, 0.6943),
        (50, 100, 0.4038, 0.5962),
        (16, 16, 0.8064, 1.0),
        (1, 32, 0.0055, 0.1575),
    ],
)
def test_accuracy_interval_is_wilson(successes, trials, low, high):
    result = accuracy_interval(successes, trials)
    assert result.estimate == successes / trials
    assert (result.low, result.high) == pytest.approx((low, high), abs=1e-4)
    assert (result.low, result.high) == pytest.approx(_wilson(successes, trials), abs=1e-9)


def test_accuracy_interval_inputs():
    flags = [True] * 3 + [False] * 5
    assert accuracy_interval(flags) == accuracy_interval(3, 8)
    assert accuracy_interval(3, 8, confidence=0.99).low < accuracy_interval(3, 8).low
    empty = accuracy_interval([])
    assert empty.trials == 0 and math.isnan(empty.estimate) and empty.format() == "n/a"
    assert json.dumps(empty.to_dict(), allow_nan=False)
    for args, message in [((4, 3), "0 <= correct <= trials"), ((3,), "needs `trials`"), ((-1, 3), "0 <= correct")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            accuracy_interval(*args)
    with pytest.raises(ValueError, match="confidence"):
        accuracy_interval(1, 2, confidence=1.0)
    assert isinstance(accuracy_interval(1, 2), Proportion)


# ----------------------------------------------------------------------------------------------- summary ----
def test_text_quality_tells_a_looping_student_from_a_finished_one():
    stop, limit = [2], 40
    finished = [[10 + i, 20 + i, 30 + i, 40 + i, 50 + i, 2, 2, 2] for i in range(4)]  # padded after the stop id
    looping = [[60, 61] + [70, 71, 72, 73] * 10 for _ in range(4)]  # 42 ids, cut at the limit
    good = text_quality(finished, stop, limit, correct=[True, True, False, True])
    bad = text_quality([c[:limit] for c in looping], stop, limit, correct=[False] * 4)
    assert (good.finished_rate, good.clipped_rate, good.loop_rate) == (1.0, 0.0, 0.0)
    assert good.repeated_ngram_fraction == 0.0 and good.mean_length == 5.0  # the stop id and padding are not text
    assert (bad.finished_rate, bad.clipped_rate, bad.loop_rate) == (0.0, 1.0, 1.0)
    assert bad.repeated_ngram_fraction > 0.8
    assert bad.distinct_1 < good.distinct_1 and bad.distinct_2 < good.distinct_2
    assert good.accuracy.successes == 3 and bad.accuracy.estimate == 0.0 and bad.accuracy.high > 0


def test_completion_quality_gives_the_per_problem_outcomes_text_quality_averages():
    completions = [[5, 6, 7, 8, 9, 2, 2], [4, 5, 6] * 6, [7, 8], [1, 2]]
    each = [completion_quality(c, [2], 18) for c in completions]
    assert each[0] == {"finished": 1.0, "clipped": 0.0, "loop": 0.0, "repeated_ngram_fraction": 0.0, "length": 5.0}
    assert completion_quality(completions[0], iter([2]), 18) == each[0]  # stop ids given once, as a generator
    assert each[1]["loop"] == 1.0 and each[1]["clipped"] == 1.0 and each[1]["length"] == 18.0
    assert math.isnan(each[2]["repeated_ngram_fraction"]) and each[2]["finished"] == 0.0 and each[2]["clipped"] == 0.0
    quality = text_quality(completions, [2], 18)
    for name, rate in [("finished", "finished_rate"), ("clipped", "clipped_rate"), ("loop", "loop_rate")]:
        assert getattr(quality, rate) == np.mean([e[name] for e in each])
    assert quality.repeated_ngram_fraction == pytest.approx(np.mean([e["repeated_ngram_fraction"] for e in each[:2]]))
    assert quality.mean_length == np.mean([e["length"] for e in each])


def test_text_quality_is_json_and_reads_back():
    quality = text_quality([[5, 6, 7, 8, 9, 2], [5, 6]], [2], 6, correct=[True, False])
    data = json.loads(json.dumps(quality.to_dict(), allow_nan=False))
    assert TextQuality.from_dict(data) == quality
    assert data["loop_settings"] == {"max_period": 40, "min_repeats": 3, "min_span": 12}
    no_accuracy = text_quality([[5, 6]], [2], 6)
    assert no_accuracy.accuracy is None and TextQuality.from_dict(no_accuracy.to_dict()).accuracy is None
    # Undefined measures (no 4-gram anywhere, no completion) are NaN in Python and None in JSON.
    empty = text_quality([], [2], 6)
    data = json.loads(json.dumps(empty.to_dict(), allow_nan=False))
    assert data["finished_rate"] is None and data["repeated_ngram_fraction"] is None
    assert math.isnan(TextQuality.from_dict(data).loop_rate)
    with pytest.raises(ValueError, match="lacks"):
        TextQuality.from_dict({"num_completions": 1})
    with pytest.raises(ValueError, match="correctness flags"):
        text_quality([[5]], [2], 6, correct=[True, False])


def test_a_repeating_decimal_is_not_a_loop():
    """The baseline report's false positive: Qwen writes digits one per token, so "3.846153846153846" is a 6-token
    period repeated; numbers are told apart from degenerate text, for texts and for ids."""
    from hf_rockopd.evaluation.loops import numeric_token_ids
    from hf_rockopd.models import build_tiny_tokenizer

    text = r"= \frac{50}{13} \approx 3.846153846153846" + "\n\\]\n\nTherefore, on average, each player gets"
    assert find_loop(split_text(text)) is None
    assert find_loop(split_text("So he has 20 cookies, 20 cookies, 20 cookies")).period == 5  # words still loop
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(list("3.846153846153846"))
    numeric = numeric_token_ids(tokenizer)
    assert set(ids) <= numeric and tokenizer.convert_tokens_to_ids("a") not in numeric
    assert find_loop(ids) is not None  # without knowing which ids are digits, it looks like a loop
    assert find_loop(ids, numeric=numeric) is None
    words = tokenizer.convert_tokens_to_ids(list("2a, 2a, 2a, 2a, 2a, "))
    assert find_loop(words, numeric=numeric) is not None  # a period with a letter in it is text
