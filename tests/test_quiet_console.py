"""A LoRA student saved and loaded offline prints no warning: peft's Hub lookup is answered locally, not hidden.

peft's `save_pretrained` asks the Hub for the base model's `config.json` (to see whether the vocabulary was resized)
when the base is named by a Hub id: offline it warned "Unable to fetch remote file ..." / "Could not find a config file
in ... - will assume that the vocabulary was not modified". The tiny teacher here sits in a Hugging Face cache of its
own under a Hub id, as a downloaded model does, so the run takes that path.
"""

import json
import os
import re
import subprocess
import sys
import warnings

import pytest

from hf_rockopd.console import quiet_training
from hf_rockopd.models import SMOLLM2_ID, build_tiny_causal_lm, build_tiny_tokenizer, converted_model_dir
from hf_rockopd.models.adapters import adapter_embedding_layers, local_config_dir


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ID = "tiny-org/tiny-teacher"
WARNING_LINE = re.compile(r"warning|unable to fetch|could not find a config file", re.IGNORECASE)


def fake_hub_cache(hub, model, tokenizer, repo_id=REPO_ID):
    """Save `model` into `hub` laid out as the Hugging Face cache holds a downloaded `repo_id`."""
    repo = os.path.join(hub, "models--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    model.save_pretrained(os.path.join(repo, "snapshots", commit))
    tokenizer.save_pretrained(os.path.join(repo, "snapshots", commit))
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as handle:
        handle.write(commit)
    return hub


def offline_env(tmp):
    env = {k: v for k, v in os.environ.items() if k not in ("TRL_EXPERIMENTAL_SILENCE", "PYTHONWARNINGS")}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(tmp / "hub"),
        HF_ROCKOPD_CACHE=str(tmp / "converted"),
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    )
    return env


def warning_lines(text):
    return [line for line in text.splitlines() if WARNING_LINE.search(line)]


@pytest.fixture(scope="module")
def offline_lora_run(tmp_path_factory):
    """`hf-rockopd distill --use_peft` offline on the cached tiny teacher: one step, its checkpoint, the final save."""
    tmp = tmp_path_factory.mktemp("quiet")
    tokenizer = build_tiny_tokenizer()
    fake_hub_cache(tmp / "hub", build_tiny_causal_lm(tokenizer, hidden_size=64, num_hidden_layers=4, seed=1), tokenizer)
    data = tmp / "gsm8k.jsonl"
    data.write_text("".join(
        json.dumps({"question": f"What is {i} + 2?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}) + "\n"
        for i in range(8)
    ))
    out = tmp / "run"
    command = [
        sys.executable, "-m", "hf_rockopd.cli", "distill", "--teacher", REPO_ID, "--student_num_layers", "2",
        "--dataset", str(data), "--num_train_prompts", "4", "--num_eval_problems", "2", "--eval_max_new_tokens", "4",
        "--eval_batch_size", "2", "--max_steps", "1", "--per_device_train_batch_size", "2", "--max_new_tokens", "4",
        "--save_strategy", "steps", "--save_steps", "1", "--rock_policy", "uniform", "--use_peft", "--lora_r", "4",
        "--output_dir", str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=offline_env(tmp), cwd=tmp, timeout=300)
    return tmp, out, done


def test_offline_lora_distill_prints_no_warning(offline_lora_run):
    _, out, done = offline_lora_run
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-3000:]
    for saved in (out, out / "checkpoint-1"):
        assert (saved / "adapter_config.json").is_file() and (saved / "adapter_model.safetensors").is_file()
    # The adapter names its base by Hub id: the case in which peft looked the base's config up on the Hub.
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == REPO_ID
    assert not warning_lines(console), "\n".join(warning_lines(console))


def test_loading_the_adapter_offline_asks_no_hub(offline_lora_run):
    """The model card's recipe, offline: the cached base, pruned to the kept layers, with the saved adapter.

    `hf-rockopd eval` takes full models only (an adapter directory is refused with a message), so the adapter is
    loaded the way its card says."""
    tmp, out, done = offline_lora_run
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    kept = json.loads((out / "run_report.json").read_text())["student"]["kept_layers"]
    code = (
        "import sys, torch\n"
        "from peft import PeftModel\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from hf_rockopd.models import prune_decoder_layers\n"
        f"base = prune_decoder_layers(AutoModelForCausalLM.from_pretrained({REPO_ID!r}), keep={kept})\n"
        "model = PeftModel.from_pretrained(base, sys.argv[1])\n"
        "tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "ids = tokenizer('What is 1 + 2?', return_tensors='pt')\n"
        "new = model.generate(**ids, max_new_tokens=2, do_sample=False)[0, ids['input_ids'].shape[1]:]\n"
        "assert len(new) >= 1\n"
        "merged = model.merge_and_unload()\n"
        "assert merged.config.num_hidden_layers == len(base.model.layers)\n"
        "print('loaded')\n"
    )
    loaded = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True,
                            env=offline_env(tmp), cwd=tmp, timeout=300)
    console = loaded.stdout + loaded.stderr
    assert loaded.returncode == 0 and "loaded" in loaded.stdout, console[-3000:]
    # This is plain peft and transformers, outside the package's scoped filters (hf_rockopd.console), so their own
    # deprecation notice (peft's PeftModel reads transformers' renamed `is_gradient_checkpointing`) still shows, and
    # only it; no Hub lookup notice does.
    others = [line for line in warning_lines(console)
              if "`is_gradient_checkpointing` is deprecated" not in line and line.strip() != "warnings.warn("]
    assert not others, "\n".join(others)


# --------------------------------------------------------------------------------- the decision, in-process ----
@pytest.fixture
def cached_base(tmp_path, monkeypatch):
    """A tiny base in a Hugging Face cache of its own, under a Hub id, loaded the way the cache is read offline."""
    from huggingface_hub import constants

    tokenizer = build_tiny_tokenizer()
    fake_hub_cache(tmp_path / "hub", build_tiny_causal_lm(tokenizer, seed=1), tokenizer)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ROCKOPD_CACHE", str(tmp_path / "converted"))
    return tokenizer


def lora(model, **kwargs):
    from peft import LoraConfig, get_peft_model

    with quiet_training():  # peft reads transformers' renamed `is_gradient_checkpointing` while it wraps
        return get_peft_model(model, LoraConfig(r=2, target_modules="all-linear", **kwargs))


def base_named(name, **kwargs):
    model = build_tiny_causal_lm(build_tiny_tokenizer(), seed=1, **kwargs)
    model.name_or_path = name
    return model


def peft_auto_saves_embeddings(model):
    """peft's own `save_embedding_layers="auto"`, with the base named by its local copy (read there, no lookup)."""
    from peft.utils import get_peft_model_state_dict

    config = model.peft_config["default"]
    name, config.base_model_name_or_path = config.base_model_name_or_path, local_config_dir(REPO_ID)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Setting `save_embedding_layers` to `True` as ... resized"
            state = get_peft_model_state_dict(model, save_embedding_layers="auto")
    finally:
        config.base_model_name_or_path = name
    return any("embed_tokens" in key for key in state)


def test_local_config_dir_finds_a_path_and_the_cache_only(cached_base, tmp_path):
    found = local_config_dir(REPO_ID)
    assert found is not None and os.path.isfile(os.path.join(found, "config.json"))
    assert found.startswith(str(tmp_path / "hub"))
    assert local_config_dir(str(tmp_path / "hub")) is None  # a directory without config.json
    assert local_config_dir("tiny-org/not-downloaded") is None
    # An offline GGUF source's converted copy (HF_ROCKOPD_CACHE), as resolve_causal_lm finds it.
    converted = converted_model_dir(SMOLLM2_ID)
    assert converted.startswith(str(tmp_path / "converted")) and local_config_dir(SMOLLM2_ID) is None
    build_tiny_causal_lm(cached_base).config.save_pretrained(converted)
    assert local_config_dir(SMOLLM2_ID) == converted


def test_the_decision_matches_peft_and_never_asks_the_hub(cached_base, tmp_path, monkeypatch):
    import peft.utils.other

    def no_hub(*args, **kwargs):
        raise AssertionError("peft asked the Hub")

    monkeypatch.setattr(peft.utils.other, "file_exists", no_hub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # peft would ask the Hub now, were it left to decide
    same = lora(base_named(REPO_ID))
    assert adapter_embedding_layers(same) is False and not peft_auto_saves_embeddings(same)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same.save_pretrained(tmp_path / "same", save_embedding_layers=adapter_embedding_layers(same))
    assert not [str(w.message) for w in caught]

    resized = base_named(REPO_ID)
    resized.resize_token_embeddings(resized.config.vocab_size + 8)  # a vocabulary grown since the base: saved
    resized = lora(resized)
    assert adapter_embedding_layers(resized) is True and peft_auto_saves_embeddings(resized)

    # Cases peft decides without the Hub, or only it can: left to it.
    assert adapter_embedding_layers(lora(base_named("tiny-org/not-downloaded"))) is None
    assert adapter_embedding_layers(lora(base_named(local_config_dir(REPO_ID)))) is None
    targeted = lora(base_named(REPO_ID))
    targeted.peft_config["default"].target_modules = {"q_proj", "embed_tokens"}
    assert adapter_embedding_layers(targeted) is None
    assert adapter_embedding_layers(base_named(REPO_ID)) is None  # not a PEFT model


def test_the_trainer_saves_a_lora_student_of_a_hub_id_quietly(cached_base, tmp_path, monkeypatch):
    """RockOPDTrainer's save (`_save`: the final one and checkpoints) hands peft the locally decided flag."""
    import peft.utils.other
    from datasets import Dataset
    from peft import LoraConfig

    from hf_rockopd import RockOPDConfig, RockOPDTrainer

    def no_hub(*args, **kwargs):
        raise AssertionError("peft asked the Hub")

    monkeypatch.setattr(peft.utils.other, "file_exists", no_hub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    student, teacher = base_named(REPO_ID), base_named(REPO_ID, num_hidden_layers=3)
    prompts = Dataset.from_list([{"messages": [{"role": "user", "content": f"What is {i} + 1?"}]} for i in range(2)])
    args = RockOPDConfig(output_dir=str(tmp_path / "out"), max_steps=1, report_to="none", save_strategy="no",
                         per_device_train_batch_size=2, max_new_tokens=2, rock_policy="uniform")
    trainer = RockOPDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=prompts,
                             processing_class=cached_base, peft_config=LoraConfig(r=2, target_modules="all-linear"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.save_model(str(tmp_path / "saved"))
    assert not [str(w.message) for w in caught]
    assert (tmp_path / "saved" / "adapter_model.safetensors").is_file()
    assert "save_pretrained" not in vars(trainer.model)  # the flag went with that one call only
