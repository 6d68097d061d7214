"""Checkpoint evaluations of a long run: with `checkpoint_eval_steps` a run saves often (a stop loses few steps) and
evaluates only every N-th checkpoint, also across a resumption; a setting that no checkpoint would meet is refused
before any model loads, and how often a run saves or evaluates may change when it resumes."""

import os
from types import SimpleNamespace

import pytest

from hf_rockopd import RockOPDConfig
from hf_rockopd.distill import DistillArguments, run_distillation
from hf_rockopd.distill.checkpoints import (
    CheckpointEvaluation,
    check_checkpoint_eval_steps,
    read_checkpoint_evals,
    save_step0_line,
    step0_key,
)
from hf_rockopd.distill.resume import check_resume, record_run_settings, resume_settings


def _result(step):
    return SimpleNamespace(accuracy=step / 100, accuracy_low=0.0, accuracy_high=1.0, cut_ratio=0.0, loop_rate=0.0,
                           finished_rate=1.0, teacher_forced_divergence=0.1, mean_completion_length=5.0,
                           num_problems=3)


class _Sitting:
    """One training sitting: the callback's hooks called as transformers' Trainer calls them."""

    def __init__(self, path, every, start, **cache):
        self.evaluated = []
        self.state = SimpleNamespace(global_step=start, is_world_process_zero=True)

        def evaluate(model):
            self.evaluated.append(self.state.global_step)
            return _result(self.state.global_step)

        self.lines = []
        self.callback = CheckpointEvaluation(path, evaluate, on_line=self.lines.append, every=every, **cache)
        self.callback.on_train_begin(None, self.state, None, model=object())

    def save(self, step):
        self.state.global_step = step
        self.callback.on_save(None, self.state, None, model=object())


def test_only_every_nth_checkpoint_is_evaluated_across_a_resumption(tmp_path):
    path = tmp_path / "checkpoint_evals.jsonl"
    first = _Sitting(path, every=4, start=0)
    for step in (2, 4, 6):
        first.save(step)
    assert first.evaluated == [0, 4]
    # Killed after checkpoint-6 was saved: the resumed sitting starts at step 6, which is not evaluated, and goes on.
    second = _Sitting(path, every=4, start=6)
    for step in (8, 10, 12):
        second.save(step)
    assert second.evaluated == [8, 12]
    assert [row["step"] for row in read_checkpoint_evals(path)] == [0, 4, 8, 12]
    # Resumed from an evaluated step whose line exists: not evaluated twice.
    assert _Sitting(path, every=4, start=12).evaluated == []


def test_every_checkpoint_by_default(tmp_path):
    sitting = _Sitting(tmp_path / "evals.jsonl", every=0, start=0)
    for step in (1, 2, 3):
        sitting.save(step)
    assert sitting.evaluated == [0, 1, 2, 3]
    # The console line rounds the divergence as the report's tables do.
    assert sitting.lines[1] == (
        "step 1: accuracy 0.010 [0.000, 1.000] on 3 problems, teacher-forced divergence 0.1000, cut 0.00")


def test_a_step0_line_saved_by_hand_is_reused_under_its_key_only(tmp_path):
    """A report puts a finished run's step-0 line back with `save_step0_line` (examples/reports/real_budget/
    seed_runs.py): a run under the same key reuses it, a run on another slice evaluates its base student again."""
    cache, key = tmp_path / "step0.json", step0_key({"student": "s", "problems": "held-out"}, 3)
    save_step0_line(cache, key, {"step": 0, **vars(_result(7)), "seconds": 1.0})
    reused = _Sitting(tmp_path / "a.jsonl", every=0, start=0, step0_cache=str(cache), key=key)
    assert reused.evaluated == [] and read_checkpoint_evals(tmp_path / "a.jsonl")[0]["accuracy"] == 0.07
    other = _Sitting(tmp_path / "b.jsonl", every=0, start=0, step0_cache=str(cache),
                     key=step0_key({"student": "s", "problems": "held-out"}, 4))
    assert other.evaluated == [0] and read_checkpoint_evals(tmp_path / "b.jsonl")[0]["accuracy"] == 0.0


def test_bad_checkpoint_eval_steps_are_refused():
    check_checkpoint_eval_steps(50, "steps", 10)
    check_checkpoint_eval_steps(0, "steps", 7)  # every checkpoint
    check_checkpoint_eval_steps(25, "no", 10)  # no checkpoint, no checkpoint evaluation
    with pytest.raises(ValueError, match=r"checkpoint_eval_steps = 25 is not a multiple of save_steps = 10.*e\.g\. 50"):
        check_checkpoint_eval_steps(25, "steps", 10)
    with pytest.raises(ValueError, match="save_strategy='steps'"):
        check_checkpoint_eval_steps(50, "epoch", 10)
    with pytest.raises(ValueError, match="checkpoint_eval_steps must be an integer >= 0, got -5"):
        DistillArguments(checkpoint_eval_steps=-5)
    with pytest.raises(ValueError, match="every must be an integer >= 0"):
        CheckpointEvaluation("x.jsonl", lambda model: None, every=-1)


def test_a_run_whose_checkpoints_would_never_be_evaluated_fails_before_loading(tmp_path):
    script = DistillArguments(teacher=str(tmp_path / "no_such_teacher"), dataset=str(tmp_path / "no_such.jsonl"),
                              checkpoint_eval_problems=4, checkpoint_eval_steps=15)
    args = RockOPDConfig(output_dir=str(tmp_path / "out"), save_strategy="steps", save_steps=10, report_to="none")
    with pytest.raises(ValueError, match="checkpoint_eval_steps = 15 is not a multiple of save_steps = 10"):
        run_distillation(script, args)
    assert not os.path.exists(tmp_path / "out")


def test_how_often_a_run_saves_and_evaluates_may_change_when_it_resumes(tmp_path):
    def settings(**changes):
        script = DistillArguments(checkpoint_eval_problems=8, **changes.pop("script", {}))
        args = RockOPDConfig(output_dir=str(tmp_path), save_strategy="steps", report_to="none", **changes)
        return resume_settings(script, args)

    record_run_settings(str(tmp_path), settings(save_steps=50))
    (tmp_path / "checkpoint-50").mkdir()
    assert check_resume(str(tmp_path), settings(save_steps=10, script={"checkpoint_eval_steps": 50})) is not None
    with pytest.raises(ValueError, match="learning_rate"):
        check_resume(str(tmp_path), settings(save_steps=10, learning_rate=3e-4))
