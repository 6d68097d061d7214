"""`hf-rockopd ablate` offline on tiny models: both protocols end to end, resume, the summary on crafted results, and
bad arguments that fail before any model loads."""

import json

import pytest
import torch
import yaml

from hf_rockopd.ablate import runner
from hf_rockopd.ablate.arguments import AblateArguments
from hf_rockopd.commands import ablate as command
from hf_rockopd.commands.ablate import parse_arguments
from hf_rockopd.ablate.summary import load_runs, run_outcomes, summarize, write_summary
from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from a second thread, and on a loaded 2-core machine two threads spinning against
    other processes made these runs 60 times slower (15 s against 0.24 s for 50 forwards)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A saved tiny teacher (the student is its 2-layer copy) and a GSM8K-style JSONL file."""
    root = tmp_path_factory.mktemp("pair")
    tokenizer = build_tiny_tokenizer()
    teacher = build_tiny_causal_lm(tokenizer, hidden_size=64, num_hidden_layers=4, seed=1)
    teacher.save_pretrained(root / "teacher")
    tokenizer.save_pretrained(root / "teacher")
    data = root / "problems.jsonl"
    with open(data, "w") as f:
        for i in range(24):
            question = f"Tom has {i} apples and buys {i + 2} more. How many apples does he have?"
            f.write(json.dumps({"question": question, "answer": f"{i} + {i + 2} = {2 * i + 2}\n#### {2 * i + 2}"}) + "\n")
    return root


def argv(pair, output_dir, *extra):
    return [
        "--teacher", str(pair / "teacher"), "--student_num_layers", "2", "--dataset", str(pair / "problems.jsonl"),
        "--num_train_prompts", "8", "--num_eval_problems", "4", "--eval_max_new_tokens", "8", "--eval_batch_size", "4",
        "--rock_num_prompts", "8", "--rock_top_k", "5", "--rock_min_count", "1", "--warm_start_steps", "2",
        "--warm_start_save_steps", "1", "--max_steps", "2", "--per_device_train_batch_size", "2",
        "--max_new_tokens", "8", "--learning_rate", "1e-3", "--disable_tqdm", "true", "--output_dir", str(output_dir),
        *extra,
    ]  # fmt: skip


def ablate(arguments):
    a, args, model_args = parse_arguments(arguments)
    return runner.run_ablation(a, args, command="hf-rockopd ablate --test", model_args=model_args)


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if a model is loaded or trained."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded or trained")

    monkeypatch.setattr(runner, "_load_models", refuse)
    monkeypatch.setattr(runner, "train_copy", refuse)


def test_warm_start_end_to_end_then_resume(pair, tmp_path, monkeypatch, capsys):
    out = tmp_path / "ablation"
    arguments = argv(pair, out, "--policies", "uniform", "rock_freeze", "--seeds", "0", "1")
    assert command.main(arguments) == 0
    printed = capsys.readouterr().out
    assert "| uniform | 2 |" in printed and "| rock_freeze | 2 |" in printed and "summary.png" in printed

    # The warm start is one saved checkpoint; runs keep results only (no weights), each in its own directory.
    assert (out / "warm_start" / "warm_start.json").is_file() and (out / "warm_start" / "model").is_dir()
    assert (out / "teacher_reference.json").is_file()
    assert not (out / "warm_start" / "trainer").exists()
    assert not [f for f in (out / "runs").rglob("*") if f.suffix in (".safetensors", ".bin", ".pt")]
    rocks = json.loads((out / "rocks" / "rock_set.json").read_text())["token_ids"]
    runs = load_runs(out)
    assert [(r["policy"], r["seed"]) for r in runs] == [("rock_freeze", 0), ("rock_freeze", 1), ("uniform", 0),
                                                       ("uniform", 1)]  # fmt: skip
    for run in runs:
        m = run["metrics"]
        assert len(run["problems"]) == 4
        assert {"correct", "on_policy_divergence", "looped", "finished", "teacher_forced_divergence"} <= set(
            run["problems"][0]
        )
        assert m["teacher_forced_divergence"] > 0  # scored on the teacher's cached completions
        assert all(p["teacher_forced_divergence"] is not None for p in run["problems"])
        assert 0 <= m["accuracy_low"] <= m["accuracy"] <= m["accuracy_high"] <= 1
        assert m["on_policy_divergence"] >= 0 and 0 <= m["loop_rate"] <= 1 and 0 <= m["finished_rate"] <= 1
        assert m["steps"] == 2 and m["step_seconds"] > 0 and m["loss_seconds"] > 0 and m["total_seconds"] > 0
        assert 0 < m["projected_rows"] <= m["completion_tokens"]
        assert run["trainer_policy"]["rock_policy"] == run["policy"]
    # Every run was trained and evaluated as itself: not one scores its problems exactly as the start weights do.
    start = [p["on_policy_divergence"] for p in json.loads((out / "start_eval.json").read_text())["problems"]]
    assert all([p["on_policy_divergence"] for p in run["problems"]] != start for run in runs)
    by = {(r["policy"], r["seed"]): r for r in runs}
    assert by["uniform", 0]["metrics"]["projected_fraction"] == 1.0
    assert by["rock_freeze", 1]["rock_ids"] == rocks
    assert by["rock_freeze", 1]["trainer_policy"]["rock_policy_kwargs"]["weight"] == 0.0
    stats = json.loads((out / "summary.json").read_text())["stats"]
    accuracy = [d for d in stats["differences"] if (d["policy"], d["metric"]) == ("rock_freeze", "accuracy")]
    assert accuracy[0]["seeds"] == [0, 1] and accuracy[0]["num_problems"] == 4
    assert (out / "summary.png").read_bytes()[:4] == b"\x89PNG"

    # A rerun trains nothing and loads no model.
    with monkeypatch.context() as m:
        m.setattr(runner, "_load_models", lambda *a: pytest.fail("a model was loaded for finished runs"))
        m.setattr(runner, "train_copy", lambda *a, **k: pytest.fail("a finished run was trained again"))
        assert ablate(arguments)["trained"] == []
    # A run without its result (killed) is run again, from the saved warm start, and only it.
    (out / "runs" / "uniform" / "seed_1" / "result.json").unlink()
    assert ablate(arguments)["trained"] == [("uniform", 1)]
    # Other budget settings in the same directory are refused before any model loads.
    with monkeypatch.context() as m:
        m.setattr(runner, "_load_models", lambda *a: pytest.fail("a model was loaded"))
        with pytest.raises(ValueError, match=r"other settings \(training.learning_rate: 0.001 -> 0.01\)"):
            ablate(argv(pair, out, "--policies", "uniform", "--seeds", "0", "--learning_rate", "1e-2"))


def test_from_scratch_with_the_soft_policy(pair, tmp_path):
    out = tmp_path / "scratch"
    result = ablate(argv(pair, out, "--protocol", "from_scratch", "--policies", "uniform", "soft", "--seeds", "3"))
    assert sorted(result["trained"]) == [("soft", 3), ("uniform", 3)]
    assert not (out / "warm_start").exists() and (out / "rocks" / "rock_set.json").is_file()
    soft = json.loads((out / "runs" / "soft" / "seed_3" / "result.json").read_text())
    assert soft["trainer_policy"] == {
        "rock_policy": "rock_freeze",
        "rock_policy_kwargs": {"token_ids": str(out / "rocks" / "rock_set.json"), "weight": 0.3},
        "rock_normalization": "tokens",
    }
    assert soft["seed"] == 3 and soft["protocol"] == "from_scratch"
    table = (out / "summary.md").read_text()
    assert "means only, not tested" in table and "| soft | step_seconds |" not in table


def test_lora_runs_train_fresh_adapters_on_the_merged_warm_start(pair, tmp_path, monkeypatch):
    out = tmp_path / "lora"
    lora = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8"]
    result = ablate(argv(pair, out, "--policies", "uniform", "rock_online", "--seeds", "0", *lora))
    assert sorted(result["trained"]) == [("rock_online", 0), ("uniform", 0)]
    # The warm start's adapters were merged: its saved model is a plain causal LM, no adapter files.
    saved = out / "warm_start" / "model"
    assert (saved / "config.json").is_file() and not (saved / "adapter_config.json").exists()
    settings = json.loads((out / "ablation.json").read_text())["training"]["lora"]
    assert settings == {"r": 4, "alpha": 8, "dropout": 0.05, "target_modules": "all-linear"}
    uniform = json.loads((out / "runs" / "uniform" / "seed_0" / "result.json").read_text())
    assert uniform["lora"] == settings
    start = [p["on_policy_divergence"] for p in json.loads((out / "start_eval.json").read_text())["problems"]]
    assert [p["on_policy_divergence"] for p in uniform["problems"]] != start  # the adapters were trained
    # Full fine-tuning in the same directory is other settings: refused before any model loads.
    monkeypatch.setattr(runner, "_load_models", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(ValueError, match=r"training.lora: \{'r': 4.* -> None"):
        ablate(argv(pair, out, "--policies", "uniform", "--seeds", "0"))


def test_a_killed_warm_start_resumes_from_its_checkpoint(pair, tmp_path, monkeypatch):
    from hf_rockopd.ablate import compute

    class Killed(Exception):
        pass

    original = compute.ComputeMeter.on_step_end

    def kill_at_step_2(self, args, state, control, **kwargs):
        original(self, args, state, control, **kwargs)
        if state.global_step == 2:  # checkpoint-1 is on disk, checkpoint-2 not yet
            raise Killed

    out = tmp_path / "killed"
    arguments = argv(pair, out, "--policies", "uniform", "--seeds", "0", "--warm_start_steps", "3")
    with monkeypatch.context() as m:
        m.setattr(compute.ComputeMeter, "on_step_end", kill_at_step_2)
        with pytest.raises(Killed):
            ablate(arguments)
    assert (out / "warm_start" / "trainer" / "checkpoint-1").is_dir()
    assert not (out / "warm_start" / "warm_start.json").exists() and not (out / "runs").exists()
    assert ablate(arguments)["trained"] == [("uniform", 0)]
    info = json.loads((out / "warm_start" / "warm_start.json").read_text())
    assert info["resumed_from"].endswith("checkpoint-1") and info["compute"]["steps"] == 2  # steps 2 and 3
    assert [e["step"] for e in info["log_history"] if "loss" in e] == [1, 2, 3]
    assert not (out / "warm_start" / "trainer").exists()  # optimizer checkpoints go once the model is saved


# ---------------------------------------------------------------------------------------------- arguments ----
@pytest.mark.parametrize(
    "extra, error, message",
    [
        (["--seeds"], SystemExit, None),
        (["--policies", "uniform", "nope"], ValueError, r"policies has unknown name\(s\) \['nope'\]"),
        (["--seeds", "0", "0"], ValueError, r"seeds lists a seed twice: \[0, 0\]"),
        (["--soft_weight", "1.5"], ValueError, r"soft_weight must be in \(0, 1\).*got 1.5"),
        (["--warm_start_steps", "0"], ValueError, "warm_start_steps must be an integer >= 1, got 0"),
        (["--protocol", "later"], SystemExit, None),
        (["--policy_kwargs", "{nope"], ValueError, "policy_kwargs is not valid JSON"),
        (["--policy_kwargs", '{"soft": {"weight": 0.1}}', "--policies", "uniform"], ValueError, r"names \['soft'\]"),
        (["--max_steps", "-1"], ValueError, "max_steps must be >= 1"),
        (["--load_in_4bit"], ValueError, "ablate trains full-precision students"),
        (["--rock_set", "no/such/rocks.json"], FileNotFoundError, None),
        (["--dataset", "no/such/file.jsonl"], FileNotFoundError, "does not exist"),
        (["--num_train_prompts", "100"], ValueError, r"= 104 but .* has 24 rows"),
        (["--policies", "rock_online", "--policy_kwargs", '{"rock_online": {"nope": 1}}'], ValueError, "'nope'"),
        (["--policies", "soft", "--policy_kwargs", '{"soft": {"weight": -1}}'], ValueError, "weight"),
    ],
)
def test_bad_arguments_fail_before_models_and_leave_no_directory(pair, tmp_path, no_training, extra, error, message):
    out = tmp_path / "never"
    with pytest.raises(error, match=message):
        command.main(argv(pair, out, *extra))
    assert not out.exists()


def test_yaml_config_and_flags(tmp_path):
    config = tmp_path / "ablate.yaml"
    config.write_text(yaml.safe_dump({"policies": ["uniform", "soft"], "seeds": [0, 1, 2], "max_steps": 7,
                                      "protocol": "from_scratch"}))  # fmt: skip
    a, args, _ = parse_arguments(["--config", str(config), "--seeds", "4", "5"])
    assert (a.policies, a.seeds, a.protocol, args.max_steps, args.output_dir) == (
        ["uniform", "soft"], [4, 5], "from_scratch", 7, "runs/ablate"
    )
    assert AblateArguments().policies == ["uniform", "rock_freeze", "random_matched", "rock_online", "soft"]


# ------------------------------------------------------------------------------------------------ summary ----
def crafted_run(policy, seed, correct, divergence, step_seconds):
    problems = [
        {"index": i, "correct": c, "on_policy_divergence": d, "teacher_forced_divergence": None, "looped": not c,
         "finished": c, "repeated_ngram_fraction": 0.0}
        for i, (c, d) in enumerate(zip(correct, divergence))
    ]  # fmt: skip
    metrics = {
        "accuracy": sum(correct) / len(correct),
        "on_policy_divergence": sum(d for d in divergence if d is not None) / len(divergence),
        "teacher_forced_divergence": None,
        "loop_rate": 1 - sum(correct) / len(correct),
        "finished_rate": sum(correct) / len(correct),
        "distinct_2": 0.5,
        "step_seconds": step_seconds,
        "projected_fraction": 1.0 if policy == "uniform" else 0.8,
    }
    return {"format": "hf_rockopd.ablate.run", "policy": policy, "seed": seed, "metrics": metrics, "problems": problems}


def test_summary_on_crafted_runs(tmp_path):
    """uniform solves 18 of 20 problems per seed, rock_freeze 8: a clear paired difference; divergences equal."""
    for seed in range(3):
        uniform = [i != seed for i in range(20)][:18] + [False, True]
        frozen = [i < 8 for i in range(20)]
        for policy, correct, seconds in (("uniform", uniform, 2.0 + seed), ("rock_freeze", frozen, 1.0 + seed)):
            run = crafted_run(policy, seed, correct, [0.5] * 20, seconds)
            path = tmp_path / "runs" / policy / f"seed_{seed}" / "result.json"
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps(run))
    (tmp_path / "start_eval.json").write_text(json.dumps({"metrics": {"accuracy": 0.25, "loop_rate": None}}))
    out = write_summary(tmp_path)
    summary = out["summary"]
    stats = summary.stats
    assert stats.policies == ("uniform", "rock_freeze") and not summary.untested  # the baseline first
    # Teacher-forced divergence is not measured yet (None): left out, and said so.
    assert "teacher_forced_divergence" not in stats.metrics and {"accuracy", "step_seconds"} <= set(stats.metrics)
    accuracy = stats.summary("rock_freeze", "accuracy")
    assert accuracy.mean == pytest.approx(0.4) and accuracy.seed_means == pytest.approx((0.4, 0.4, 0.4))
    step = stats.summary("uniform", "step_seconds")
    assert step.mean == 3.0 and step.ci_low == pytest.approx(3.0 - 4.303 * 1.0 / 3**0.5, abs=1e-3)
    difference = stats.difference("rock_freeze", "accuracy")
    assert difference.delta == pytest.approx(0.4 - 0.9) and difference.num_problems == 20
    assert difference.ci_high < 0 and difference.p_value < 0.01 and difference.q_value >= difference.p_value
    assert stats.difference("rock_freeze", "on_policy_divergence").p_value == 1.0
    assert stats.difference("rock_freeze", "step_seconds").delta == pytest.approx(-1.0)
    table = (tmp_path / "summary.md").read_text()
    assert "| rock_freeze | 3 | 0.400 [0.400, 0.400] |" in table and "| rock_freeze | accuracy | -0.500 |" in table
    assert "Start weights of every run (reference, not compared): accuracy 0.250." in table
    assert "Not in every run, so not compared: teacher_forced_divergence" in table
    assert (tmp_path / "summary.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["stats"]["baseline"] == "uniform" and len(saved["runs"]) == 6


def test_run_outcomes_and_a_missing_baseline():
    run = crafted_run("soft", 0, [True, False], [0.5, None], 1.0)
    outcomes = run_outcomes(run).metrics
    assert list(outcomes["accuracy"]) == [1.0, 0.0] and "on_policy_divergence" not in outcomes  # one is missing
    assert list(outcomes["step_seconds"]) == [1.0]
    # Without a uniform run the first policy given is the baseline.
    runs = [crafted_run(p, 0, [True, False], [0.5, 0.5], 1.0 + (p == "soft")) for p in ("soft", "rock_freeze")]
    summary = summarize(runs, order=["rock_freeze", "soft"], n_resamples=100)
    assert summary.stats.baseline == "rock_freeze"
    # One seed: a run-level metric is one number per policy, so it is summarized but not tested.
    assert "step_seconds" not in summary.stats.metrics and "accuracy" in summary.stats.metrics
    assert summary.summary("soft", "step_seconds").mean == 2.0 and "step_seconds" in summary.metrics
    with pytest.raises(ValueError, match="No finished run"):
        summarize([])


@pytest.mark.parametrize("module", ["arguments", "compute", "measures", "runner", "summary"])
def test_docstring_examples(module, tmp_path, monkeypatch):
    """tests/test_docstrings.py reads the package's top-level modules only; the examples here run all the same."""
    import doctest
    import importlib
    import re

    fence = re.compile(r"^[ \t]*```[a-z]*[ \t]*$", flags=re.MULTILINE)

    class Parser(doctest.DocTestParser):
        def parse(self, string, name="<string>"):
            return super().parse(fence.sub("", string), name)

    monkeypatch.chdir(tmp_path)
    for test in doctest.DocTestFinder(parser=Parser()).find(importlib.import_module(f"hf_rockopd.ablate.{module}")):
        result = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE).run(test)
        assert result.failed == 0, test.name
