"""hf_rockopd.evaluation.rollout is the one way to generate and score: evaluation, the lab's collect and the knockout agree on the
same prompts, and every stop id of the generation config ends a completion everywhere. Tiny offline models only."""

import numpy as np
import pytest

from hf_rockopd.evaluation import evaluate_gsm8k
from hf_rockopd.evaluation.answers import verify_answer
from hf_rockopd.lab import collect_token_table, load_token_table, token_knockout
from hf_rockopd.models.introspection import cut_at_eos, eos_token_ids
from hf_rockopd.evaluation.rollout import generate_completions


# Prompts of different lengths, so batches are left-padded.
PROBLEMS = [([{"role": "user", "content": f"What is {i} + {i}?"}], float(2 * i)) for i in range(4)] + [
    ([{"role": "user", "content": "A much longer question: what is 3 + 4, in apples?"}], 7.0),
    ([{"role": "user", "content": "Hi"}], 0.0),
]


def _table_completions(table_dir, n):
    frame = load_token_table(table_dir).frame.sort_values(["prompt_index", "position"])
    return [frame[frame["prompt_index"] == i]["token_id"].tolist() for i in range(n)], frame


def test_collect_evaluation_and_knockout_share_one_rollout(tmp_path, tokenizer, student, teacher):
    kwargs = dict(max_new_tokens=8, batch_size=3, show_progress=False)
    _, completions = generate_completions(student, tokenizer, PROBLEMS, **kwargs)
    result = evaluate_gsm8k(student, tokenizer, PROBLEMS, teacher=teacher, **kwargs)
    collect_token_table(student, teacher, tokenizer, [m for m, _ in PROBLEMS], tmp_path / "table",
                        gradient_cosine=False, **kwargs)
    collected, frame = _table_completions(tmp_path / "table", len(PROBLEMS))

    # The same completions...
    assert collected == completions
    assert [r["completion"] for r in result.records] == [
        tokenizer.decode(c, skip_special_tokens=True) for c in completions
    ]
    assert result.token_ids.tolist() == frame["token_id"].tolist()
    # ... scored the same way, token by token.
    np.testing.assert_allclose(frame["divergence"].to_numpy(), result.token_divergence.numpy(), rtol=0, atol=1e-6)
    # The knockout's baseline grades the same completions with the same rule.
    solved = token_knockout._solve(student, tokenizer, PROBLEMS, 8, 3, banned=())
    assert solved.tolist() == [float(r["correct"]) for r in result.records]


def test_every_stop_id_of_the_generation_config_ends_a_completion(tmp_path, tokenizer, student, teacher):
    kwargs = dict(max_new_tokens=10, batch_size=3, show_progress=False)
    eos = tokenizer.eos_token_id
    _, plain = generate_completions(student, tokenizer, PROBLEMS, **kwargs)
    # A second stop id that greedy decoding emits after the first token of some completion.
    stop = next(c[j] for c in plain for j in range(1, len(c)) if c[j] != eos)
    student.generation_config.eos_token_id = [eos, stop]
    assert eos_token_ids(tokenizer, student) == [eos, stop]

    _, cut = generate_completions(student, tokenizer, PROBLEMS, **kwargs)
    # Greedy decoding: each completion is the unstopped one up to and including its first stop id of either kind.
    assert cut == [cut_at_eos(c, [eos, stop]) for c in plain]
    assert any(c[-1] == stop and len(c) < len(p) for c, p in zip(cut, plain))

    result = evaluate_gsm8k(student, tokenizer, PROBLEMS, teacher=teacher, **kwargs)
    assert result.num_tokens == sum(len(c) for c in cut)
    # A completion ended by the second stop id is finished, not clipped.
    clipped = [len(c) == 10 and not ({eos, stop} & set(c)) for c in cut]
    assert result.clipped_ratio == pytest.approx(sum(clipped) / len(cut))

    collect_token_table(student, teacher, tokenizer, [m for m, _ in PROBLEMS], tmp_path / "table",
                        gradient_cosine=False, **kwargs)
    collected, _ = _table_completions(tmp_path / "table", len(PROBLEMS))
    assert collected == cut


def test_one_answer_tolerance():
    # math-verify: "72.0" is 72, float noise in a decimal answer passes, a real difference does not.
    assert verify_answer("#### 72.0", 72) and verify_answer("#### 0.30000000000000004", "0.3")
    assert not verify_answer("#### 72.001", 72.0) and verify_answer("no answer", 72.0) is None


def test_generation_progress_moves_per_token(monkeypatch):
    """The bar counts token slots and moves at every decoding step, not once per batch."""
    import tqdm.auto

    from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer
    from hf_rockopd.evaluation.rollout import generate_completions

    bars = []

    class Recorder(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})
            self.n, self.updates = 0, []
            bars.append(self)

        def update(self, n=1):
            self.n += n
            self.updates.append(n)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    tokenizer = build_tiny_tokenizer()
    generate_completions(build_tiny_causal_lm(tokenizer), tokenizer, ["a", "b", "c"], max_new_tokens=5, batch_size=2)
    (bar,) = bars
    assert bar.total == 15 and bar.n == 15
    assert len(bar.updates) >= 4  # several steps per batch, not one update per batch
