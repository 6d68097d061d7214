"""Tests of `hf_rockopd.policies.rock_set`: Rock Scores, the selection rule, frequency-matched controls and the file format."""

import json
import math

import numpy as np
import pytest
import torch

from hf_rockopd.policies.rock_set import (
    ROCK_SET_FORMAT,
    frequency_matched_ids,
    load_rock_set,
    rock_scores,
    save_rock_set,
    select_rock_tokens,
    validate_token_ids,
)


# ---------------------------------------------------------------------------------------------------------------
# rock_scores
# ---------------------------------------------------------------------------------------------------------------
def test_rock_scores_is_count_times_mean_divergence():
    count = torch.tensor([2.0, 10.0, 0.0, 3.0])
    mean = torch.tensor([1.5, 0.25, 7.0, 4.0])
    scores = rock_scores(count, mean)
    assert scores.dtype == torch.float64
    assert scores.tolist() == [3.0, 2.5, 0.0, 12.0]


def test_rock_scores_nan_mean_gives_zero_and_accepts_integer_counts():
    count = torch.tensor([4, 5, 6])  # int64
    mean = torch.tensor([math.nan, 2.0, math.nan])
    assert rock_scores(count, mean).tolist() == [0.0, 10.0, 0.0]


# ---------------------------------------------------------------------------------------------------------------
# select_rock_tokens
# ---------------------------------------------------------------------------------------------------------------
def test_select_orders_by_score_and_returns_all_scores():
    count = torch.tensor([10.0, 10.0, 10.0, 10.0])
    mean = torch.tensor([0.1, 0.4, 0.3, 0.2])
    ids, scores = select_rock_tokens(count, mean, top_k=4, min_count=1, exclude_top_frequent=0)
    assert ids == [1, 2, 3, 0]
    assert torch.allclose(scores, torch.tensor([1.0, 4.0, 3.0, 2.0], dtype=torch.float64))


def test_select_docstring_example():
    count = torch.tensor([100.0, 50.0, 10.0, 1.0])
    div = torch.tensor([1.0, 0.1, 2.0, 9.0])
    ids, scores = select_rock_tokens(count, div, top_k=2, min_count=2, exclude_top_frequent=1)
    # id 0 is the most frequent (excluded), id 3 seen once (< min_count): 2 (score 20) then 1 (score 5).
    assert ids == [2, 1]
    assert scores.tolist() == pytest.approx([100.0, 5.0, 20.0, 9.0])


def test_select_min_count_excludes_rare_ids():
    count = torch.tensor([1.0, 2.0, 3.0, 50.0])
    mean = torch.tensor([1000.0, 1.0, 1.0, 0.01])
    ids, _ = select_rock_tokens(count, mean, top_k=10, min_count=2, exclude_top_frequent=0)
    # scores: id1 = 2, id2 = 3, id3 = 0.5; id0 (score 1000) seen once is dropped.
    assert ids == [2, 1, 3]
    ids, _ = select_rock_tokens(count, mean, top_k=10, min_count=3, exclude_top_frequent=0)
    assert ids == [2, 3]
    ids, _ = select_rock_tokens(count, mean, top_k=10, min_count=1, exclude_top_frequent=0)
    assert ids == [0, 2, 1, 3]


def test_select_exclude_top_frequent_drops_the_most_frequent_even_if_best():
    count = torch.tensor([1000.0, 900.0, 10.0, 20.0, 30.0])
    mean = torch.tensor([5.0, 5.0, 1.0, 1.0, 1.0])
    ids, _ = select_rock_tokens(count, mean, top_k=10, min_count=1, exclude_top_frequent=0)
    assert ids[:2] == [0, 1]
    ids, _ = select_rock_tokens(count, mean, top_k=10, min_count=1, exclude_top_frequent=1)
    assert ids == [1, 4, 3, 2]
    ids, _ = select_rock_tokens(count, mean, top_k=10, min_count=1, exclude_top_frequent=2)
    assert ids == [4, 3, 2]


def test_select_exclude_top_frequent_ties_broken_by_id():
    # Ids 1, 2 and 3 tie for most frequent: excluding 2 drops the two lowest ids of the tie (1 and 2).
    count = torch.tensor([5.0, 9.0, 9.0, 9.0, 4.0])
    mean = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    ids, _ = select_rock_tokens(count, mean, top_k=10, min_count=1, exclude_top_frequent=2)
    assert ids == [3, 0, 4]


def test_select_exclusion_larger_than_observed_leaves_nothing():
    count = torch.tensor([3.0, 4.0, 0.0, 0.0])
    mean = torch.tensor([1.0, 1.0, math.nan, math.nan])
    ids, scores = select_rock_tokens(count, mean, top_k=5, min_count=1, exclude_top_frequent=10)
    assert ids == []
    assert scores.tolist() == [3.0, 4.0, 0.0, 0.0]


def test_select_top_k_limits_the_set():
    count = torch.full((6,), 10.0)
    mean = torch.tensor([0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    for k in range(1, 7):
        ids, _ = select_rock_tokens(count, mean, top_k=k, min_count=1, exclude_top_frequent=0)
        assert ids == list(range(k))
    ids, _ = select_rock_tokens(count, mean, top_k=100, min_count=1, exclude_top_frequent=0)
    assert ids == list(range(6))


def test_select_score_ties_are_deterministic_lowest_id_first():
    count = torch.tensor([2.0, 4.0, 1.0, 8.0, 4.0])
    mean = torch.tensor([2.0, 1.0, 4.0, 0.5, 1.0])  # every score is 4
    ids, _ = select_rock_tokens(count, mean, top_k=3, min_count=1, exclude_top_frequent=0)
    assert ids == [0, 1, 2]
    assert select_rock_tokens(count, mean, top_k=3, min_count=1, exclude_top_frequent=0)[0] == ids


def test_select_skips_unmeasured_and_zero_score_ids():
    count = torch.tensor([10.0, 10.0, 10.0, 10.0])
    mean = torch.tensor([math.nan, 0.0, -1.0, 0.5])
    ids, _ = select_rock_tokens(count, mean, top_k=4, min_count=1, exclude_top_frequent=0)
    assert ids == [3]


def test_select_nothing_eligible_returns_empty():
    ids, scores = select_rock_tokens(torch.zeros(4), torch.full((4,), math.nan), top_k=3)
    assert ids == []
    assert scores.tolist() == [0.0] * 4


@pytest.mark.parametrize(
    "kwargs, field, value",
    [
        ({"top_k": 0}, "top_k", "0"),
        ({"top_k": -3}, "top_k", "-3"),
        ({"min_count": 0}, "min_count", "0"),
        ({"exclude_top_frequent": -1}, "exclude_top_frequent", "-1"),
    ],
)
def test_select_bad_arguments_raise(kwargs, field, value):
    with pytest.raises(ValueError, match=rf"{field}.*{value}"):
        select_rock_tokens(torch.ones(3), torch.ones(3), **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# frequency_matched_ids
# ---------------------------------------------------------------------------------------------------------------
def _bins(counts: np.ndarray, num_bins: int) -> np.ndarray:
    """The log-frequency quantile bins the function is documented to use (-1: never observed)."""
    bins = np.full(counts.shape[0], -1)
    obs = counts > 0
    log_c = np.log(counts[obs])
    edges = np.quantile(log_c, np.linspace(0, 1, num_bins + 1)[1:-1])
    bins[obs] = np.searchsorted(edges, log_c, side="right")
    return bins


def _skewed_counts(vocab: int = 1000, n_frequent: int = 100, seed: int = 0) -> torch.Tensor:
    """`n_frequent` ids with counts ~1000, the rest rare (1-5 occurrences)."""
    rng = np.random.default_rng(seed)
    counts = np.empty(vocab)
    counts[:n_frequent] = 1000 + rng.integers(0, 500, n_frequent)
    counts[n_frequent:] = rng.integers(1, 6, vocab - n_frequent)
    return torch.tensor(counts)


def test_matched_ids_for_frequent_rocks_are_frequent():
    counts = _skewed_counts()
    rocks = [3, 17, 42, 60, 88, 99]
    chosen = frequency_matched_ids(rocks, counts, num_bins=10, seed=0)
    assert len(chosen) == len(rocks)
    assert len(set(chosen)) == len(chosen)
    assert not set(chosen) & set(rocks)
    # Every control id is one of the frequent ones (< 100), though 90% of the vocabulary is rare.
    assert all(c < 100 for c in chosen), chosen
    assert float(counts[chosen].min()) >= 1000
    # ... whereas an unmatched uniform draw from the non-rock vocabulary lands mostly on rare ids.
    rng = np.random.default_rng(0)
    pool = np.setdiff1d(np.arange(1000), rocks)
    uniform = rng.choice(pool, size=len(rocks) * 20, replace=False)
    assert (uniform >= 100).mean() > 0.7


def test_matched_ids_fall_in_the_rocks_bins():
    rng = np.random.default_rng(1)
    counts = np.floor(np.exp(rng.uniform(0, 10, 2000))) + 1
    rocks = rng.choice(2000, size=40, replace=False).tolist()
    chosen = frequency_matched_ids(rocks, torch.tensor(counts), num_bins=10, seed=3)
    bins = _bins(counts, 10)
    # Each rock is replaced, in order, by an id of its own bin (plenty of candidates per bin here).
    assert [int(bins[c]) for c in chosen] == [int(bins[r]) for r in rocks]
    assert not set(chosen) & set(rocks)


def test_matched_ids_unobserved_rocks_matched_with_unobserved_ids():
    counts = torch.zeros(50, dtype=torch.float64)
    counts[:20] = torch.arange(1, 21, dtype=torch.float64) * 10
    rocks = [5, 30, 31]  # 30 and 31 never observed
    chosen = frequency_matched_ids(rocks, counts, num_bins=4, seed=0)
    assert counts[chosen[0]] > 0
    assert counts[chosen[1]] == 0 and counts[chosen[2]] == 0
    assert chosen[1] >= 20 and chosen[2] >= 20
    assert not set(chosen) & set(rocks)


def test_matched_ids_fall_back_to_nearest_bin_when_own_bin_is_exhausted():
    # Two bins: {0, 1, 2} frequent (bin 1) and {3, 4, 5} rare (bin 0). Rocks 0 and 1 leave only id 2 in bin 1.
    counts = torch.tensor([1000.0, 900.0, 800.0, 3.0, 2.0, 1.0])
    chosen = frequency_matched_ids([0, 1], counts, num_bins=2, seed=0)
    assert chosen[0] == 2
    assert chosen[1] in (3, 4, 5)


def test_matched_ids_never_return_rocks_or_excluded_ids():
    counts = torch.tensor([100.0, 100.0, 100.0, 100.0, 100.0, 100.0])
    for seed in range(20):
        chosen = frequency_matched_ids([0, 1], counts, num_bins=1, seed=seed, exclude_ids=[2, 3])
        assert sorted(chosen) == [4, 5]


def test_matched_ids_raise_when_not_enough_candidates():
    counts = torch.tensor([10.0, 20.0, 30.0])
    with pytest.raises(ValueError, match="frequency-matched control for 2 rock ids"):
        frequency_matched_ids([0, 1], counts, num_bins=1, seed=0, exclude_ids=[2])
    with pytest.raises(ValueError, match="Cannot draw"):
        frequency_matched_ids([0, 1, 2], counts, num_bins=2)
    # An unobserved rock cannot borrow an observed id.
    with pytest.raises(ValueError, match="Cannot draw"):
        frequency_matched_ids([3], torch.tensor([1.0, 2.0, 3.0, 0.0]), num_bins=2)


def test_matched_ids_num_bins_must_be_positive():
    with pytest.raises(ValueError, match="num_bins must be >= 1, got 0"):
        frequency_matched_ids([0], torch.ones(4), num_bins=0)


def test_matched_ids_deterministic_per_seed_and_vary_across_seeds():
    counts = _skewed_counts(seed=2)
    rocks = [1, 2, 3, 4, 5]
    a = frequency_matched_ids(rocks, counts, num_bins=10, seed=7)
    b = frequency_matched_ids(rocks, counts.clone(), num_bins=10, seed=7)
    assert a == b
    draws = {tuple(frequency_matched_ids(rocks, counts, num_bins=10, seed=s)) for s in range(6)}
    assert len(draws) > 1


def test_matched_ids_docstring_example():
    counts = torch.tensor([1000.0, 900.0, 5.0, 4.0, 3.0, 800.0])
    assert frequency_matched_ids([0], counts, num_bins=2, seed=0)[0] in (1, 5)


# ---------------------------------------------------------------------------------------------------------------
# load_rock_set / save_rock_set / validate_token_ids
# ---------------------------------------------------------------------------------------------------------------
def test_save_then_load_round_trip(tmp_path):
    path = tmp_path / "rock_set.json"
    tokens = [
        {"token_id": 7, "token": "So", "count": 12, "mean_divergence": 0.5},
        {"token_id": np.int64(3), "token": "\u00e9", "count": np.int32(4), "mean_divergence": np.float32(0.25)},
    ]
    save_rock_set(path, tokens, vocab_size=100, tokenizer_name="tiny", policy="rock_online", extra=torch.tensor([1]))
    assert not (tmp_path / "rock_set.json.tmp").exists()
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert raw["format"] == ROCK_SET_FORMAT
    assert raw["version"] == 1
    assert raw["token_ids"] == [7, 3]
    assert raw["vocab_size"] == 100
    assert raw["tokenizer"] == "tiny"
    assert raw["policy"] == "rock_online"
    assert raw["extra"] == [1]
    assert raw["tokens"][1] == {"token_id": 3, "token": "\u00e9", "count": 4, "mean_divergence": 0.25}
    data = load_rock_set(path, vocab_size=100)
    assert data["token_ids"] == [7, 3]
    assert data["tokens"][0]["token"] == "So"
    assert load_rock_set(str(path))["token_ids"] == [7, 3]


def test_save_overwrites_existing_file(tmp_path):
    path = tmp_path / "r.json"
    save_rock_set(path, [{"token_id": 1}], vocab_size=10)
    save_rock_set(path, [{"token_id": 2}, {"token_id": 4}], vocab_size=10)
    assert load_rock_set(path, vocab_size=10)["token_ids"] == [2, 4]


def test_save_rejects_nan(tmp_path):
    with pytest.raises(ValueError):
        save_rock_set(tmp_path / "r.json", [{"token_id": 1, "mean_divergence": math.nan}], vocab_size=10)


def test_load_list_form_file(tmp_path):
    path = tmp_path / "ids.json"
    path.write_text("[13, 198, 5]")
    assert load_rock_set(path, vocab_size=200)["token_ids"] == [13, 198, 5]
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 100\).*198"):
        load_rock_set(path, vocab_size=100)


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does_not_exist.json"):
        load_rock_set(tmp_path / "does_not_exist.json")


@pytest.mark.parametrize("text", ["{not json", "", '{"token_ids": [1, 2]'])
def test_load_malformed_json_names_file(tmp_path, text):
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"broken\.json.*not valid JSON"):
        load_rock_set(path)


@pytest.mark.parametrize("payload", [{"ids": [1]}, 5, "abc", None])
def test_load_without_token_ids_names_file(tmp_path, payload):
    path = tmp_path / "nokey.json"
    path.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=r"nokey\.json.*no 'token_ids'"):
        load_rock_set(path)


@pytest.mark.parametrize(
    "token_ids, pattern",
    [
        ([1, 2.5], "must be integers"),
        ([1, "2"], "must be integers"),
        ([True, 2], "must be integers"),
        ([None], "must be integers"),
        ([1, 2, 1], "duplicates"),
        ([1, 50], r"outside the vocabulary \[0, 10\)"),
        ([-1, 3], r"outside the vocabulary \[0, 10\).*-1"),
        ([], "empty token_ids"),
        ("1,2", "must be a list of integers"),
        ({"a": 1}, "must be a list of integers"),
    ],
)
def test_load_rejects_bad_ids_and_names_file(tmp_path, token_ids, pattern):
    path = tmp_path / "bad_ids.json"
    path.write_text(json.dumps({"token_ids": token_ids}))
    with pytest.raises(ValueError, match=pattern) as err:
        load_rock_set(path, vocab_size=10)
    assert "bad_ids.json" in str(err.value)


def test_load_vocab_mismatch_names_file_and_sizes(tmp_path):
    path = tmp_path / "other_vocab.json"
    save_rock_set(path, [{"token_id": 1}], vocab_size=49152, tokenizer_name="smol")
    with pytest.raises(ValueError, match=r"other_vocab\.json.*49152.*'smol'.*has 32000"):
        load_rock_set(path, vocab_size=32000)
    # Without a vocabulary to check against, or with the right one, it loads.
    assert load_rock_set(path)["token_ids"] == [1]
    assert load_rock_set(path, vocab_size=49152)["vocab_size"] == 49152


def test_validate_token_ids():
    assert validate_token_ids([3, np.int64(5), 0], 10, source="x") == [3, 5, 0]
    assert all(type(i) is int for i in validate_token_ids((np.int32(1), 2), None, source="x"))
    # No vocabulary: any integers (range checked later, at setup).
    assert validate_token_ids([10**6], None, source="x") == [10**6]
    with pytest.raises(ValueError, match="token_ids of my source contain duplicates"):
        validate_token_ids([4, 4], 10, source="my source")
    with pytest.raises(ValueError, match=r"my source has an empty token_ids list"):
        validate_token_ids([], 10, source="my source")
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 10\): \[10, 11\]"):
        validate_token_ids([9, 10, 11], 10, source="s")
    with pytest.raises(ValueError, match=r"found \[1\.0\]"):
        validate_token_ids([1.0], 10, source="s")
    with pytest.raises(ValueError, match="got str"):
        validate_token_ids("12", 10, source="s")
    with pytest.raises(ValueError, match="got Tensor"):
        validate_token_ids(torch.tensor([1, 2]), 10, source="s")
