"""The rock-token lab on crafted token tables (known answers) and end to end on tiny models through the CLI."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from hf_rockopd import RockOPDConfig, RockOPDTrainer  # noqa: F401 - the rock set must load into the policy below
from hf_rockopd.cli import main
from hf_rockopd.lab import (
    benjamini_hochberg,
    collect_token_table,
    compare_token_tables,
    gradient_geometry,
    load_prompts,
    load_token_table,
    matched_controls,
    paired_bootstrap,
    rare_high_divergence_ids,
    score_token_table,
    stability_sweep,
)
from hf_rockopd.policies import get_policy
from hf_rockopd.policies.rock_set import load_rock_set


def crafted_frame(spec, vocab_decode=None):
    """`spec`: {token_id: (count, divergence)}: each id occurs `count` times with that divergence, spread over prompts."""
    rows = []
    for token_id, (count, divergence) in spec.items():
        for j in range(count):
            rows.append(
                {
                    "prompt_index": j % 10,
                    "position": j,
                    "token_id": token_id,
                    "token": (vocab_decode or str)(token_id),
                    "divergence": divergence,
                    "logit_grad_norm": divergence / 10,
                }
            )
    return pd.DataFrame(rows)


# id: (count, divergence). R = count · divergence:
#   0: 1000·0.01 = 10 (most frequent)   1: 500·0.02 = 10 (2nd most frequent)
#   10: 100·0.5 = 50   11: 80·0.5 = 40   12: 60·0.5 = 30   13: 20·1.0 = 20   14: 4·3.0 = 12   15: 1·100 = 100 (rare)
SPEC = {0: (1000, 0.01), 1: (500, 0.02), 10: (100, 0.5), 11: (80, 0.5), 12: (60, 0.5), 13: (20, 1.0), 14: (4, 3.0),
        15: (1, 100.0)}


def test_rock_score_ranking_and_exclusions():
    table = load_token_table(crafted_frame(SPEC), vocab_size=32)
    result = score_token_table(table, top_k=3, min_count=2, exclude_top_frequent=2)
    # 15 has the highest R but is seen once; 0 and 1 are the two most frequent ids.
    assert result.rock_ids == [10, 11, 12]
    total_tokens = sum(c for c, _ in SPEC.values())
    assert result.rock_token_share == pytest.approx(240 / total_tokens)
    total_mass = sum(c * d for c, d in SPEC.values())
    assert result.divergence_coverage == pytest.approx(120 / total_mass)
    row = result.scores.set_index("token_id").loc[15]
    assert row["rock_score"] == pytest.approx(100.0) and not row["eligible"] and not row["is_rock"]
    assert result.settings["eligible_types"] == 5 and result.settings["observed_types"] == 8


def test_coverage_picks_the_smallest_k_reaching_the_share():
    table = load_token_table(crafted_frame(SPEC), vocab_size=32)
    total_mass = sum(c * d for c, d in SPEC.values())  # 272
    # 50 + 40 = 90 < 0.4 · 272 = 108.8 <= 50 + 40 + 30 = 120 -> K = 3
    result = score_token_table(table, top_k=None, coverage=0.4, min_count=2, exclude_top_frequent=2)
    assert result.rock_ids == [10, 11, 12]
    assert result.divergence_coverage == pytest.approx(120 / total_mass)
    with pytest.raises(ValueError, match="below coverage=0.99"):
        score_token_table(table, top_k=None, coverage=0.99, min_count=2, exclude_top_frequent=2)


def test_rock_set_file_loads_into_the_freeze_policy(tmp_path):
    table = load_token_table(crafted_frame(SPEC), vocab_size=32)
    result = score_token_table(table, top_k=2, exclude_top_frequent=2)
    path = tmp_path / "rock_set.json"
    result.save(path)
    payload = load_rock_set(path, vocab_size=32)
    assert payload["token_ids"] == [10, 11]
    assert payload["selection"]["top_k"] == 2 and payload["vocab_size"] == 32
    assert payload["tokens"][0]["rock_score"] == pytest.approx(50.0)
    policy = get_policy("rock_freeze", token_ids=str(path))
    policy.setup(32)
    assert policy.rock_ids() == [10, 11]


def test_bad_tables_and_selections_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        load_token_table(crafted_frame({}).reindex(columns=["prompt_index", "token_id", "token", "divergence"]))
    with pytest.raises(ValueError, match="lacks columns \\['divergence'\\]"):
        load_token_table(pd.DataFrame({"prompt_index": [0], "token_id": [1], "token": ["a"]}))
    with pytest.raises(ValueError, match="outside the vocabulary of 8 ids"):
        load_token_table(crafted_frame(SPEC), vocab_size=8)
    with pytest.raises(ValueError, match="no Parquet part"):
        load_token_table(tmp_path)
    table = load_token_table(crafted_frame(SPEC), vocab_size=32)
    with pytest.raises(ValueError, match="top_k=6 exceeds the 5 eligible types"):
        score_token_table(table, top_k=6, exclude_top_frequent=2)
    with pytest.raises(ValueError, match="exactly one of top_k and coverage"):
        score_token_table(table, top_k=3, coverage=0.5)


def test_stability_sweep_jaccard_on_a_known_corpus():
    # Ten prompts, each holding the same 20 types with R decreasing by id: every sub-corpus ranks them identically,
    # so Jaccard is exactly 1 for every K and size.
    rows = [
        {"prompt_index": p, "token_id": t, "token": str(t), "divergence": 1.0 / (t + 1)}
        for p in range(10)
        for t in range(20)
        for _ in range(3)
    ]
    table = load_token_table(pd.DataFrame(rows), vocab_size=20)
    frame, k = stability_sweep(table, ks=(2, 5, 10), subcorpus_sizes=(2, 5), repeats=3, exclude_top_frequent=0)
    assert (frame["jaccard_mean"] == 1.0).all() and len(frame) == 6 and k == 10

    # Now types 0-3 occur only in prompt 0: a one-prompt sub-corpus without prompt 0 has 4 of the full top-4 missing.
    rows = [r for r in rows if r["token_id"] >= 4 or r["prompt_index"] == 0]
    for r in rows:
        if r["token_id"] < 4:
            r["divergence"] = 50.0  # heavy: they top the full corpus
    table = load_token_table(pd.DataFrame(rows), vocab_size=20)
    frame, k = stability_sweep(table, ks=(4,), subcorpus_sizes=(1,), repeats=20, exclude_top_frequent=0, seed=0)
    # Jaccard is 1 for the draws holding prompt 0 and 0 for the others, so the mean is the share of draws with prompt 0.
    value = frame["jaccard_mean"].item()
    assert set(np.round([frame["jaccard_min"].item(), frame["jaccard_max"].item()], 6)) <= {0.0, 1.0}
    assert 0.0 <= value < 0.7 and k is None


def test_matched_controls_match_the_rock_frequency_histogram():
    rng = np.random.default_rng(0)
    counts = {i: int(c) for i, c in enumerate(np.unique(rng.integers(2, 5000, size=400)))}
    spec = {i: (c, 0.1) for i, c in counts.items()}
    table = load_token_table(
        pd.DataFrame(
            {
                "prompt_index": 0,
                "token_id": np.repeat(list(spec), [c for c, _ in spec.values()]),
                "token": "x",
                "divergence": 0.1,
            }
        ),
        vocab_size=1000,
    )
    # Skewed towards frequent ids (as rocks are), with at most 7 per bin of ~40 ids, so no bin runs out of candidates.
    by_count = sorted(counts, key=counts.get)
    rocks = by_count[::40][:4] + by_count[200::6][:26]
    controls = matched_controls(table, rocks, num_bins=10, seed=1)
    assert len(controls) == 30 and not set(controls) & set(rocks)
    observed = np.array([c for c in counts.values()], dtype=float)
    edges = np.quantile(np.log(observed), np.linspace(0, 1, 11)[1:-1])
    bins = lambda ids: np.bincount(np.searchsorted(edges, np.log([counts[i] for i in ids]), side="right"), minlength=10)
    assert bins(controls).tolist() == bins(rocks).tolist()
    assert np.median([counts[i] for i in controls]) > np.median(observed)
    # The paper's control, uniform over the vocabulary, would mostly pick never-seen ids (600 of 1000 here).
    assert all(counts.get(i, 0) > 0 for i in controls)


def test_compare_finds_stagnant_rocks_and_falling_rare_types():
    rng = np.random.default_rng(0)
    early_spec, late_spec = {}, {}
    for i in range(20, 40):  # rocks: frequent, divergence flat
        d = 0.2 + 0.01 * rng.standard_normal()
        early_spec[i], late_spec[i] = (50, d), (50, d + 0.001 * rng.standard_normal())
    for i in range(40, 60):  # rare, high divergence, falls
        early_spec[i], late_spec[i] = (3, 2.0 + 0.1 * rng.standard_normal()), (3, 0.8 + 0.1 * rng.standard_normal())
    for i in range(60, 140):  # filler types of many frequencies
        c = int(rng.integers(2, 60))
        early_spec[i], late_spec[i] = (c, 0.05), (c, 0.05)
    early = load_token_table(crafted_frame(early_spec), vocab_size=200)
    late = load_token_table(crafted_frame(late_spec), vocab_size=200)
    frame = compare_token_tables(early, late, list(range(20, 40))).set_index("group")
    assert rare_high_divergence_ids(early, 20, exclude_ids=range(20, 40)) == sorted(
        range(40, 60), key=lambda i: (-early_spec[i][1], i)
    )
    assert frame.loc["rock", "types"] == 20 and frame.loc["rock", "p_value"] > 0.01
    assert frame.loc["rare_high_divergence", "median_shift"] == pytest.approx(-1.2, abs=0.1)
    assert frame.loc["rare_high_divergence", "p_value"] < 1e-4
    assert frame.loc["random_matched", "types"] == 20


def test_compare_refuses_tables_from_other_tokenizers():
    a = load_token_table(crafted_frame(SPEC), vocab_size=32)
    b = load_token_table(crafted_frame(SPEC, vocab_decode=lambda i: f"<{i}>"), vocab_size=32)
    with pytest.raises(ValueError, match="decode 8 common ids differently"):
        compare_token_tables(a, b, [10, 11])
    c = load_token_table(crafted_frame(SPEC), vocab_size=64)
    with pytest.raises(ValueError, match="different tokenizers"):
        compare_token_tables(a, c, [10, 11])


def test_gradient_geometry_groups_and_test():
    spec = {i: (40, 0.1) for i in range(10, 20)} | {i: (3, 5.0) for i in range(20, 30)}
    spec |= {i: (int(c), 0.3) for i, c in zip(range(30, 90), np.linspace(2, 45, 60))}
    frame = gradient_geometry(load_token_table(crafted_frame(spec), vocab_size=100), list(range(10, 20)))
    frame = frame.set_index("group")
    assert frame.loc["rock", "occurrences"] == 400
    assert frame.loc["rock", "median_grad_norm"] == pytest.approx(0.01)
    assert frame.loc["rare_high_divergence", "median_grad_norm"] == pytest.approx(0.5)
    assert frame.loc["rare_high_divergence", "p_value_vs_rock"] < 1e-6


def test_benjamini_hochberg_on_known_p_values():
    # Hand computation: sorted p = .01 .02 .03 .04 .20, m = 5: p·m/rank = .05 .05 .05 .05 .20, then running minimum
    # from the top.
    q = benjamini_hochberg([0.04, 0.01, 0.20, 0.03, 0.02])
    np.testing.assert_allclose(q, [0.05, 0.05, 0.20, 0.05, 0.05])
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        benjamini_hochberg([0.5, 1.5])


def test_paired_bootstrap_against_a_hand_computation():
    # Two problems, differences (1, 0): resampled means are 1, 0.5, 0 with probabilities 1/4, 1/2, 1/4, so
    # P(mean <= 0) = 1/4, P(mean >= 0) = 1 and the two-sided p-value is 2 · 1/4 = 0.5.
    result = paired_bootstrap([0, 1], [1, 1], n_resamples=20_000, seed=0)
    assert result["delta"] == 0.5
    assert result["p_value"] == pytest.approx(0.5, abs=0.02)
    assert (result["ci_low"], result["ci_high"]) == (0.0, 1.0)
    # A ban that breaks 30 of 100 problems is significant; one that breaks nothing is not.
    base = np.ones(100)
    banned = base.copy()
    banned[:30] = 0
    assert paired_bootstrap(base, banned, seed=0)["p_value"] < 1e-3
    assert paired_bootstrap(base, base, seed=0)["p_value"] == 1.0
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap([1, 0], [1])


def test_load_prompts_fields_and_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"question": "Q1", "answer": "1"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A"}]})
        + "\n"
    )
    assert load_prompts(path) == [[{"role": "user", "content": "Q1"}], [{"role": "user", "content": "Q2"}]]
    assert load_prompts(path, limit=1) == [[{"role": "user", "content": "Q1"}]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "Q1"}) + "\n" + json.dumps({"text": "no prompt"}) + "\n")
    with pytest.raises(ValueError, match="line 2: no prompt field.*got \\['text'\\]"):
        load_prompts(bad)


def test_gsm8k_prompts_load_from_shared_data():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"
    if not path.exists():
        pytest.skip(f"{path} is not on this machine")
    prompts = load_prompts(path, limit=5)
    assert len(prompts) == 5 and prompts[0][0]["content"].startswith("Natalia sold clips")


def test_collect_score_end_to_end_through_the_cli(tmp_path, tokenizer, student, teacher, capsys):
    student.save_pretrained(tmp_path / "student")
    teacher.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "student")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"What is {i} + {i}?"}) + "\n" for i in range(6)))
    table_dir = tmp_path / "table"
    args = ["analyze", "collect", "--student", str(tmp_path / "student"), "--teacher", str(tmp_path / "teacher"),
            "--prompts", str(prompts), "--out", str(table_dir), "--max_new_tokens", "8", "--batch_size", "4"]
    assert main(args) == 0
    table = load_token_table(table_dir)
    assert sorted(p.name for p in table_dir.glob("*.parquet")) == [
        "grad_cosine.parquet", "part-00000.parquet", "part-00001.parquet"]
    assert table.vocab_size == 259 and set(table.frame["prompt_index"]) == set(range(6))
    assert (table.frame["divergence"] >= 0).all() and (table.frame["student_entropy"] > 0).all()

    # Each row's divergence is the reverse KL of the distribution that produced that token, recomputed here.
    row = table.frame.iloc[3]
    messages = [{"role": "user", "content": f"What is {row.prompt_index} + {row.prompt_index}?"}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    completion = table.frame[table.frame.prompt_index == row.prompt_index].sort_values("position")["token_id"]
    ids = torch.tensor([list(prompt_ids) + completion.tolist()[: row.position]])
    with torch.no_grad():
        s, t = student(ids).logits[0, -1], teacher(ids).logits[0, -1]
    expected = torch.sum(s.log_softmax(-1).exp() * (s.log_softmax(-1) - t.log_softmax(-1)))
    assert row.divergence == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
    assert int(torch.argmax(s)) == row.token_id  # greedy

    # Resume: a finished part is not recomputed; a missing one is.
    first = (table_dir / "part-00000.parquet").stat().st_mtime_ns
    (table_dir / "part-00001.parquet").unlink()
    assert main(args) == 0
    assert (table_dir / "part-00000.parquet").stat().st_mtime_ns == first
    assert load_token_table(table_dir).frame.equals(table.frame)
    # Other settings into the same directory would mix two corpora.
    assert main(args[:-4] + ["--max_new_tokens", "9", "--batch_size", "4"]) == 2
    assert "collected with other settings" in capsys.readouterr().err

    rock_set = tmp_path / "rock_set.json"
    assert main(["analyze", "score", str(table_dir), "--top_k", "3", "--exclude_top_frequent", "1",
                 "--out", str(rock_set)]) == 0
    out = capsys.readouterr().out
    assert "rock tokens: 3 types" in out and "generated tokens" in out
    assert len(load_rock_set(rock_set, vocab_size=259)["token_ids"]) == 3
    assert main(["analyze", "score", str(table_dir), "--top_k", "100000", "--out", str(rock_set)]) == 2
    assert "exceeds the" in capsys.readouterr().err
    assert main(["analyze", "gradients", str(table_dir), "--rock_set", str(rock_set)]) == 0
    out = capsys.readouterr().out
    assert "rock" in out and "random_matched" in out
    controls = tmp_path / "controls.json"
    assert main(["analyze", "controls", str(table_dir), "--rock_set", str(rock_set), "--out", str(controls)]) == 0
    control_ids = load_rock_set(controls, vocab_size=259)["token_ids"]
    assert len(control_ids) == 3 and not set(control_ids) & set(load_rock_set(rock_set)["token_ids"])
    # Compare a table with itself: nothing moves, so no test is run and every shift is 0.
    assert main(["analyze", "compare", str(table_dir), str(table_dir), "--rock_set", str(rock_set)]) == 0
    assert "median_shift" in capsys.readouterr().out
    assert main(["analyze", "stability", str(table_dir), "--ks", "2", "3", "--sizes", "2", "--repeats", "2",
                 "--exclude_top_frequent", "1"]) == 0
    assert "recommended K" in capsys.readouterr().out
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({"question": f"{i} + {i}?", "answer": f"#### {2 * i}"}) + "\n" for i in range(3)))
    verdicts = tmp_path / "knockout.csv"
    assert main(["analyze", "knockout", "--model", str(tmp_path / "student"), "--problems", str(problems),
                 "--rock_set", str(rock_set), "--top", "2", "--max_new_tokens", "4", "--resamples", "100",
                 "--out", str(verdicts)]) == 0
    assert "baseline accuracy 0.000 on 3 problems" in capsys.readouterr().out  # a random tiny model solves nothing
    assert len(pd.read_csv(verdicts)) == 2


def test_collect_refuses_an_empty_corpus_and_mismatched_vocabularies(tmp_path, tokenizer, student):
    from hf_rockopd.models import build_tiny_causal_lm

    with pytest.raises(ValueError, match="no prompt"):
        collect_token_table(student, student, tokenizer, [], tmp_path / "t")
    other = build_tiny_causal_lm(tokenizer, vocab_size=300)
    with pytest.raises(ValueError, match="student 259, teacher 300"):
        collect_token_table(student, other, tokenizer, ["hi"], tmp_path / "t")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        load_prompts(empty)


def test_verify_answer_and_load_problems(tmp_path):
    from hf_rockopd.lab import load_problems, verify_answer

    assert verify_answer("Natalia sold 48/2 = 24 clips.\n#### 72", "#### 72", "gsm8k")
    assert verify_answer("So the answer is 1,250.5 dollars.", "1250.5")
    assert verify_answer("The answer is -3 degrees", -3.0) and verify_answer("no number", "1") is None
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question": "Q", "answer": "1 + 1 = 2\n#### 2"}) + "\n" + json.dumps({"question": "Q"}))
    # The knockout reads problems with the evaluation's loader; a row without a reference is named by the command's
    # check, before any model loads.
    problems = load_problems(path)
    assert problems == [([{"role": "user", "content": "Q"}], "1 + 1 = 2\n#### 2"), ([{"role": "user", "content": "Q"}], None)]
    from hf_rockopd.commands.loading import check_references

    with pytest.raises(ValueError, match="Problem 1 of 'p.jsonl' has no reference answer"):
        check_references(problems, "math", "p.jsonl")


def test_knockout_bans_the_token_and_classifies(tokenizer, student, monkeypatch, tmp_path):
    from hf_rockopd.lab import token_knockout as analysis

    problems = [([{"role": "user", "content": f"What is {i} + {i}?"}], float(2 * i)) for i in range(4)]
    # The ban really removes the token: greedy generation with it suppressed never emits it.
    generated = []
    original = student.generate

    def spy(**kwargs):
        out = original(**kwargs)
        generated.append((kwargs.get("suppress_tokens"), out[:, kwargs["input_ids"].shape[1] :]))
        return out

    monkeypatch.setattr(student, "generate", spy)
    frame = analysis.knockout(student, tokenizer, problems, [65, 66], max_new_tokens=6, batch_size=4, n_resamples=200)
    assert generated[0][0] is None  # the baseline bans nothing
    most_common = int(torch.mode(generated[0][1].flatten()).values)
    frame2 = analysis.knockout(student, tokenizer, problems, [most_common], max_new_tokens=6, batch_size=4,
                               n_resamples=200)
    banned_out = generated[-1]
    assert banned_out[0] == [most_common] and not (banned_out[1] == most_common).any()
    assert list(frame.columns[:3]) == ["token_id", "token", "accuracy"] and len(frame) == 2
    assert set(frame["verdict"]) <= {"Pillar", "Neutral", "Stumbling"} and len(frame2) == 1
    with pytest.raises(ValueError, match="outside the model's vocabulary of 259 ids"):
        analysis.knockout(student, tokenizer, problems, [10_000])

    # Classification on crafted correctness: baseline all right; token A breaks 40 of 100 problems (Pillar), token B
    # fixes nothing and breaks nothing (Neutral).
    base = np.ones(100)
    broken = base.copy()
    broken[:40] = 0
    results = iter([base, broken, base])
    monkeypatch.setattr(analysis, "_solve", lambda *a, **k: next(results))
    frame = analysis.knockout(student, tokenizer, problems, [65, 66], n_resamples=2000)
    assert frame["verdict"].tolist() == ["Pillar", "Neutral"]
    assert frame.loc[0, "delta"] == pytest.approx(-0.4) and frame.attrs["baseline_accuracy"] == 1.0
    np.testing.assert_allclose(frame["q_value"], benjamini_hochberg(frame["p_value"]))


def test_gradient_cosines_are_exact_against_per_sequence_autograd(tmp_path, tokenizer, student, teacher):
    from hf_rockopd.lab import GRAD_COSINE_FILE, gradient_cosines
    from hf_rockopd.losses import per_token_divergence

    prompts = [f"What is {i} + {i}?" for i in range(5)] + ["Hi"]
    table_dir = tmp_path / "table"
    collect_token_table(student, teacher, tokenizer, prompts, table_dir, max_new_tokens=10, batch_size=4,
                        show_progress=False)
    table = load_token_table(table_dir)
    # Reference: each token's logit gradient from its own unpadded sequence, by autograd, in float64 sums.
    grads = []
    for row in table.frame.itertuples():
        messages = [{"role": "user", "content": prompts[row.prompt_index]}]
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        completion = table.frame[table.frame.prompt_index == row.prompt_index].sort_values("position")["token_id"]
        ids = torch.tensor([list(prompt_ids) + completion.tolist()[: row.position]])
        with torch.no_grad():
            s, t = student(ids).logits[0, -1:], teacher(ids).logits[0, -1:]
        s.requires_grad_(True)
        per_token_divergence(s, t, beta=1.0).sum().backward()
        grads.append(s.grad[0].double())
    ids = table.frame["token_id"].to_numpy()
    g_balanced = sum(torch.stack([grads[i] for i in np.flatnonzero(ids == v)]).mean(0) for v in np.unique(ids))
    expected = torch.stack([torch.nn.functional.cosine_similarity(g, g_balanced, dim=0) for g in grads]).numpy()
    np.testing.assert_allclose(table.frame["grad_cosine"].to_numpy(), expected, atol=1e-5)
    assert table.meta["g_balanced_norm"] == pytest.approx(float(g_balanced.norm()), rel=1e-5)
    frame = gradient_geometry(table, score_token_table(table, top_k=3, exclude_top_frequent=1).rock_ids)
    assert list(frame.columns) == ["group", "occurrences", "median_grad_norm", "p_value_vs_rock", "median_cosine",
                                   "p_value_cosine_vs_rock"]
    rock = np.isin(ids, score_token_table(table, top_k=3, exclude_top_frequent=1).rock_ids)
    assert frame.loc[0, "median_cosine"] == pytest.approx(float(np.median(expected[rock])), abs=1e-5)

    # A new part makes G_balanced (a corpus-wide sum) stale: the cosines are dropped and recomputed.
    (table_dir / "part-00001.parquet").unlink()
    collect_token_table(student, teacher, tokenizer, prompts, table_dir, max_new_tokens=10, batch_size=4,
                        show_progress=False, gradient_cosine=False)
    assert not (table_dir / GRAD_COSINE_FILE).exists() and "grad_cosine" not in load_token_table(table_dir).frame
    gradient_cosines(student, teacher, tokenizer, prompts, table_dir, show_progress=False)
    np.testing.assert_allclose(load_token_table(table_dir).frame["grad_cosine"].to_numpy(), expected, atol=1e-5)
    # Other models than those the table was collected with give other divergences: refused.
    with pytest.raises(ValueError, match="collected with other models or prompts"):
        gradient_cosines(teacher, student, tokenizer, prompts, table_dir, show_progress=False)
    with pytest.raises(ValueError, match="collected from 6 prompts, got 2"):
        gradient_cosines(student, teacher, tokenizer, prompts[:2], table_dir, show_progress=False)


def test_rebuilt_batches_project_only_completion_positions(tmp_path, tokenizer, student, teacher):
    # The analysis forwards keep the logits of the positions that produced a completion token, never the prompt's:
    # the head sees at most max_new_tokens + 1 positions per row, whatever the prompt length.
    from hf_rockopd.lab import gradient_cosines

    prompts = [f"Please compute what {i} plus {i} times two is, step by step." for i in range(3)]
    table_dir = tmp_path / "table"
    collect_token_table(student, teacher, tokenizer, prompts, table_dir, max_new_tokens=6, batch_size=3,
                        show_progress=False, gradient_cosine=False)
    messages = [{"role": "user", "content": prompts[0]}]
    prompt_len = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    assert prompt_len > 7
    widths = []
    hooks = [m.get_output_embeddings().register_forward_hook(lambda _m, args, _o: widths.append(args[0].shape[1]))
             for m in (student, teacher)]
    try:
        gradient_cosines(student, teacher, tokenizer, prompts, table_dir, show_progress=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert widths and max(widths) <= 7
    assert "grad_cosine" in load_token_table(table_dir).frame
