"""Shared fixtures: tiny offline models, a ChatML tokenizer, prompt datasets and configs. Nothing touches the Hub."""

import importlib.util
import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from datasets import Dataset
from hypothesis import settings

from hf_rockopd import RockOPDConfig
from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer


torch.set_num_threads(2)

# Property tests draw the same cases on every run, so CI results are reproducible; explore new cases with
# `HYPOTHESIS_PROFILE=explore pytest` (and `HF_ROCKOPD_FUZZ_RANDOM=1` for tests/test_fuzz_losses.py).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _isolated_policy_registry():
    """Policies a test registers (README examples, custom policies) must not leak into other tests' error messages."""
    from hf_rockopd import policies

    saved = dict(policies._REGISTRY)
    yield
    policies._REGISTRY.clear()
    policies._REGISTRY.update(saved)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def student(tokenizer):
    return build_tiny_causal_lm(tokenizer, seed=0)


@pytest.fixture
def teacher(tokenizer):
    return build_tiny_causal_lm(tokenizer, seed=1, num_hidden_layers=3)


def qa(i: int) -> tuple[str, str]:
    """Question and answer of row `i` of every test dataset (both trainers' datasets are built from it)."""
    return f"What is {i} + {i + 1}?", f"{i} + {i + 1} = {2 * i + 1}. The answer is {2 * i + 1}."


def make_dataset(n: int = 16) -> Dataset:
    return Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": qa(i)[0]},
                    {"role": "assistant", "content": qa(i)[1]},
                ]
            }
            for i in range(n)
        ]
    )


@pytest.fixture
def dataset():
    return make_dataset()


def write_distill_inputs(work, question: str = "What is {i} + 2?", n: int = 24) -> None:
    """What a tiny `hf-rockopd distill` reads: a teacher saved with its tokenizer in `work/teacher` (4 layers, so a
    2-layer student can be pruned from it) and `n` GSM8K-style problems in `work/problems.jsonl`, row `i` asking
    `question.format(i=i)` with the reference `#### {i + 2}`."""
    import json

    tokenizer = build_tiny_tokenizer()
    build_tiny_causal_lm(tokenizer, hidden_size=64, num_hidden_layers=4, seed=1).save_pretrained(work / "teacher")
    tokenizer.save_pretrained(work / "teacher")
    with open(work / "problems.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"question": question.format(i=i), "answer": f"#### {i + 2}"}) + "\n")


# The tests' training settings, shared by both trainers' configs (the completion length is named per config).
TRAIN_SETTINGS = dict(
    per_device_train_batch_size=4,
    max_steps=2,
    learning_rate=1e-2,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    rock_policy="uniform",
    seed=0,
    disable_tqdm=True,
)
COMPLETION_TOKENS = 12


def make_args(output_dir, **overrides) -> RockOPDConfig:
    defaults = dict(output_dir=str(output_dir), max_new_tokens=COMPLETION_TOKENS, **TRAIN_SETTINGS)
    defaults.update(overrides)
    return RockOPDConfig(**defaults)


@pytest.fixture
def args_factory(tmp_path):
    return lambda **kw: make_args(tmp_path / "out", **kw)


@pytest.fixture(params=["gkd", "distillation"])
def kind(request):
    """Each rock-token trainer in turn (see tests/trainer_kinds.py): `RockOPDTrainer` and `RockDistillationTrainer`."""
    from trainer_kinds import KINDS

    return KINDS[request.param]


@pytest.fixture
def kind_args(kind, tmp_path):
    return lambda **kw: kind.args(tmp_path / "out", **kw)


REAL_BUDGET_REPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "reports",
                                  "real_budget")


def real_budget_script(name: str):
    """A script of the real-budget report (`examples/reports/real_budget/<name>.py`), imported as a module."""
    spec = importlib.util.spec_from_file_location(f"real_budget_{name}", os.path.join(REAL_BUDGET_REPORT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
