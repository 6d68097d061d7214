"""The evaluation's quality metrics against a degenerate student: a looping student *lowers* the on-policy
divergence, yet the loop measure flags it and the teacher-forced divergence (on the teacher's own completions) is
worse. The models are tiny Llamas whose weights are set by hand so that every behaviour is known.

How the models work: one decoder layer whose attention and MLP outputs are zeroed, so the residual stream is the
token's embedding and each model is a bigram model, `next-token logits = f(current token)`. Embeddings are one-hot
over a few "states" (the prompt's last token, the teacher's answer tokens, the loop's two tokens, everything else),
and the output layer's column of a state holds that state's logits.

- teacher: from the prompt it writes "= 4" then eos (correct); at "x" it predicts "y" and at "y" it predicts "x", the
  way a real teacher predicts a repetition once it is in context.
- sane student: the teacher's argmaxes with less confidence, so it writes the same answer at a moderate divergence.
- looping student: from the prompt it goes to "x", then copies the teacher exactly at "x" and "y" (divergence 0
  there), so its own completion "xyxyxy…" has a low on-policy divergence; on the teacher's answer it is far off.
"""

import math

import pytest
import torch

from hf_rockopd.evaluation import EvalResult, evaluate_gsm8k
from hf_rockopd.models import build_tiny_causal_lm
from hf_rockopd.evaluation.teacher_reference import build_teacher_reference


PROBLEMS = [([{"role": "user", "content": f"What is {i} + {4 - i}?"}], 4.0) for i in range(3)]
MAX_NEW_TOKENS = 40


def _bigram_lm(tokenizer, table: dict[str, dict[str, float]], default: dict[str, float]):
    """A Llama whose next-token logits depend on the current token only: `table[state]`, else `default`."""
    states = ["\n", "=", " ", "4", "x", "y"]
    ids = {s: tokenizer.convert_tokens_to_ids(tokenizer.tokenize(s))[0] for s in states}
    ids["<eos>"] = tokenizer.eos_token_id
    hidden = len(states) + 2  # one basis vector per state, one for every other token, one spare
    model = build_tiny_causal_lm(tokenizer, hidden_size=hidden, num_hidden_layers=1, seed=0)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embed = torch.zeros_like(model.model.embed_tokens.weight)
        embed[:, len(states)] = 1.0  # every other token
        for column, state in enumerate(states):
            embed[ids[state]] = 0.0
            embed[ids[state], column] = 1.0
        model.model.embed_tokens.weight.copy_(embed)
        # RMSNorm turns a one-hot embedding into sqrt(hidden) times it; divide it out of the head.
        head = torch.zeros_like(model.lm_head.weight)
        for column, state in enumerate([*states, None]):
            for token, logit in (table.get(state, default) if state else default).items():
                head[ids[token], column] = logit / math.sqrt(hidden)
        model.lm_head.weight.copy_(head)
    return model.eval()


LOOP = {"x": {"y": 12.0}, "y": {"x": 12.0}}  # the teacher, and the looping student, predict the repetition


@pytest.fixture(scope="module")
def models(tokenizer):
    teacher = _bigram_lm(
        tokenizer, {"\n": {"=": 10.0}, "=": {" ": 10.0}, " ": {"4": 10.0}, "4": {"<eos>": 10.0}, **LOOP},
        default={"<eos>": 10.0},
    )
    sane = _bigram_lm(
        tokenizer, {"\n": {"=": 7.0}, "=": {" ": 7.0}, " ": {"4": 7.0}, "4": {"<eos>": 7.0}, **LOOP},
        default={"<eos>": 7.0},
    )
    looping = _bigram_lm(tokenizer, {"\n": {"x": 8.0}, **LOOP}, default={"x": 8.0})
    return teacher, sane, looping


def test_the_crafted_models_do_what_they_are_built_for(tokenizer, models):
    teacher, sane, looping = models
    # "= 4" carries no final-answer marker: it counts only with the last-number option (it finished, so it may).
    reference = build_teacher_reference(teacher, tokenizer, PROBLEMS, max_new_tokens=MAX_NEW_TOKENS, last_number=True)
    assert [tokenizer.decode(c) for c in reference.completion_ids] == ["= 4<|im_end|>"] * 3
    assert reference.correct == [True] * 3
    strict = build_teacher_reference(teacher, tokenizer, PROBLEMS, max_new_tokens=MAX_NEW_TOKENS)
    assert strict.correct == [False] * 3 and strict.predictions == [None] * 3
    sane_reference = build_teacher_reference(sane, tokenizer, PROBLEMS, max_new_tokens=MAX_NEW_TOKENS)
    assert sane_reference.completion_ids == reference.completion_ids
    loop_reference = build_teacher_reference(looping, tokenizer, PROBLEMS, max_new_tokens=MAX_NEW_TOKENS)
    assert tokenizer.decode(loop_reference.completion_ids[0]) == "xy" * (MAX_NEW_TOKENS // 2)


def test_a_looping_student_fools_the_on_policy_divergence_but_not_the_quality_metrics(tokenizer, models):
    teacher, sane, looping = models
    reference = build_teacher_reference(teacher, tokenizer, PROBLEMS, max_new_tokens=MAX_NEW_TOKENS)
    kwargs = {"teacher": teacher, "teacher_reference": reference, "max_new_tokens": MAX_NEW_TOKENS,
              "show_progress": False, "last_number": True}  # the crafted answers are a bare "= 4"
    good = evaluate_gsm8k(sane, tokenizer, PROBLEMS, **kwargs)
    bad = evaluate_gsm8k(looping, tokenizer, PROBLEMS, **kwargs)

    # 1. The on-policy divergence (the student's own text) prefers the looping student ...
    assert bad.mean_divergence < good.mean_divergence
    assert bad.mean_divergence < 0.75 * good.mean_divergence  # not a rounding accident
    # 2. ... the loop measure flags it (and it never finishes, and answers nothing) ...
    assert bad.loop_rate == 1.0 and good.loop_rate == 0.0
    assert all(r["loop"] for r in bad.records) and not any(r["loop"] for r in good.records)
    assert bad.finished_rate == 0.0 and good.finished_rate == 1.0
    assert bad.repeated_ngram_fraction > 0.9 and bad.distinct_2 < good.distinct_2
    assert bad.accuracy == 0.0 and good.accuracy == 1.0 and good.teacher_accuracy == bad.teacher_accuracy == 1.0
    # 3. ... and on the teacher's own completions, text it did not write, it is far worse.
    assert bad.teacher_forced_divergence > 10 * good.teacher_forced_divergence
    assert bad.teacher_forced_top1_agreement < good.teacher_forced_top1_agreement == 1.0
    assert all(
        b["teacher_forced_divergence"] > g["teacher_forced_divergence"] for b, g in zip(bad.records, good.records)
    )
    # Both results carry the same reference, and the table says which divergence is which.
    assert bad.settings["teacher_reference"] == good.settings["teacher_reference"] == reference.fingerprint()
    table = EvalResult.table(bad)
    assert "on-policy mean divergence" in table and "teacher-forced divergence" in table
    assert "loop share" in table and "1.000 [0.439, 1.000]" in table  # the teacher's 3/3 with its Wilson interval


def test_distill_scores_before_and_after_on_one_teacher_reference(tmp_path, tokenizer, monkeypatch):
    import json

    from hf_rockopd import RockOPDConfig
    from hf_rockopd.evaluation import teacher_reference
    from hf_rockopd.distill import DistillArguments, run_distillation
    from hf_rockopd.evaluation import format_results_table

    calls = []
    real = teacher_reference.generate_completions
    monkeypatch.setattr(teacher_reference, "generate_completions", lambda *a, **k: calls.append(1) or real(*a, **k))
    teacher = build_tiny_causal_lm(tokenizer, hidden_size=64, num_hidden_layers=4, seed=1)
    teacher.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    rows = [{"question": f"Tom has {i} apples and buys 2 more. How many?", "answer": f"#### {i + 2}"}
            for i in range(12)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = DistillArguments(teacher=str(tmp_path / "teacher"), student_num_layers=2,
                              dataset=str(tmp_path / "p.jsonl"), num_train_prompts=4, num_eval_problems=3,
                              eval_max_new_tokens=6, eval_batch_size=3)
    args = RockOPDConfig(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=2,
                         max_new_tokens=6, learning_rate=1e-3, save_strategy="no", report_to="none",
                         rock_policy="uniform")
    report = run_distillation(script, args).report
    before, after = report["eval"]["before"], report["eval"]["after"]
    assert len(calls) == 1 and (tmp_path / "run" / teacher_reference.TEACHER_REFERENCE_NAME).is_file()
    assert before["settings"]["teacher_reference"] == after["settings"]["teacher_reference"] is not None
    assert before["teacher_accuracy"] == after["teacher_accuracy"] is not None
    for phase in (before, after):
        assert phase["teacher_forced_divergence"] > 0 and phase["mean_divergence"] > 0
        assert phase["accuracy_low"] <= phase["accuracy"] <= phase["accuracy_high"]
        assert 0 <= phase["loop_rate"] <= 1 and 0 <= phase["finished_rate"] <= 1
    table = format_results_table({"before": before, "after": after})  # as `hf-rockopd distill` prints it
    assert "teacher accuracy (ceiling)" in table and "teacher-forced divergence" in table and "on-policy" in table
