"""The whole `hf-rockopd distill` command resumes: SIGKILLed after a checkpoint (before its evaluation) or in the
middle of the final evaluation, the same command run again ends as the uninterrupted run does: same adapter, same
checkpoint evaluations, same answers. Two runs on the same problems share the teacher's reference and the base
student's evaluation; a run restarted with other settings is refused before any model loads."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import write_distill_inputs
from safetensors.torch import load_file

from hf_rockopd.trainers.clock import TrainingClock


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "distill_then_sigkill.py")


def run(work, output, kill="none", *extra):
    env = dict(os.environ, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, SCRIPT, str(work), str(output), kill, *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("distill_resume")
    write_distill_inputs(work, question="Tom has {i} apples and buys 2 more. How many?")
    full = run(work, work / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    return work, full


def _adapter(path):
    return load_file(os.path.join(path, "adapter_model.safetensors"))


def _checkpoint_evals(path):
    with open(os.path.join(path, "checkpoint_evals.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


def _answers(path):
    with open(os.path.join(path, "eval_after.json")) as f:
        return [(r["prediction"], r["correct"], r.get("text")) for r in json.load(f)["records"]]


def _same_as_full(work, name):
    for key, weight in _adapter(work / "full").items():
        torch.testing.assert_close(weight, _adapter(work / name)[key], rtol=0, atol=0, msg=key)
    assert _checkpoint_evals(work / name) == _checkpoint_evals(work / "full")
    assert _answers(work / name) == _answers(work / "full")
    full = json.loads((work / "full" / "run_report.json").read_text())
    again = json.loads((work / name / "run_report.json").read_text())
    for when in ("before", "after"):  # every figure; the settings hold the evaluations' timings
        assert {k: v for k, v in again["eval"][when].items() if k != "settings"} == {
            k: v for k, v in full["eval"][when].items() if k != "settings"}


def test_full_run_shares_the_evaluation_cache_and_evaluates_each_checkpoint(runs):
    work, full = runs
    shared = sorted(os.listdir(work / "shared"))
    assert {"teacher_reference.json", "eval_before.cache.json", "checkpoint_eval_step0.json"} <= set(shared)
    assert not [name for name in shared if name.endswith(".generate.jsonl")]  # journals go once their file is whole
    assert [row["step"] for row in _checkpoint_evals(work / "full")] == [0, 2, 4, 6]
    assert "eta" in full.stderr + full.stdout
    assert not (work / "full" / "eval_after.generate.jsonl").exists()


def test_killed_after_a_checkpoint_resumes_to_the_same_end(runs):
    work, _ = runs
    killed = run(work, work / "killed", "train")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (work / "killed" / "checkpoint-2").is_dir() and not (work / "killed" / "checkpoint-4").exists()
    # Killed between the save and the checkpoint's evaluation: only step 0's line is there.
    assert [row["step"] for row in _checkpoint_evals(work / "killed")] == [0]
    resumed = run(work, work / "killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr and "checkpoint-2" in resumed.stderr
    # The second run reused the shared cache: no teacher generation, no base evaluation.
    assert "reused from" in resumed.stderr
    _same_as_full(work, "killed")
    # This sitting's time covers the steps after the checkpoint only, and the report says from which step.
    reports = [json.loads((work / name / "run_report.json").read_text())["training"] for name in ("full", "killed")]
    assert [t["resumed_from_step"] for t in reports] == [0, 2] and reports[1]["global_step"] == 6
    # The training clock, saved in checkpoint-2, times all six steps across both sittings.
    assert [t["timed_steps"] for t in reports] == [6, 6] and all(t["step_seconds"] > 0 for t in reports)


def test_killed_at_the_last_checkpoint_resumes_without_another_step(runs):
    # The real-budget run's uniform student was killed here and its resume trained step 201 of 200.
    work, _ = runs
    killed = run(work, work / "killed_last", "last_checkpoint")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [row["step"] for row in _checkpoint_evals(work / "killed_last")] == [0, 2, 4]
    resumed = run(work, work / "killed_last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "checkpoint-6" in resumed.stderr and not (work / "killed_last" / "checkpoint-7").exists()
    _same_as_full(work, "killed_last")
    report = json.loads((work / "killed_last" / "run_report.json").read_text())["training"]
    assert report["global_step"] == 6 and report["resumed_from_step"] == 6
    # Nothing trained in this sitting, but the clock read from checkpoint-6 still holds the six steps' time. (Compared
    # with the checkpoint's own record, not with this sitting's train_seconds: on a fast machine both round to 0.2 s.)
    clock = TrainingClock.from_checkpoint(work / "killed_last" / "checkpoint-6")
    assert report["timed_steps"] == clock.steps == 6
    assert report["step_seconds"] == round(clock.seconds, 1) and clock.seconds > 0


def test_a_checkpoint_of_another_run_is_evaluated_on_the_validation_slice_without_training(runs):
    # How the real-budget report puts a run's intermediate checkpoints on the validation slice: max_steps at the
    # checkpoint's step, resume_from_checkpoint naming it, a new output_dir.
    work, _ = runs
    checkpoint = work / "full" / "checkpoint-4"
    at4 = run(work, work / "at4", "none", "--max_steps", "4", "--resume_from_checkpoint", str(checkpoint),
              "--eval_on", "validation", "--checkpoint_eval_problems", "0")
    assert at4.returncode == 0, at4.stderr[-3000:]
    assert not [name for name in os.listdir(work / "at4") if name.startswith("checkpoint-")]  # nothing trained
    for key, weight in _adapter(checkpoint).items():
        torch.testing.assert_close(weight, _adapter(work / "at4")[key], rtol=0, atol=0, msg=key)
    report = json.loads((work / "at4" / "run_report.json").read_text())
    assert report["training"]["global_step"] == 4 and report["eval"]["after"]["num_problems"] == 2
    assert report["training"]["timed_steps"] == 4  # the clock of the sitting that trained them, read back


def test_a_finished_run_run_again_does_nothing(runs, tmp_path):
    work, _ = runs
    shutil.copytree(work / "full", tmp_path / "done")
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "done").iterdir()}
    again = run(work, tmp_path / "done")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "holds this run, finished (run_report.json): nothing to do" in again.stderr
    assert "loading teacher" not in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "done").iterdir()} == before


def test_killed_during_the_final_evaluation_resumes_at_its_batch(runs):
    work, _ = runs
    killed = run(work, work / "killed_eval", "eval_after")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    journal = work / "killed_eval" / "eval_after.generate.jsonl"
    assert len(journal.read_text().splitlines()) == 2  # the key and one finished batch
    resumed = run(work, work / "killed_eval")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "generate (1 batch resumed from eval_after.generate.jsonl)" in resumed.stderr
    _same_as_full(work, "killed_eval")


def test_other_settings_in_the_same_directory_are_refused_before_loading(runs):
    work, _ = runs
    settings = json.loads((work / "full" / "run_settings.json").read_text())
    settings["learning_rate"] = 0.5
    (work / "full" / "run_settings.json").write_text(json.dumps(settings))
    again = run(work, work / "full")
    assert again.returncode != 0
    assert "learning_rate: 0.5 -> 0.01" in again.stderr
    assert "loading teacher" not in again.stderr


def test_cached_top_k_teacher_forced_divergence_without_on_policy_scoring(runs, tmp_path):
    from hf_rockopd import RockOPDConfig
    from hf_rockopd.distill import DistillArguments, run_distillation

    work, _ = runs
    script = DistillArguments(
        teacher=str(work / "teacher"), student_num_layers=2, dataset=str(work / "problems.jsonl"),
        num_train_prompts=4, num_eval_problems=4, eval_max_new_tokens=6, eval_batch_size=2,
        eval_cache_dir=str(tmp_path / "shared"), eval_teacher_top_k=8, eval_on_policy_divergence=False,
    )

    def args(name):
        return RockOPDConfig(output_dir=str(tmp_path / name), max_steps=1, per_device_train_batch_size=2,
                             max_new_tokens=4, save_strategy="no", report_to="none", rock_policy="uniform")

    first = run_distillation(script, args("a")).report["eval"]
    caches = [name for name in os.listdir(tmp_path / "shared") if name.endswith(".parquet")]
    assert len(caches) == 1 and caches[0].startswith("teacher_reference.top8.")
    made = os.path.getmtime(tmp_path / "shared" / caches[0])
    for when in ("before", "after"):
        assert first[when]["teacher_forced_divergence"] > 0
        assert first[when]["mean_divergence"] is None  # no on-policy scoring asked for
    second = run_distillation(script, args("b")).report["eval"]
    assert os.path.getmtime(tmp_path / "shared" / caches[0]) == made  # scored once, read back
    assert second["before"]["teacher_forced_divergence"] == first["before"]["teacher_forced_divergence"]


LONG_CONFIG = os.path.join(ROOT, "examples", "configs", "distill_qwen_long.yaml")
GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "train.jsonl")


def test_the_long_config_is_the_real_budget_and_both_policies_parse():
    from hf_rockopd.commands.distill import parse_arguments

    script, args, model_args = parse_arguments(["--config", LONG_CONFIG])
    assert args.max_steps >= 200 and script.num_eval_problems >= 250 and script.verifier == "gsm8k"
    assert str(args.save_strategy.value if hasattr(args.save_strategy, "value") else args.save_strategy) == "steps"
    assert args.max_steps % args.save_steps == 0 and model_args.use_peft
    assert args.rock_policy == "rock_online" and args.rock_policy_kwargs["warmup_steps"] == 20
    assert script.eval_cache_dir and script.checkpoint_eval_problems <= script.num_eval_problems
    assert script.checkpoint_eval_steps % args.save_steps == 0 and args.max_steps % script.checkpoint_eval_steps == 0
    # `make distill-long`'s uniform run: the same file, only the policy and the output directory differ.
    uniform, uniform_args, _ = parse_arguments(["--config", LONG_CONFIG, "--rock_policy", "uniform",
                                                "--rock_policy_kwargs", "{}", "--output_dir", "runs/x/uniform"])
    assert uniform == script and uniform_args.rock_policy == "uniform" and uniform_args.rock_policy_kwargs == {}
    assert uniform_args.learning_rate == args.learning_rate and uniform_args.seed == args.seed


@pytest.mark.skipif(not os.path.isfile(GSM8K), reason="needs GSM8K's training split in ../shared/data")
def test_long_run_split_keeps_held_out_validation_and_training_apart():
    from hf_rockopd.commands.distill import parse_arguments
    from hf_rockopd.distill import load_distill_data

    script, args, _ = parse_arguments(["--config", LONG_CONFIG, "--dataset", GSM8K])
    data = load_distill_data(script, seed=args.seed)
    held_out, validation = set(data.eval_indices), set(data.validation_indices)
    assert len(held_out) == 250 and len(validation) == 64 and not held_out & validation
    questions = {row["question"] for row in map(json.loads, open(GSM8K))}
    train = {m["messages"][0]["content"] for m in data.train}
    assert len(train) == len(data.train) == 800 and train <= questions
    evaluated = {p[0][-1]["content"] for p in data.problems} | {p[0][-1]["content"] for p in data.validation}
    assert not train & evaluated
    script.eval_on = "validation"
    assert load_distill_data(script, seed=args.seed).eval_indices == data.validation_indices
