"""The README's and the docs' code runs: the quickstart (in the README and in docs/quickstart.md, the same block; run
on tiny local models, offline), the custom-policy example of docs/policies.md, the demo."""

import json
import os
import re
import runpy
import sys

import pytest
import torch

from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "train.jsonl")


def read(relative_path: str) -> str:
    with open(os.path.join(ROOT, relative_path), encoding="utf-8") as f:
        return f.read()


def readme() -> str:
    return read("README.md")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def quickstart(text: str) -> str:
    """The one Python block between the quickstart markers of a page."""
    assert text.count("<!-- quickstart:start -->") == 1 and text.count("<!-- quickstart:end -->") == 1
    (code,) = python_blocks(text.split("<!-- quickstart:start -->")[1].split("<!-- quickstart:end -->")[0])
    return code


def test_quickstart_is_the_same_in_the_readme_and_the_docs():
    assert quickstart(readme()) == quickstart(read("docs/quickstart.md")), (
        "The quickstart of README.md and docs/quickstart.md differ: keep the two blocks identical."
    )


def substitute(code: str, old: str, new: str) -> str:
    assert code.count(old) == 1, f"the quickstart no longer contains {old!r}; update tests/test_readme.py"
    return code.replace(old, new)


def test_quickstart_runs_offline(tmp_path, monkeypatch):
    code = quickstart(readme())  # docs/quickstart.md holds the same block (test above)
    assert len(code.strip().splitlines()) <= 20

    tokenizer = build_tiny_tokenizer()
    for name, layers, seed in (("teacher", 3, 1), ("student", 2, 0)):
        build_tiny_causal_lm(tokenizer, num_hidden_layers=layers, seed=seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    rows = []
    if os.path.isfile(GSM8K):
        with open(GSM8K) as f:
            rows = [json.loads(line) for _, line in zip(range(8), f)]
    rows = rows or [{"question": f"What is {i}+{i}?", "answer": f"#### {2 * i}"} for i in range(8)]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    code = substitute(code, '"HuggingFaceTB/SmolLM2-360M-Instruct"', repr(str(tmp_path / "teacher")))
    code = substitute(code, '"HuggingFaceTB/SmolLM2-135M-Instruct"', repr(str(tmp_path / "student")))
    code = substitute(
        code,
        'load_dataset("openai/gsm8k", "main", split="train[:256]")',
        f'load_dataset("json", data_files={str(data)!r}, split="train")',
    )
    code = substitute(code, "max_steps=50", "max_steps=2, report_to='none'")
    code = substitute(code, "max_new_tokens=128", "max_new_tokens=8")
    code = substitute(code, 'output_dir="smollm2-rockopd"', f"output_dir={str(tmp_path / 'out')!r}")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README-quickstart", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 2
    assert any("lora_" in name for name, _ in trainer.model.named_parameters())
    assert os.path.isfile(tmp_path / "out" / "rock_tokens.json")


def test_custom_policy_example_runs():
    blocks = [b for b in python_blocks(read("docs/policies.md")) if "register_policy" in b]
    assert len(blocks) == 1
    code = blocks[0].replace('@register_policy("halve_digits")', '@register_policy("halve_digits", overwrite=True)')
    namespace: dict = {}
    exec(compile(code, "docs/policies.md", "exec"), namespace)
    from hf_rockopd.policies import TokenBatch, get_policy

    policy = get_policy("halve_digits", digit_ids=[3])
    batch = TokenBatch(torch.tensor([[3, 4, 3]]), torch.tensor([[True, True, False]]), step=0)
    assert policy.weights(batch).tolist() == [[0.5, 1.0, 0.0]]


def test_demo_script_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tiny_smoke.py", "--output-dir", str(tmp_path / "demo"), "--steps", "4"])
    runpy.run_path(os.path.join(ROOT, "examples", "tiny_smoke.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "rock tokens" in out
    assert os.path.isfile(tmp_path / "demo" / "rock_tokens.json")
    assert os.path.isdir(tmp_path / "demo" / "checkpoint-2")
