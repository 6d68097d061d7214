"""`hf-rockopd verdict` on two tiny runs that share one base evaluation: result.json's exact shape, the paired
p-values recomputed from the saved answers, the curves, and the verdict in each run's model card."""

import json
import os

import pytest
from scipy import stats

from conftest import write_distill_inputs
from hf_rockopd import RockOPDConfig
from hf_rockopd.cli import main as cli_main
from hf_rockopd.distill import DistillArguments, run_distillation
from hf_rockopd.publishing.model_card import write_model_card


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("verdict")
    write_distill_inputs(work)
    script = DistillArguments(
        teacher=str(work / "teacher"), student_num_layers=2, dataset=str(work / "problems.jsonl"),
        num_train_prompts=8, num_eval_problems=6, eval_max_new_tokens=6, eval_batch_size=3, verifier="gsm8k",
        last_number=True, eval_cache_dir=str(work / "shared"), checkpoint_eval_problems=3,
    )
    runs = {}
    for policy, kwargs in (("uniform", {}), ("rock_online", {"warmup_steps": 1, "refresh_every": 1, "persistence": 1,
                                                             "top_k": 5, "min_count": 1})):
        args = RockOPDConfig(output_dir=str(work / policy), max_steps=2, per_device_train_batch_size=2,
                             max_new_tokens=6, learning_rate=1e-2, save_strategy="steps", save_steps=1,
                             report_to="none", rock_policy=policy, rock_policy_kwargs=kwargs, seed=0)
        run_distillation(script, args)
        runs[policy] = work / policy
    return work, runs


def test_verdict_writes_result_json_in_its_shape(two_runs, capsys):
    work, runs = two_runs
    out = work / "report" / "result.json"
    assert cli_main(["verdict", "--runs", str(runs["uniform"]), str(runs["rock_online"]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "rocks vs uniform" in printed and "uniform" in printed
    result = json.loads(out.read_text())
    assert set(result) == {"pair", "steps", "num_eval_problems", "teacher_accuracy", "runs",
                           "p_value_rocks_vs_uniform"}
    assert result["steps"] == 2 and result["num_eval_problems"] == 6 and set(result["runs"]) == set(runs)
    # The paired p-values, recomputed from the saved per-problem answers.
    before = [r["correct"] for r in json.loads((runs["uniform"] / "eval_before.json").read_text())["records"]]
    after = {p: [r["correct"] for r in json.loads((d / "eval_after.json").read_text())["records"]]
             for p, d in runs.items()}
    for policy, flags in after.items():
        gained = sum(a and not b for a, b in zip(flags, before))
        lost = sum(b and not a for a, b in zip(flags, before))
        expected = 1.0 if gained + lost == 0 else stats.binomtest(gained, gained + lost, 0.5).pvalue
        assert result["runs"][policy]["p_value_vs_before"] == pytest.approx(expected)
        assert result["runs"][policy]["accuracy_after"] == pytest.approx(sum(flags) / 6)
    assert (work / "report" / "result_details.json").is_file()
    assert (work / "report" / "curves.png").stat().st_size > 10_000
    # Each run's report now carries its verdict, and its card shows it.
    card = open(write_model_card(str(runs["rock_online"]))).read()
    assert "### Verdict on 6 held-out problems" in card and "paired exact McNemar p =" in card
    # Each card states the rocks-vs-uniform test from its own side, with the other student's accuracy.
    test = json.loads((work / "report" / "result_details.json").read_text())["rocks_vs_uniform"]
    flat = " ".join(card.split())
    assert (f"The student trained with the `uniform` policy on the same budget (seed, prompts and settings) has an "
            f"accuracy of {test['accuracy_second']:.3f} on these problems: this one solves {test['only_first']} "
            f"problem{'s' if test['only_first'] != 1 else ''} it does not and misses {test['only_second']} it "
            f"solves, paired exact McNemar p = {test['p_value']:.2g}.") in flat
    uniform_card = " ".join(open(write_model_card(str(runs["uniform"]))).read().split())
    assert (f"The student trained with the `rock_online` policy on the same budget (seed, prompts and settings) "
            f"has an accuracy of {test['accuracy_first']:.3f} on these problems: this one solves "
            f"{test['only_second']} problem") in uniform_card
    assert f"it does not and misses {test['only_first']} it solves" in uniform_card
    assert "uniform weights" not in uniform_card
    # The teacher's row carries its interval as the students' rows do; so does the before/after table's accuracy.
    teacher = json.loads((work / "report" / "result_details.json").read_text())["teacher"]
    assert f"| teacher | {teacher['accuracy']:.3f} [{teacher['low']:.3f}, {teacher['high']:.3f}] |" in card
    assert "| accuracy_low |" not in card and "| accuracy | " in card


def test_checkpoint_curves_share_the_base_point(two_runs):
    _, runs = two_runs
    rows = {p: [json.loads(line) for line in (d / "checkpoint_evals.jsonl").read_text().splitlines()]
            for p, d in runs.items()}
    assert [r["step"] for r in rows["uniform"]] == [0, 1, 2] == [r["step"] for r in rows["rock_online"]]
    assert rows["uniform"][0] == rows["rock_online"][0]  # step 0 computed once, read back by the second run


def test_verdict_refuses_unfinished_runs_and_duplicate_policies(two_runs, tmp_path, capsys):
    _, runs = two_runs
    assert cli_main(["verdict", "--runs", str(tmp_path), "--out", str(tmp_path / "r.json")]) != 0
    assert "Not finished distill runs" in capsys.readouterr().err
    assert cli_main(["verdict", "--runs", str(runs["uniform"]), str(runs["uniform"]), "--out",
                     str(tmp_path / "r.json")]) != 0
    assert "more than once" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_the_curves_teacher_line_is_the_teacher_on_the_curves_problems():
    # The slice is the first num_problems held-out problems: the teacher's line must be its accuracy there, not on all.
    from hf_rockopd.commands.verdict import _teacher_on_slice

    records = [{"teacher_correct": flag} for flag in (True, False, True, True)]
    assert _teacher_on_slice(records, {"uniform": [{"step": 0, "num_problems": 2}]}) == 0.5
    assert _teacher_on_slice(records, {"uniform": [{"step": 0, "num_problems": 4}]}) == 0.75
    assert _teacher_on_slice(records, {"uniform": [{"step": 0, "num_problems": 8}]}) is None  # more than evaluated
    assert _teacher_on_slice([{}] * 4, {"uniform": [{"step": 0, "num_problems": 2}]}) is None  # no teacher answers
    assert _teacher_on_slice(records, {"uniform": []}) is None
