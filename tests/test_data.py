"""Any dataset: TRL's formats (prompt text or chat, messages, question/answer), local file types, column overrides,
the bad-columns error, and the resolver's order and its error. Nothing touches the Hub (it is replaced where reached)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from datasets import Dataset

from hf_rockopd.data import (
    DATA_DIR_ENV,
    detect_columns,
    load_problems,
    resolve_dataset,
    split_dataset,
)
from hf_rockopd.data import resolve as resolve_module

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
USER = {"role": "user", "content": "What is 1 + 1?"}
ROWS = {
    "question_answer": [{"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}],
    "math": [{"problem": "What is 1 + 1?", "solution": "It is $\\boxed{2}$.", "answer": "2"}],
    "prompt_text": [{"prompt": "What is 1 + 1?", "completion": "2"}],
    "prompt_chat": [{"prompt": [USER], "solution": "2"}],  # trl-lib/DeepMath-103K's shape
    "prompt_only": [{"prompt": "What is 1 + 1?"}],
    "messages": [{"messages": [USER, {"role": "assistant", "content": "\\boxed{2}"}]}],
}
EXPECTED = {
    "question_answer": "1 + 1 = 2\n#### 2",
    "math": "2",
    "prompt_text": "2",
    "prompt_chat": "2",
    "prompt_only": None,
    "messages": "\\boxed{2}",
}


def _write(path: Path, rows: list[dict]) -> Path:
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif suffix == ".json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    elif suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path)
    elif suffix == ".csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    return path


@pytest.mark.parametrize("kind", sorted(ROWS))
def test_each_format_gives_prompt_and_reference(kind, tmp_path):
    path = _write(tmp_path / "data.jsonl", ROWS[kind])
    [(chat, reference)] = load_problems(path)
    assert chat == [USER] and reference == EXPECTED[kind]
    # The same rows as a Dataset object.
    assert load_problems(Dataset.from_list(ROWS[kind])) == [(chat, reference)]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_local_file_types(suffix, tmp_path):
    path = _write(tmp_path / f"data{suffix}", ROWS["math"] * 3)
    problems = load_problems(path, limit=2)
    assert problems == [([USER], "2")] * 2


def test_column_overrides_and_system_prompt(tmp_path):
    rows = [{"q": "What is 1 + 1?", "final": "2", "answer": "wrong column"}]
    path = _write(tmp_path / "data.jsonl", rows)
    assert load_problems(path, prompt_column="q", answer_column="final") == [([USER], "2")]
    chat, _ = load_problems(path, prompt_column="q", system_prompt="Be brief.")[0]
    assert chat == [{"role": "system", "content": "Be brief."}, USER]
    # A messages row's reference may come from another column instead of its last assistant turn.
    messages = [{"messages": [USER, {"role": "assistant", "content": "long"}], "gold": "2"}]
    assert load_problems(_write(tmp_path / "m.jsonl", messages), answer_column="gold") == [([USER], "2")]


def test_bad_columns_name_the_columns_and_the_formats(tmp_path):
    path = _write(tmp_path / "data.jsonl", [{"text": "hello", "label": 1}])
    with pytest.raises(ValueError, match=r"columns \['text', 'label'\], which fit none of the formats: `messages`"):
        load_problems(path)
    with pytest.raises(ValueError, match=r"no column 'q' \(--prompt_column\); its columns are \['text', 'label'\]"):
        load_problems(path, prompt_column="q")
    with pytest.raises(ValueError, match="--answer_column"):
        detect_columns(["question"], answer_column="gold")
    empty = _write(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match="is empty"):
        load_problems(empty)


def test_held_out_problems_are_seeded_and_never_trained_on(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(20)]
    path = _write(tmp_path / "data.jsonl", rows)
    data = split_dataset(path, num_train=12, num_eval=5, seed=3)
    held = [chat[0]["content"] for chat, _ in data.problems]
    trained = [row["messages"][0]["content"] for row in data.train]
    assert not set(held) & set(trained) and len(trained) == 12 and data.train.column_names == ["messages"]
    # The same held-out set whatever the number of training prompts.
    assert [c for c, _ in split_dataset(path, num_train=3, num_eval=5, seed=3).problems] == [c for c, _ in data.problems]
    with pytest.raises(ValueError, match="has 20 rows"):
        split_dataset(path, num_train=18, num_eval=5)


def test_separate_eval_dataset(tmp_path):
    train = _write(tmp_path / "train.jsonl", [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(4)])
    held = _write(tmp_path / "test.parquet", [{"problem": f"p{i}", "answer": str(i)} for i in range(3)])
    data = split_dataset(train, num_train=4, num_eval=2, seed=0, eval_dataset=held)
    assert len(data.train) == 4 and {c[0]["content"] for c, _ in data.problems} <= {"p0", "p1", "p2"}


# -- the resolver --------------------------------------------------------------------------------------------------


@pytest.fixture
def no_hub(monkeypatch):
    """The Hub (and the datasets cache) are unreachable: the resolver's last step fails as offline."""
    import datasets

    calls = []

    def offline(name, config=None, split=None, **kwargs):
        calls.append((name, config, split))
        raise ConnectionError("Couldn't reach the Hub (offline)")

    monkeypatch.setattr(datasets, "load_dataset", _passthrough_files(datasets.load_dataset, offline))
    return calls


def _passthrough_files(real, hub):
    def load(path, *args, **kwargs):
        return real(path, *args, **kwargs) if path in ("json", "parquet", "csv") else hub(path, *args, **kwargs)

    return load


def _data_dir(root: Path, folder: str, split: str, question: str) -> Path:
    (root / folder).mkdir(parents=True)
    return _write(root / folder / f"{split}.jsonl", [{"question": question, "answer": "#### 1"}])


def test_resolver_order(tmp_path, monkeypatch, no_hub):
    work = tmp_path / "repo"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    _data_dir(tmp_path / "shared" / "data", "gsm8k", "train", "from shared")
    found = resolve_dataset("openai/gsm8k")
    assert found.source == "shared" and found.dataset[0]["question"] == "from shared"
    # The environment variable's folder comes before the shared one.
    _data_dir(tmp_path / "mine", "gsm8k", "train", "from env")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "mine"))
    assert resolve_dataset("openai/gsm8k").dataset[0]["question"] == "from env"
    # An explicit path comes first of all, and a folder is read by its split file.
    explicit = _data_dir(tmp_path / "explicit", "x", "test", "explicit")
    assert resolve_dataset(str(explicit)).source == "path"
    assert resolve_dataset(str(explicit.parent), split="test").dataset[0]["question"] == "explicit"
    # Folder names: MATH-500 is found as math500/.
    _data_dir(tmp_path / "mine", "math500", "test", "math")
    assert resolve_dataset("HuggingFaceH4/MATH-500", split="test").location.endswith("math500/test.jsonl")
    assert no_hub == []  # a local copy was always found first


def test_resolver_falls_back_to_the_hub_and_lists_what_it_tried(tmp_path, monkeypatch, no_hub):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError) as err:
        resolve_dataset("someone/my-set", split="validation")
    message = str(err.value)
    assert "Dataset 'someone/my-set'" in message and "validation" in message
    for place in (f"${DATA_DIR_ENV}", "the shared data folder", "the datasets cache and the Hub", "ConnectionError"):
        assert place in message
    assert message.index(f"${DATA_DIR_ENV}") < message.index("shared data") < message.index("the Hub")
    assert no_hub == [("someone/my-set", None, "validation")]
    # openai/gsm8k gets its config.
    with pytest.raises(FileNotFoundError):
        resolve_dataset("openai/gsm8k")
    assert no_hub[-1] == ("openai/gsm8k", "main", "train")


def test_missing_explicit_file_is_not_looked_up_elsewhere(tmp_path, no_hub):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_dataset(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="not a data file"):
        resolve_dataset(str(tmp_path / "notes.txt"))
    assert no_hub == []


@pytest.mark.skipif(not (SHARED / "math500" / "test.jsonl").is_file(), reason="shared MATH-500 data not present")
def test_math500_from_the_shared_copy(monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the checkout, beside ../shared/data
    problems = load_problems("HuggingFaceH4/MATH-500", split="test", limit=3)
    assert len(problems) == 3 and all(isinstance(reference, str) and reference for _, reference in problems)
    from hf_rockopd.evaluation import verify_answer

    assert verify_answer(f"The answer is $\\boxed{{{problems[0][1]}}}$.", problems[0][1]) is True


def test_resolver_module_documents_its_order():
    assert "HF_ROCKOPD_DATA_DIR" in resolve_module.__doc__ and "../shared/data" in resolve_module.__doc__


def test_lab_prompts_from_any_dataset(tmp_path):
    from hf_rockopd.lab import load_prompts

    path = _write(tmp_path / "data.parquet", ROWS["prompt_chat"] * 2)
    assert load_prompts(str(path), limit=1) == [[USER]]
