"""`hf-rockopd`'s one command-line dialect: dataclass options, `--config`, range checks naming the field, `--help`,
the deprecated spellings (one release, FutureWarning), `--policy.NAME` flags and TRL's ModelConfig for LoRA/4-bit.

Everything here parses only: no model is loaded (the end-to-end runs are in the tests of each subcommand).
"""

import dataclasses
import json
from dataclasses import dataclass, field

import pytest
import torch
import yaml

from hf_rockopd.cli import commands, main
from hf_rockopd.commands import policy_flags
from hf_rockopd.commands.distill import parse_arguments
from hf_rockopd.commands.lab import ScoreArguments
from hf_rockopd.policies import TokenPolicy, get_policy, register_policy


def parse(name, argv):
    return commands()[name].parse(argv)


def values(parsed):
    return {k: v for arguments in parsed for k, v in dataclasses.asdict(arguments).items()}


# ------------------------------------------------------------------------------------------ old spellings ----
OLD_SPELLINGS = [
    ("analyze collect",
     ["--student", "s", "--teacher", "t", "--prompts", "p.jsonl", "--out", "o", "--max-new-tokens", "8",
      "--batch-size", "4", "--no-grad-cosine", "--prompt-field", "q"],
     "--max_new_tokens", {"max_new_tokens": 8, "batch_size": 4, "no_grad_cosine": True, "prompt_field": "q"}),
    ("analyze score", ["t", "--top-k", "3", "--exclude-top-frequent", "1", "--min-count", "1"], "--top_k",
     {"table": "t", "top_k": 3, "exclude_top_frequent": 1, "min_count": 1}),
    ("analyze stability", ["t", "--ks", "2", "3", "--exclude-top-frequent", "1"], "--exclude_top_frequent",
     {"ks": [2, 3], "exclude_top_frequent": 1}),
    ("analyze controls", ["t", "--rock-set", "r.json"], "--rock_set", {"table": "t", "rock_set": "r.json"}),
    ("analyze compare", ["e", "l", "--rock-set", "r.json"], "--rock_set", {"early": "e", "late": "l"}),
    ("analyze gradients", ["t", "--rock-set", "r.json"], "--rock_set", {"rock_set": "r.json"}),
    ("analyze knockout", ["--model", "m", "--problems", "p", "--rock-set", "r", "--max-new-tokens", "4"],
     "--max_new_tokens", {"rock_set": "r", "max_new_tokens": 4}),
    ("analyze report", ["t", "--rock-set", "r", "--top-k", "5"], "--top_k", {"rock_set": "r", "top_k": 5}),
    ("eval",
     ["--model", "m", "--problems", "p", "--prompt-column", "q", "--answer-column", "a", "--batch-size", "2"],
     "--prompt_column", {"prompt_column": "q", "answer_column": "a", "batch_size": 2}),
    ("card", ["run", "--model-id", "me/x"], "--model_id", {"run_dir": "run", "model_id": "me/x"}),
]


@pytest.mark.parametrize("name, argv, new, expected", OLD_SPELLINGS, ids=[case[0] for case in OLD_SPELLINGS])
def test_old_hyphen_spellings_parse_with_a_deprecation_warning(name, argv, new, expected):
    with pytest.warns(FutureWarning, match=f"is deprecated and will be removed in the next release; use {new}"):
        parsed = parse(name, argv)
    assert expected.items() <= values(parsed).items()
    # The new spellings give the same options, without a warning.
    canonical = ["--" + a[2:].replace("-", "_") if a.startswith("--") else a for a in argv]
    with warnings_as_errors():
        assert parse(name, canonical) == parsed


class warnings_as_errors:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("error", message=".*will be removed in the next release", category=FutureWarning)

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)


def test_old_distill_spellings_map_onto_trl_model_config(tmp_path):
    with pytest.warns(FutureWarning) as caught:
        _, args, model_args = parse_arguments(["--use_lora", "--student_4bit", "--lora_r", "4", "--max-steps", "3"])
    messages = " ".join(str(w.message) for w in caught)
    assert "--use_lora is deprecated" in messages and "use --use_peft" in messages
    assert "--student_4bit is deprecated" in messages and "use --load_in_4bit" in messages
    assert "use --max_steps" in messages
    assert model_args.use_peft and model_args.load_in_4bit and model_args.lora_r == 4 and args.max_steps == 3
    # The old YAML keys too, and the old comma-separated target modules.
    config = tmp_path / "old.yaml"
    config.write_text(yaml.safe_dump({"use_lora": True, "lora_target_modules": "q_proj,v_proj"}))
    with pytest.warns(FutureWarning, match="use --use_peft"):
        _, _, model_args = parse_arguments(["--config", str(config)])
    assert model_args.use_peft and model_args.lora_target_modules == ["q_proj", "v_proj"]
    with pytest.warns(FutureWarning, match="comma-separated lora_target_modules is deprecated"):
        _, _, model_args = parse_arguments(["--lora_target_modules", "q_proj,v_proj"])
    assert model_args.lora_target_modules == ["q_proj", "v_proj"]


# ----------------------------------------------------------------------------------------- --config, ranges ----
def test_config_file_for_a_lab_subcommand(tmp_path, capsys):
    config = tmp_path / "score.yaml"
    config.write_text(yaml.safe_dump({"table": str(tmp_path / "early"), "top_k": 7, "exclude_top_frequent": 1}))
    args, selection = parse("analyze score", ["--config", str(config), "--top_k", "3"])
    assert args == ScoreArguments(table=str(tmp_path / "early"), top_k=3)  # the command line wins over the file
    assert selection.exclude_top_frequent == 1 and selection.min_count == 2
    args, _ = parse("analyze score", [str(tmp_path / "late"), "--config", str(config)])
    assert args.table == str(tmp_path / "late") and args.top_k == 7
    # The file's values reach the command: its table is the one looked for.
    assert main(["analyze", "score", "--config", str(config)]) == 2
    assert str(tmp_path / "early") in capsys.readouterr().err
    config.write_text(yaml.safe_dump({"table": "t", "top_kk": 3}))
    assert main(["analyze", "score", "--config", str(config)]) == 2
    assert "top_kk" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["analyze", "score", "t", "--top_k", "0"], "top_k must be an integer >= 1, got 0."),
        (["analyze", "score", "t", "--coverage", "1.5"], r"coverage must be in (0, 1], got 1.5."),
        (["analyze", "stability", "t", "--ks", "5", "0"], "ks must be an integer >= 1, got [5, 0]."),
        (["analyze", "knockout", "--model", "m", "--problems", "p", "--rock_set", "r", "--alpha", "1.5"],
         "alpha must be in (0, 1), got 1.5."),
        (["analyze", "collect", "--student", "s", "--teacher", "t", "--prompts", "p", "--out", "o",
          "--temperature", "0"], "temperature must be in (0, inf), got 0.0."),
        (["eval", "--model", "m", "--problems", "p", "--batch_size", "0"], "batch_size must be an integer >= 1, got 0."),
        (["distill", "--lora_dropout", "1.5"], "lora_dropout must be in [0, 1), got 1.5."),
        (["distill", "--model_name_or_path", "x"], "model_name_or_path is not an option of hf-rockopd distill"),
    ],
)
def test_an_out_of_range_value_names_the_field(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hf-rockopd {' '.join(argv[:2] if argv[0] == 'analyze' else argv[:1])}: error: ")
    assert message in err


def test_a_missing_positional_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_code:
        main(["analyze", "compare", "early", "--rock_set", "r.json"])
    assert exit_code.value.code == 2 and "required: LATE (or --late)" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(commands()))
def test_help_lists_every_option(name):
    command = commands()[name]
    text = command.parser().format_help()
    for arguments in command.arguments:
        for f in dataclasses.fields(arguments):
            if f.init:
                assert f"--{f.name} " in text or f"--{f.name}\n" in text, f"--{f.name} missing from {name} --help"
    assert "--config" in text
    assert "--max-new-tokens" not in text and "--batch-size" not in text  # one spelling


def test_top_level_and_analyze_usage(capsys):
    assert main(["--help"]) == 0 and "analyze score" in capsys.readouterr().out
    assert main(["analyze"]) == 0 and "analyze knockout" in capsys.readouterr().out
    assert main(["analyse", "score"]) == 2 and "unknown command 'analyse'" in capsys.readouterr().err


# --------------------------------------------------------------------------------------- --policy.NAME ----
@dataclass
class StandInConfig:
    """A stand-in for core's typed policy options (RockOnlineConfig & co.)."""

    top_k: int = field(default=10, metadata={"help": "ids kept"})
    scale: float = field(default=1.0, metadata={"help": "weight of the kept ids"})
    label: str = field(default="x", metadata={"help": "a name"})


class StandInPolicy(TokenPolicy):
    def __init__(self, top_k: int = 10, scale: float = 1.0, label: str = "x"):
        self.options = StandInConfig(top_k, scale, label)

    def weights(self, batch):
        return batch.mask.to(torch.float32) * self.options.scale


@pytest.fixture
def standin(monkeypatch):
    register_policy("standin", StandInPolicy)
    monkeypatch.setattr(policy_flags, "policy_config_class", lambda name: StandInConfig if name == "standin" else None)


def test_policy_flags_reach_the_policy(standin, tmp_path):
    argv = ["--rock_policy", "standin", "--policy.top_k", "7", "--policy.scale", "2", "--policy.label", "007"]
    _, args, _ = parse_arguments(argv)
    assert args.rock_policy_kwargs == {"top_k": 7, "scale": 2.0, "label": "007"}  # typed by the fields
    assert get_policy(args.rock_policy, **args.rock_policy_kwargs).options == StandInConfig(7, 2.0, "007")
    # Merged over --rock_policy_kwargs (JSON), the flags winning; a YAML file may hold them too.
    _, args, _ = parse_arguments(["--rock_policy", "standin", "--rock_policy_kwargs", json.dumps({"top_k": 3, "scale": 0.5}),
                                  "--policy.top_k", "9"])
    assert args.rock_policy_kwargs == {"top_k": 9, "scale": 0.5}
    config = tmp_path / "policy.yaml"
    config.write_text(yaml.safe_dump({"rock_policy": "standin", "policy.top_k": 4}))
    _, args, _ = parse_arguments(["--config", str(config)])
    assert args.rock_policy_kwargs == {"top_k": 4}
    assert "standin: ids kept" in commands()["distill"].parser().format_help()


def test_policy_flags_of_another_policy_are_refused(standin, capsys):
    assert main(["distill", "--rock_policy", "uniform", "--policy.top_k", "5"]) == 2
    assert "'uniform' has no typed options, so --policy.top_k cannot set one" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not used by the HfArgumentParser"):
        parse_arguments(["--rock_policy", "standin", "--policy.nope", "1"])


def test_rock_policy_kwargs_json_still_works():
    _, args, _ = parse_arguments(["--rock_policy", "rock_online", "--rock_policy_kwargs", '{"top_k": 10}'])
    assert args.rock_policy_kwargs == {"top_k": 10}
    _, args, _ = parse_arguments(["--rock_policy", "uniform"])
    assert args.rock_policy_kwargs == {}


# --------------------------------------------------------------------------------- TRL's ModelConfig ----
def old_lora_config(r=16, alpha=32, dropout=0.05, targets="all-linear"):
    """What DistillArguments built from --use_lora and its lora flags before TRL's ModelConfig took them over."""
    from peft import LoraConfig

    return LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, task_type="CAUSAL_LM",
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()],
    )


@pytest.mark.parametrize(
    "new, old",
    [
        (["--use_peft"], {}),
        (["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.1", "--lora_target_modules",
          "q_proj", "v_proj"], {"r": 4, "alpha": 8, "dropout": 0.1, "targets": "q_proj,v_proj"}),
        (["--load_in_4bit", "--lora_r", "8"], {"r": 8}),
    ],
)
def test_model_config_lora_flags_give_the_old_lora_config(new, old):
    from trl import get_peft_config

    _, _, model_args = parse_arguments(new)
    assert get_peft_config(model_args).to_dict() == old_lora_config(**old).to_dict()
    _, _, model_args = parse_arguments([])
    assert get_peft_config(model_args) is None  # no --use_peft: the full student trains


def test_4bit_quantization_config_is_the_old_one():
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    from hf_rockopd.models.student_config import quantization_config as _quantization_config

    _, _, model_args = parse_arguments(["--load_in_4bit"])
    old = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32,
    )
    assert _quantization_config(model_args).to_dict() == old.to_dict()
    assert _quantization_config(parse_arguments([])[2]) is None
