"""hf_rockopd.evaluation: answer extraction, problem loading, the metrics on crafted completions, padding invariance,
the `hf-rockopd eval` command and its errors. Tiny offline models only."""

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from hf_rockopd import lab as analysis
from hf_rockopd.cli import main
from hf_rockopd.evaluation import EvalResult, evaluate_completions, evaluate_gsm8k, format_results_table
from hf_rockopd.evaluation.answers import reference_answer
from hf_rockopd.data.gsm8k import load_gsm8k_problems
from hf_rockopd.losses import per_token_divergence
from hf_rockopd.models import build_tiny_causal_lm
from hf_rockopd.evaluation.rollout import encode_prompts, score_completions


GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"


def test_analysis_uses_the_same_verifier():
    from hf_rockopd.evaluation import verify_answer

    assert analysis.verify_answer is verify_answer


@pytest.mark.skipif(not GSM8K.is_file(), reason="shared GSM8K data not present")
def test_every_gsm8k_gold_answer_parses_and_tail_is_held_out():
    lines = [json.loads(line) for line in GSM8K.read_text(encoding="utf-8").splitlines() if line.strip()]
    golds = [reference_answer(row["answer"], "gsm8k") for row in lines]
    assert len(golds) == len(lines) > 7000
    tail = load_gsm8k_problems(GSM8K, limit=4, tail=True)
    assert [reference_answer(gold, "gsm8k") for _, gold in tail] == golds[-4:]
    assert tail[-1][0] == [{"role": "user", "content": lines[-1]["question"]}]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_load_problems_from_jsonl_and_dataset(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"work\n#### {i * 10}"} for i in range(5)]
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    assert [g for _, g in load_gsm8k_problems(path)] == [r["answer"] for r in rows]
    assert [reference_answer(g, "gsm8k") for _, g in load_gsm8k_problems(path, limit=2)] == ["0", "10"]
    assert [m[0]["content"] for m, _ in load_gsm8k_problems(path, limit=2, tail=True)] == ["q3", "q4"]
    renamed = Dataset.from_list([{"problem": r["question"], "solution": r["answer"]} for r in rows])
    problems = load_gsm8k_problems(renamed, question_field="problem", answer_field="solution", limit=1)
    assert problems == [([{"role": "user", "content": "q0"}], "work\n#### 0")]


def test_load_problems_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"no column \['answer'\].*columns: \['question', 'solution'\]"):
        load_gsm8k_problems(Dataset.from_list([{"question": "q", "solution": "#### 1"}]))
    with pytest.raises(ValueError, match="holds no problem"):
        load_gsm8k_problems(Dataset.from_dict({"question": [], "answer": []}))
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "seven"}])
    with pytest.raises(ValueError, match="row 1: No gold answer"):
        load_gsm8k_problems(bad)
    with pytest.raises(FileNotFoundError, match="No problem file"):
        load_gsm8k_problems(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="limit must be >= 1"):
        load_gsm8k_problems(bad, limit=0)


PROBLEMS = [
    ([{"role": "user", "content": "What is 2 + 2?"}], 4.0),
    ([{"role": "user", "content": "A much longer question: what is 3 + 4, in apples?"}], 7.0),
    ([{"role": "user", "content": "What is 10 - 1?"}], 9.0),
    ([{"role": "user", "content": "What is 1 + 1?"}], 2.0),
]


def _crafted(tokenizer):
    """Completions with known correctness: right (####), right (answer is, with $ and commas), wrong, no number."""
    texts = ["2 + 2 = 4\n#### 4<|im_end|>", "The answer is $7.<|im_end|>", "It is 8.<|im_end|>", "two"]
    return encode_prompts(tokenizer, PROBLEMS), [tokenizer(t)["input_ids"] for t in texts]


def _divergences_one_by_one(student, teacher, prompts, completions, beta=1.0):
    """Reference: each sequence alone, unpadded, logits at len(prompt) - 1 ... predict the completion."""
    values = []
    for p, c in zip(prompts, completions):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            s = student(input_ids=ids).logits[0, len(p) - 1 : len(p) + len(c) - 1]
            t = teacher(input_ids=ids).logits[0, len(p) - 1 : len(p) + len(c) - 1]
        values.append(per_token_divergence(s, t, beta))
    return torch.cat(values).double()


def test_metrics_on_crafted_completions(tokenizer, student, teacher):
    prompts, completions = _crafted(tokenizer)
    assert tokenizer.eos_token_id in completions[0] and tokenizer.eos_token_id not in completions[3]
    rocks = tokenizer(" =\n")["input_ids"]  # space, "=", newline
    result = evaluate_completions(
        student, tokenizer, PROBLEMS, prompts, completions, teacher=teacher, rock_ids=rocks, max_new_tokens=3,
        batch_size=3,
    )
    assert result.accuracy == 0.5
    # "It is 8." has no final-answer marker: no prediction (the last-number fallback is off by default).
    assert [r["prediction"] for r in result.records] == ["4", "7", None, None]
    # Only "two" has no eos and reaches max_new_tokens=3.
    assert result.clipped_ratio == 0.25
    lengths = [len(c) for c in completions]
    assert result.num_tokens == sum(lengths) and result.mean_completion_length == sum(lengths) / 4

    reference = _divergences_one_by_one(student, teacher, prompts, completions)
    ids = torch.tensor([t for c in completions for t in c])
    non_rock = ~torch.isin(ids, torch.tensor(rocks))
    assert 0 < non_rock.sum() < len(ids)
    assert result.mean_divergence == pytest.approx(float(reference.mean()), abs=1e-6)
    assert result.mean_divergence_non_rock == pytest.approx(float(reference[non_rock].mean()), abs=1e-6)
    assert result.mean_divergence_non_rock != pytest.approx(result.mean_divergence, abs=1e-6)
    assert result.rock_token_share == pytest.approx(1 - float(non_rock.double().mean()))
    assert 0.0 <= result.top1_agreement <= 1.0
    assert result.settings["num_rock_ids"] == 3 and result.settings["beta"] == 1.0


def test_teacher_identical_to_student_gives_zero_divergence_full_agreement(tokenizer, student):
    prompts, completions = _crafted(tokenizer)
    crafted = evaluate_completions(student, tokenizer, PROBLEMS, prompts, completions, teacher=student)
    assert crafted.mean_divergence == pytest.approx(0.0, abs=1e-6) and crafted.top1_agreement == 1.0
    generated = evaluate_gsm8k(student, tokenizer, PROBLEMS, teacher=student, max_new_tokens=6, show_progress=False)
    assert generated.mean_divergence == pytest.approx(0.0, abs=1e-6) and generated.top1_agreement == 1.0
    assert generated.num_tokens > 0 and generated.mean_divergence_non_rock is None


def test_without_teacher_only_accuracy(tokenizer, student):
    prompts, completions = _crafted(tokenizer)
    result = evaluate_completions(student, tokenizer, PROBLEMS, prompts, completions)
    assert result.accuracy == 0.5 and result.mean_divergence is None and result.top1_agreement is None


def test_scores_do_not_depend_on_padding(tokenizer, student, teacher):
    prompts, completions = _crafted(tokenizer)
    alone = score_completions(student, teacher, prompts[:1], completions[:1], pad_token_id=tokenizer.pad_token_id)
    # In a batch with a longer prompt (left padding) and a longer completion (right padding after the eos).
    batched = score_completions(
        student, teacher, prompts[:2] + prompts[2:3], completions[:1] + [completions[1] * 3] + completions[2:3],
        pad_token_id=tokenizer.pad_token_id, batch_size=3,
    )
    assert len(prompts[1]) > len(prompts[0]) and len(completions[1] * 3) > len(completions[0])
    torch.testing.assert_close(batched[0]["divergence"], alone[0]["divergence"], atol=1e-5, rtol=0)
    assert torch.equal(batched[0]["agree"], alone[0]["agree"])


def test_scoring_chunks_bound_rows_and_positions():
    from hf_rockopd.evaluation.rollout import _SCORE_POSITIONS, _score_chunks

    lengths = [10, 10, _SCORE_POSITIONS // 2, _SCORE_POSITIONS // 2, _SCORE_POSITIONS * 2, 3, 3, 3]
    chunks = _score_chunks([[0] * n for n in lengths], batch_size=3)
    assert chunks == [(0, 2), (2, 4), (4, 5), (5, 8)]
    assert [(b - a) for a, b in _score_chunks([[0]] * 7, batch_size=3)] == [3, 3, 1]


def test_generation_batching_does_not_change_the_result(tokenizer, student, teacher):
    kwargs = dict(teacher=teacher, max_new_tokens=6, show_progress=False)
    one = evaluate_gsm8k(student, tokenizer, PROBLEMS[:3], batch_size=1, **kwargs)
    four = evaluate_gsm8k(student, tokenizer, PROBLEMS[:3], batch_size=3, **kwargs)
    assert [r["completion"] for r in one.records] == [r["completion"] for r in four.records]
    assert four.mean_divergence == pytest.approx(one.mean_divergence, abs=1e-5)
    assert four.top1_agreement == one.top1_agreement and four.num_tokens == one.num_tokens


def test_eval_result_round_trip_and_table(tmp_path, tokenizer, student, teacher):
    prompts, completions = _crafted(tokenizer)
    result = evaluate_completions(student, tokenizer, PROBLEMS, prompts, completions, teacher=teacher, rock_ids=[32])
    data = result.to_dict()
    old_keys = {
        "accuracy", "num_problems", "mean_divergence", "mean_divergence_non_rock", "rock_token_share",
        "top1_agreement", "num_tokens", "mean_completion_length", "clipped_ratio", "settings",
    }
    quality_keys = {
        "accuracy_low", "accuracy_high", "finished_rate", "loop_rate", "repeated_ngram_fraction", "distinct_1",
        "distinct_2", "teacher_accuracy", "teacher_accuracy_low", "teacher_accuracy_high", "teacher_forced_divergence",
        "teacher_forced_top1_agreement", "cut_ratio",
    }
    assert set(data) == old_keys | quality_keys
    assert EvalResult.from_dict(json.loads(json.dumps(data))) == result
    # A report written before the quality metrics still loads; they read back as not measured.
    old = EvalResult.from_dict({k: v for k, v in data.items() if k in old_keys})
    assert old.accuracy == result.accuracy and all(getattr(old, k) is None for k in quality_keys)
    assert "loop share" not in format_results_table({"old": old}) and "accuracy [95% CI]" in old.table()
    saved = EvalResult.load(result.save(tmp_path / "e.json", include_records=True))
    assert saved == result and len(saved.records) == 4
    table = format_results_table({"before": result, "after": data})
    assert "before" in table and "after" in table and f"{result.accuracy:.3f}" in table
    with pytest.raises(ValueError, match=r"keys \['accuracy'\] are missing"):
        EvalResult.from_dict({k: v for k, v in data.items() if k != "accuracy"})


def test_cut_completion_has_no_prediction_and_is_wrong(tokenizer, student):
    """A completion that hits the limit without a final-answer marker is cut: no prediction, wrong, even when its last
    number equals the gold and the last-number fallback is on (the old extractor credited it)."""
    problems = PROBLEMS[:2]
    prompts = encode_prompts(tokenizer, problems)
    texts = ["so 2 + 2 = 4", "3 + 4 = 7<|im_end|>"]  # the first is cut (no eos, at the limit), the second finished
    completions = [tokenizer(t)["input_ids"] for t in texts]
    limit = len(completions[0])
    result = evaluate_completions(student, tokenizer, problems, prompts, completions, max_new_tokens=limit,
                                  last_number=True)
    assert [r["cut"] for r in result.records] == [True, False]
    assert [r["prediction"] for r in result.records] == [None, "7"]
    assert [r["correct"] for r in result.records] == [False, True]
    assert result.cut_ratio == 0.5 and result.accuracy == 0.5
    strict = evaluate_completions(student, tokenizer, problems, prompts, completions, max_new_tokens=limit)
    assert strict.accuracy == 0.0 and strict.settings["last_number_fallback"] is False


def test_verifier_none_scores_no_accuracy_but_the_rest(tokenizer, student, teacher):
    problems = [([{"role": "user", "content": "Say hi."}], "Hello there!"), PROBLEMS[0]]
    prompts = encode_prompts(tokenizer, problems)
    completions = [tokenizer(t)["input_ids"] for t in ["Hi!<|im_end|>", "4<|im_end|>"]]
    result = evaluate_completions(student, tokenizer, problems, prompts, completions, teacher=teacher,
                                  verifier="none")
    assert result.accuracy is None and result.accuracy_low is None and result.mean_divergence is not None
    assert "accuracy" not in result.table() and result.settings["verifier"] == "none"
    with pytest.raises(ValueError, match="Problem 0: No gold answer"):
        evaluate_completions(student, tokenizer, problems, prompts, completions, verifier="gsm8k")
    with pytest.raises(ValueError, match="verifier must be one of"):
        evaluate_completions(student, tokenizer, problems, prompts, completions, verifier="exact")


def test_bad_input_is_refused_before_generation(tmp_path, tokenizer, student, teacher):
    with pytest.raises(ValueError, match="No problem to evaluate"):
        evaluate_gsm8k(student, tokenizer, [], teacher=teacher)
    with pytest.raises(ValueError, match=r"Problem 0 is .*\(messages, reference answer\)"):
        evaluate_gsm8k(student, tokenizer, ["What is 1 + 1?"])
    other = tmp_path / "rock_set.json"
    other.write_text(json.dumps({"token_ids": [13, 198], "vocab_size": 49152}))
    with pytest.raises(ValueError, match="vocabulary of 49152 tokens.*259"):
        evaluate_gsm8k(student, tokenizer, PROBLEMS, teacher=teacher, rock_ids=other)
    with pytest.raises(ValueError, match="out"):
        evaluate_gsm8k(student, tokenizer, PROBLEMS, teacher=teacher, rock_ids=[5, 1000])
    wide = build_tiny_causal_lm(tokenizer, seed=2, vocab_size=300)
    with pytest.raises(ValueError, match="vocabularies differ: student 259, teacher 300"):
        evaluate_gsm8k(student, tokenizer, PROBLEMS, teacher=wide)
    with pytest.raises(ValueError, match="batch_size and max_new_tokens must be >= 1"):
        evaluate_gsm8k(student, tokenizer, PROBLEMS, max_new_tokens=0)


def test_cli_eval_writes_json_that_reads_back(tmp_path, tokenizer, student, teacher, capsys):
    student.save_pretrained(tmp_path / "student")
    tokenizer.save_pretrained(tmp_path / "student")
    teacher.save_pretrained(tmp_path / "teacher")
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(6)]
    problems = _write_jsonl(tmp_path / "p.jsonl", rows)
    rock_set = tmp_path / "rock_set.json"
    rock_set.write_text(json.dumps({"token_ids": [32, 61], "vocab_size": 259}))
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(tmp_path / "student"), "--teacher", str(tmp_path / "teacher"), "--problems",
            str(problems), "--limit", "3", "--tail", "--rock_set", str(rock_set), "--max_new_tokens", "6",
            "--batch_size", "2", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "mean divergence (non-rock)" in printed and f"wrote {out}" in printed
    result = EvalResult.load(out)
    assert result.num_problems == 3 and result.settings["num_rock_ids"] == 2 and result.settings["max_new_tokens"] == 6
    assert result.mean_divergence > 0 and result.mean_divergence_non_rock is not None
    # The same evaluation in Python gives the same numbers.
    direct = evaluate_gsm8k(student, tokenizer, load_gsm8k_problems(problems, limit=3, tail=True), teacher=teacher,
                            rock_ids=rock_set, max_new_tokens=6, batch_size=2, show_progress=False)
    assert result.mean_divergence == pytest.approx(direct.mean_divergence, abs=1e-6)
    assert result.accuracy == direct.accuracy and result.num_tokens == direct.num_tokens

    # Columns that fit no format, and a reference the verifier cannot read: errors before any model loads.
    missing = _write_jsonl(tmp_path / "q.jsonl", [{"text": "q", "label": "#### 1"}])
    assert main(["eval", "--model", str(tmp_path / "missing-model"), "--problems", str(missing)]) == 2
    assert "fit none of the formats" in capsys.readouterr().err
    wrong = _write_jsonl(tmp_path / "w.jsonl", [{"question": "q", "answer": "seven"}])
    argv = ["eval", "--model", str(tmp_path / "missing-model"), "--problems", str(wrong), "--verifier", "gsm8k"]
    assert main(argv) == 2
    assert "Problem 0 of" in capsys.readouterr().err


def test_with_rock_ids_fills_in_the_rock_figures_without_scoring_again(tokenizer, student, teacher):
    prompts, completions = _crafted(tokenizer)
    rocks = tokenizer(" =\n")["input_ids"]
    with_rocks = evaluate_completions(student, tokenizer, PROBLEMS, prompts, completions, teacher=teacher, rock_ids=rocks)
    later = evaluate_completions(student, tokenizer, PROBLEMS, prompts, completions, teacher=teacher).with_rock_ids(rocks)
    assert later.mean_divergence_non_rock == pytest.approx(with_rocks.mean_divergence_non_rock, abs=1e-12)
    assert later.rock_token_share == with_rocks.rock_token_share and later.settings["num_rock_ids"] == 3
    assert later.mean_divergence == with_rocks.mean_divergence
    with pytest.raises(ValueError, match="read from JSON"):
        EvalResult.from_dict(later.to_dict()).with_rock_ids(rocks)


def test_quality_metrics_and_per_problem_records(tokenizer, student, teacher):
    prompts, completions = _crafted(tokenizer)
    completions[3] = tokenizer("20 cookies, " * 4)["input_ids"]  # a loop, no eos
    result = evaluate_completions(student, tokenizer, PROBLEMS, prompts, completions, max_new_tokens=48)
    assert (result.accuracy_low, result.accuracy_high) == pytest.approx((0.15003, 0.84997), abs=1e-4)  # Wilson 2/4
    assert result.finished_rate == 0.75 and result.loop_rate == 0.25
    assert [r["finished"] for r in result.records] == [True, True, True, False]
    assert [r["loop"] for r in result.records] == [False, False, False, True]
    assert result.records[3]["repeated_ngram_fraction"] > 0.5 and 0 < result.distinct_1 < result.distinct_2 <= 1
    # Without a teacher or a reference: no ceiling, no teacher-forced divergence; a table row for each measured one.
    assert result.teacher_accuracy is None and result.teacher_forced_divergence is None
    assert "teacher" not in result.table() and "0.500 [0.150, 0.850]" in result.table()
    assert result.to_dict()["finished_rate"] == 0.75 and json.dumps(result.to_dict(include_records=True))


def test_scoring_chunks_shrink_with_the_vocabulary():
    """The position budget is in logit entries: a 3x larger vocabulary scores about a third of the positions at once."""
    from hf_rockopd.evaluation.rollout import _SCORE_ENTRIES, _score_chunks

    qwen_positions = _SCORE_ENTRIES // 151_936
    assert 600 < qwen_positions < 700
    lengths = [300] * 8
    assert _score_chunks([[0] * n for n in lengths], batch_size=8) == [(0, 6), (6, 8)]  # SmolLM2's budget
    assert _score_chunks([[0] * n for n in lengths], batch_size=8, max_positions=qwen_positions) == [
        (0, 2), (2, 4), (4, 6), (6, 8)
    ]
