"""A system prompt reaches every chat a job builds (training prompts, held-out problems, the lab's prompts), and a bad
one fails before any file or model is read."""

import json

import pytest

from hf_rockopd.ablate.arguments import AblateArguments
from hf_rockopd.commands.evaluate import EvalArguments
from hf_rockopd.data import split_dataset
from hf_rockopd.distill import DistillArguments
from hf_rockopd.data.gsm8k import load_gsm8k_problems, question_messages
from hf_rockopd.lab import load_prompts


SYSTEM = "Solve it in a few short steps, then give the answer as '#### <number>'."


@pytest.fixture
def problems_file(tmp_path):
    path = tmp_path / "problems.jsonl"
    with open(path, "w") as f:
        for i in range(6):
            f.write(json.dumps({"question": f"{i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}], "question": "q", "answer": "#### 1"}))
    return str(path)


def test_question_messages_with_and_without_system_turn():
    assert question_messages("2 + 2?") == [{"role": "user", "content": "2 + 2?"}]
    assert question_messages("2 + 2?", SYSTEM) == [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "2 + 2?"}
    ]


@pytest.mark.parametrize("bad", ["", "   ", 3])
def test_bad_system_prompt_is_a_clear_error_everywhere(bad, problems_file):
    with pytest.raises(ValueError, match="system_prompt must be a non-empty string"):
        question_messages("q", bad)
    with pytest.raises(ValueError, match="system_prompt"):
        load_gsm8k_problems("no/such/file.jsonl", system_prompt=bad)  # the prompt is checked before the file
    with pytest.raises(ValueError, match="system_prompt"):
        split_dataset("no/such/file.jsonl", 2, 2, system_prompt=bad)
    with pytest.raises(ValueError, match="system_prompt"):
        load_prompts(problems_file, system_prompt=bad)
    with pytest.raises(ValueError, match="system_prompt"):
        DistillArguments(dataset=problems_file, system_prompt=bad)
    with pytest.raises(ValueError, match="system_prompt"):
        AblateArguments(system_prompt=bad)


def test_split_and_problems_carry_the_same_system_turn(problems_file):
    data = split_dataset(problems_file, 3, 2, seed=0, system_prompt=SYSTEM)
    for row in data.train:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system", "user", "assistant"] and row["messages"][0]["content"] == SYSTEM
    problems = data.problems
    assert [[m["role"] for m in chat] for chat, _ in problems] == [["system", "user"]] * 2
    # Without one, the chats are exactly what they were before the option existed.
    plain = split_dataset(problems_file, 3, 2, seed=0)
    assert [m["role"] for m in plain.train[0]["messages"]] == ["user", "assistant"]
    assert [chat for chat, _ in plain.problems] == [chat[1:] for chat, _ in problems]


def test_lab_prompts_get_the_system_turn_unless_the_chat_has_one(problems_file, tmp_path):
    prompts = load_prompts(problems_file, system_prompt=SYSTEM)
    assert all(chat[0] == {"role": "system", "content": SYSTEM} for chat in prompts)
    assert prompts[-1][1] == {"role": "user", "content": "hi"}  # a `messages` row keeps its own turns after it
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"messages": [{"role": "system", "content": "mine"}, {"role": "user", "content": "x"}]}))
    assert load_prompts(str(own), system_prompt=SYSTEM) == [[{"role": "system", "content": "mine"},
                                                             {"role": "user", "content": "x"}]]


def test_eval_command_passes_the_system_prompt(problems_file, monkeypatch):
    from hf_rockopd.commands import evaluate as command

    seen = {}

    def stop(source, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop before loading a model")

    monkeypatch.setattr(command, "load_problems", stop)
    with pytest.raises(RuntimeError, match="stop before"):
        command.evaluate(EvalArguments(model="m", problems=problems_file, system_prompt=SYSTEM), None)
    assert seen["system_prompt"] == SYSTEM
