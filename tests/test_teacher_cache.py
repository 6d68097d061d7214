"""The offline teacher cache: what it stores reads back as the teacher said it, a cache made with
other settings is refused, training from it equals the in-process teacher at k = V, and the evaluation's
teacher-forced divergence needs no teacher in memory."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import make_args, make_dataset
from served_teacher import VOCAB

from hf_rockopd import RockOPDTrainer
from hf_rockopd.evaluation.evaluate import evaluate_gsm8k
from hf_rockopd.evaluation.teacher_reference import build_teacher_reference
from hf_rockopd.models import build_tiny_causal_lm
from hf_rockopd.teachers import CacheSettings, CachedTeacher, ModelTopKTeacher, TeacherCache
from hf_rockopd.trainers.data import OnPolicyChatMLCollator


def _build(path, teacher, sequences, top_k=4, name="tiny-teacher"):
    settings = CacheSettings(teacher=name, top_k=top_k, vocab_size=teacher.config.vocab_size)
    return TeacherCache.build(ModelTopKTeacher(teacher, top_k=top_k), sequences, settings, path, batch_size=2)


def _batch(sequences):
    length = max(map(len, sequences))
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):  # left padding, as the trainers' batches
        ids[row, length - len(s) :] = torch.tensor(s)
        mask[row, length - len(s) :] = 1
    return ids, mask


def test_cached_targets_read_back_what_the_teacher_said(tmp_path, teacher):
    sequences = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    _build(tmp_path / "c.parquet", teacher, sequences)
    source = CachedTeacher(TeacherCache.load(tmp_path / "c.parquet", top_k=4, teacher="tiny-teacher"))
    ids, mask = _batch(sequences)
    expected = ModelTopKTeacher(teacher, top_k=4).targets(ids, mask, step=0)
    got = source.targets(ids, mask, step=0)
    assert got.shape == expected.shape == (3, 4, 2, 5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)  # -inf padding included
    assert (source.hits, source.misses) == (3, 0)


def test_a_sequence_not_in_the_cache_is_an_error_or_goes_to_the_fallback(tmp_path, teacher):
    _build(tmp_path / "c.parquet", teacher, [[5, 6, 7]])
    cache = TeacherCache.load(tmp_path / "c.parquet")
    ids, mask = _batch([[5, 6, 7], [5, 6, 8]])
    with pytest.raises(ValueError, match=r"Step 3: 1 of the batch's 2 sequences are not in the teacher cache .*"
                                         r"teacher_server_url"):  # fmt: skip
        CachedTeacher(cache).targets(ids, mask, step=3)
    fallback = ModelTopKTeacher(teacher, top_k=4)
    source = CachedTeacher(cache, fallback=fallback)
    torch.testing.assert_close(source.targets(ids, mask, step=0), fallback.targets(ids, mask, step=0), atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    assert (source.hits, source.misses) == (1, 1)
    with pytest.raises(ValueError, match="one loss needs one k"):
        CachedTeacher(cache, fallback=ModelTopKTeacher(teacher, top_k=8))


class _Stopping(ModelTopKTeacher):
    """A local teacher that counts its batches and dies after `stop_after` of them, as a killed build would."""

    def __init__(self, teacher, stop_after=None):
        super().__init__(teacher, top_k=4)
        self.steps, self.stop_after = [], stop_after

    def targets(self, input_ids, attention_mask, *, step, **kwargs):
        if self.stop_after is not None and len(self.steps) == self.stop_after:
            raise KeyboardInterrupt("stopped")
        self.steps.append(step)
        return super().targets(input_ids, attention_mask, step=step, **kwargs)


def test_a_stopped_build_goes_on_at_its_batch_and_ends_as_an_uninterrupted_one(tmp_path, teacher, capsys):
    sequences = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14, 15], [16, 17, 18], [19, 20]]
    settings = CacheSettings(teacher="tiny-teacher", top_k=4, vocab_size=teacher.config.vocab_size)
    path = tmp_path / "c.parquet"
    with pytest.raises(KeyboardInterrupt):
        TeacherCache.build(_Stopping(teacher, stop_after=2), sequences, settings, path, batch_size=2)
    assert not path.exists() and len(list((tmp_path / "c.parquet.parts").glob("*.parquet"))) == 2
    again = _Stopping(teacher)
    resumed = TeacherCache.build(again, sequences, settings, path, batch_size=2, show_progress=True)
    assert again.steps == [2]  # only the third batch was scored
    assert "teacher cache (2 batches resumed from" in capsys.readouterr().err
    assert not (tmp_path / "c.parquet.parts").exists()  # the parts go once the whole file is written
    whole = _build(tmp_path / "whole.parquet", teacher, sequences)
    loaded = TeacherCache.load(path, top_k=4, teacher="tiny-teacher")
    assert set(loaded.entries) == set(whole.entries) == set(resumed.entries)
    for key, value in whole.entries.items():
        torch.testing.assert_close(loaded.entries[key], value, rtol=0, atol=0)


def test_parts_made_from_other_weights_are_not_reused(tmp_path, teacher):
    sequences = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14, 15]]
    path = tmp_path / "c.parquet"

    def settings(fingerprint):
        return CacheSettings(teacher="tiny-teacher", top_k=4, vocab_size=teacher.config.vocab_size,
                             teacher_fingerprint=fingerprint)

    with pytest.raises(KeyboardInterrupt):
        TeacherCache.build(_Stopping(teacher, stop_after=1), sequences, settings("old"), path, batch_size=2)
    again = _Stopping(teacher)
    TeacherCache.build(again, sequences, settings("new"), path, batch_size=2)
    assert again.steps == [0, 1]  # the old weights' batch was scored again
    assert TeacherCache.read_settings(path).teacher_fingerprint == "new"


def test_a_cache_made_with_other_settings_is_refused(tmp_path, teacher):
    path = tmp_path / "c.parquet"
    _build(path, teacher, [[5, 6, 7]])
    with pytest.raises(ValueError, match=r"top_k: the cache has 4, asked for 8.*never reused"):
        TeacherCache.load(path, top_k=8)
    with pytest.raises(ValueError, match=r"teacher: the cache has 'tiny-teacher', asked for 'other'"):
        TeacherCache.load(path, teacher="other")
    with pytest.raises(ValueError, match="temperature"):
        TeacherCache.load(path, temperature=0.7)
    # Other settings give other keys: a row cannot be read under settings it was not made with.
    cache = TeacherCache.load(path)
    other = TeacherCache(CacheSettings(teacher="other", top_k=4), cache.entries)
    assert other.lookup([5, 6, 7]) is None and cache.lookup([5, 6, 7]) is not None
    pq.write_table(pa.table({"x": [1]}), tmp_path / "foreign.parquet")
    with pytest.raises(ValueError, match="not a teacher cache of this version"):
        TeacherCache.load(tmp_path / "foreign.parquet")
    (tmp_path / "text.parquet").write_text("hello")
    with pytest.raises(ValueError, match="not a Parquet file"):
        TeacherCache.load(tmp_path / "text.parquet")
    with pytest.raises(FileNotFoundError, match="hf-rockopd teacher-cache"):
        TeacherCache.load(tmp_path / "missing.parquet")


def test_cache_ids_are_checked_against_the_student(tmp_path, teacher):
    _build(tmp_path / "c.parquet", teacher, [[5, 6, 7]])
    source = CachedTeacher(TeacherCache.load(tmp_path / "c.parquet"))
    source.check_vocabulary(VOCAB)
    with pytest.raises(ValueError, match="another tokenizer"):
        source.check_vocabulary(4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(lmbda=0.0), "teacher_top_k is required with teacher_cache"),
        (dict(lmbda=0.0, teacher_top_k=8), r"top_k: the cache has 4, asked for 8"),
        (dict(lmbda=0.5, teacher_top_k=4), "needs lmbda=0"),
        (dict(lmbda=0.0, teacher_top_k=4, loss_temperature=0.5), "temperature"),
    ],
)
def test_bad_cache_settings_are_refused_before_any_model_loads(tmp_path, teacher, overrides, message):
    _build(tmp_path / "c.parquet", teacher, [[5, 6, 7]])
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path / "out", teacher_cache=str(tmp_path / "c.parquet"), **overrides)
    with pytest.raises(FileNotFoundError, match="No teacher cache"):
        make_args(tmp_path / "out", teacher_cache=str(tmp_path / "nope.parquet"), teacher_top_k=4, lmbda=0.0)


def test_training_from_the_cache_equals_the_in_process_teacher_at_full_vocabulary(tmp_path, tokenizer, teacher):
    # lmbda=0: every batch is the dataset's own completions, the fixed sequences a cache is for. The cache holds them
    # as the trainer's collator makes them (unpadded), scored at k = V.
    dataset = make_dataset(8)
    collator = OnPolicyChatMLCollator(tokenizer=tokenizer, max_length=make_args(tmp_path / "x").max_length)
    sequences = []
    for example in dataset:
        batch = collator([example])
        sequences.append(batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist())
    _build(tmp_path / "c.parquet", teacher, sequences, top_k=VOCAB)

    def run(name, teacher_model, **overrides):
        args = make_args(tmp_path / name, lmbda=0.0, optim="sgd", **overrides)
        trainer = RockOPDTrainer(model=build_tiny_causal_lm(tokenizer, seed=0), teacher_model=teacher_model,
                                 args=args, train_dataset=dataset, processing_class=tokenizer)  # fmt: skip
        trainer.train()
        return trainer, [row["loss"] for row in trainer.state.log_history if "loss" in row]

    local, expected = run("local", teacher)
    cached, losses = run("cached", None, teacher_cache=str(tmp_path / "c.parquet"), teacher_top_k=VOCAB)
    assert cached.teacher_model is None and len(losses) == len(expected) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    for p, q in zip(cached.model.parameters(), local.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    source = cached.rock_engine.topk_teacher
    assert source.misses == 0 and source.hits > 0
    cached.save_model(str(tmp_path / "cached"))
    teacher_info = json.loads((tmp_path / "cached" / "rock_tokens.json").read_text())["teacher"]
    assert teacher_info["source"].startswith("cache ") and teacher_info["top_k"] == VOCAB


def test_teacher_forced_divergence_from_the_cache_needs_no_teacher(tmp_path, tokenizer, teacher):
    problems = [([{"role": "user", "content": f"What is {i} + 1?"}], str(i + 1)) for i in range(3)]
    reference = build_teacher_reference(teacher, tokenizer, problems, max_new_tokens=8, batch_size=2)
    sequences = [p + c for p, c in zip(reference.prompt_ids, reference.completion_ids)]
    _build(tmp_path / "c.parquet", teacher, sequences, top_k=VOCAB)
    student = build_tiny_causal_lm(tokenizer, seed=0)
    kwargs = dict(teacher_reference=reference, max_new_tokens=8, batch_size=2, show_progress=False, verifier="none")
    full = evaluate_gsm8k(student, tokenizer, problems, teacher=teacher, **kwargs)
    forced = CachedTeacher(TeacherCache.load(tmp_path / "c.parquet"))
    cached = evaluate_gsm8k(student, tokenizer, problems, forced_teacher=forced, **kwargs)
    assert cached.teacher_forced_divergence == pytest.approx(full.teacher_forced_divergence, rel=1e-5)
    assert cached.teacher_forced_top1_agreement == full.teacher_forced_top1_agreement
    assert cached.mean_divergence is None  # the student's own completions are new text: no live teacher, no value
    assert cached.settings["teacher_forced_source"].startswith("cache ")
    with pytest.raises(ValueError, match="cannot generate the teacher's reference"):
        evaluate_gsm8k(student, tokenizer, problems, forced_teacher=forced, max_new_tokens=8, verifier="none")
