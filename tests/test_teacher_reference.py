"""hf_rockopd.evaluation.teacher_reference: the teacher's completions are generated once, reused with the same settings, and
regenerated or refused with other ones, never silently reused. Tiny offline models only."""

import copy
import json

import pytest

from hf_rockopd.evaluation import teacher_reference as module
from hf_rockopd.evaluation import evaluate_gsm8k
from hf_rockopd.models import build_tiny_causal_lm
from hf_rockopd.evaluation.teacher_reference import (
    TEACHER_REFERENCE_NAME,
    TeacherReference,
    build_teacher_reference,
    load_or_build_teacher_reference,
)


PROBLEMS = [([{"role": "user", "content": f"What is {i} + {i}?"}], float(2 * i)) for i in range(3)]


@pytest.fixture
def generations(monkeypatch):
    """Counts the teacher generations the module makes."""
    calls = []
    real = module.generate_completions

    def counting(*args, **kwargs):
        calls.append(kwargs.get("max_new_tokens"))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "generate_completions", counting)
    return calls


def test_written_once_then_reused(tmp_path, tokenizer, teacher, generations):
    path = tmp_path / "run" / TEACHER_REFERENCE_NAME
    first = load_or_build_teacher_reference(path, teacher, tokenizer, PROBLEMS, teacher_name="t", max_new_tokens=5)
    assert path.is_file() and generations == [5]
    data = json.loads(path.read_text())
    assert data["teacher"] == "t" and data["max_new_tokens"] == 5 and len(data["completion_ids"]) == 3
    keys = {"tokenizer_fingerprint", "problems_fingerprint", "teacher_fingerprint", "prompt_ids", "correct"}
    assert keys <= set(data)
    again = load_or_build_teacher_reference(path, teacher, tokenizer, PROBLEMS, teacher_name="t", max_new_tokens=5)
    assert again == first and generations == [5]  # read back, not generated again
    assert TeacherReference.load(path) == first and first.accuracy().trials == 3


@pytest.mark.parametrize("change", ["max_new_tokens", "problems", "teacher_weights", "teacher_name", "tokenizer"])
def test_other_settings_are_regenerated_or_refused(tmp_path, tokenizer, teacher, generations, change):
    path = tmp_path / TEACHER_REFERENCE_NAME
    settings = {"teacher": teacher, "tokenizer": tokenizer, "problems": PROBLEMS, "teacher_name": "t",
                "max_new_tokens": 5}
    load_or_build_teacher_reference(path, **settings)
    other = dict(settings)
    if change == "max_new_tokens":
        other["max_new_tokens"] = 6
    elif change == "problems":
        other["problems"] = PROBLEMS[:2]
    elif change == "teacher_weights":
        other["teacher"] = build_tiny_causal_lm(tokenizer, seed=7, num_hidden_layers=3)
    elif change == "teacher_name":
        other["teacher_name"] = "another/teacher"
    else:
        other["tokenizer"] = copy.deepcopy(tokenizer)
        other["tokenizer"].chat_template = tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> ")
    name = {"problems": "problems_fingerprint", "teacher_weights": "teacher_fingerprint", "teacher_name": "teacher",
            "tokenizer": "tokenizer_fingerprint"}.get(change, change)
    with pytest.raises(ValueError, match=f"other settings: {name}"):
        load_or_build_teacher_reference(path, **other, on_mismatch="error")
    assert len(generations) == 1
    regenerated = load_or_build_teacher_reference(path, **other)
    assert len(generations) == 2 and TeacherReference.load(path) == regenerated
    assert regenerated.mismatches(TeacherReference.load(path).key()) == []


def test_unreadable_cache_is_regenerated(tmp_path, tokenizer, teacher, generations):
    path = tmp_path / TEACHER_REFERENCE_NAME
    path.write_text("{not json")
    reference = load_or_build_teacher_reference(path, teacher, tokenizer, PROBLEMS, max_new_tokens=4)
    assert generations == [4] and TeacherReference.load(path) == reference
    path.write_text(json.dumps({**reference.to_dict(), "format_version": 99}))
    with pytest.raises(ValueError, match="unreadable.*format 99"):
        load_or_build_teacher_reference(path, teacher, tokenizer, PROBLEMS, max_new_tokens=4, on_mismatch="error")


def test_evaluation_uses_the_reference_and_refuses_a_mismatched_one(tmp_path, tokenizer, student, teacher, generations):
    reference = build_teacher_reference(teacher, tokenizer, PROBLEMS, max_new_tokens=5)
    path = reference.save(tmp_path / TEACHER_REFERENCE_NAME)
    kwargs = {"teacher": teacher, "max_new_tokens": 5, "show_progress": False}
    given = evaluate_gsm8k(student, tokenizer, PROBLEMS, teacher_reference=reference, **kwargs)
    from_file = evaluate_gsm8k(student, tokenizer, PROBLEMS, teacher_reference=path, **kwargs)
    assert len(generations) == 1  # neither evaluation generated the teacher's completions again
    assert given.teacher_forced_divergence == pytest.approx(from_file.teacher_forced_divergence, abs=1e-9)
    assert given.teacher_forced_divergence > 0 and given.settings["teacher_reference"] == reference.fingerprint()
    assert "teacher_generation_seconds" not in given.settings
    # Without a reference, evaluate_gsm8k builds the same one itself.
    built = evaluate_gsm8k(student, tokenizer, PROBLEMS, **kwargs)
    assert built.settings["teacher_reference"] == reference.fingerprint() and len(generations) == 2
    assert built.teacher_forced_divergence == pytest.approx(given.teacher_forced_divergence, abs=1e-6)
    with pytest.raises(ValueError, match="other settings.*max_new_tokens: 5 != 6"):
        evaluate_gsm8k(student, tokenizer, PROBLEMS, teacher_reference=reference, teacher=teacher, max_new_tokens=6)
    with pytest.raises(ValueError, match="other settings.*problems_fingerprint"):
        evaluate_gsm8k(student, tokenizer, PROBLEMS[:2], teacher_reference=reference, **kwargs)
    with pytest.raises(ValueError, match="other settings.*teacher_fingerprint"):
        evaluate_gsm8k(student, tokenizer, PROBLEMS, teacher_reference=reference, **{**kwargs, "teacher": student})
    # A reference without a teacher still gives the ceiling, not the teacher-forced divergence.
    alone = evaluate_gsm8k(student, tokenizer, PROBLEMS, teacher_reference=reference, max_new_tokens=5,
                           show_progress=False)
    assert alone.teacher_accuracy == reference.accuracy().estimate and alone.teacher_forced_divergence is None


def test_cli_eval_caches_the_reference_and_shows_the_quality_table(tmp_path, tokenizer, student, teacher, generations,
                                                                   capsys):
    from hf_rockopd.cli import main

    student.save_pretrained(tmp_path / "student")
    tokenizer.save_pretrained(tmp_path / "student")
    teacher.save_pretrained(tmp_path / "teacher")
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(3)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = tmp_path / "cache" / TEACHER_REFERENCE_NAME
    argv = ["eval", "--model", str(tmp_path / "student"), "--teacher", str(tmp_path / "teacher"), "--problems",
            str(tmp_path / "p.jsonl"), "--max_new_tokens", "5", "--teacher_reference", str(cache)]
    assert main([*argv, "--out", str(tmp_path / "a.json")]) == 0
    assert main([*argv, "--out", str(tmp_path / "b.json")]) == 0
    assert len(generations) == 1 and cache.is_file()  # the second evaluation reused the teacher's completions
    printed = capsys.readouterr().out
    for label in ("accuracy [95% CI]", "teacher accuracy (ceiling)", "finished rate", "loop share",
                  "teacher-forced divergence", "on-policy mean divergence"):
        assert label in printed
    a, b = (json.loads((tmp_path / name).read_text()) for name in ("a.json", "b.json"))
    assert a["teacher_forced_divergence"] == pytest.approx(b["teacher_forced_divergence"], abs=1e-9)
    assert a["settings"]["teacher_reference"] == b["settings"]["teacher_reference"]
    assert a["settings"]["teacher_reference_file"] == str(cache)
