"""Stop and control tokens are never rocks by default: `special_token_ids`, `select_rock_tokens(exclude_ids=...)`,
a `rock_online` run whose eos has the highest R(v), `analyze score`, and `rock_tokens.json` rows in R(v) order."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from conftest import make_args, make_dataset
from tokenizers import AddedToken

from hf_rockopd import RockOPDTrainer
from hf_rockopd.models.introspection import special_token_ids
from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer
from hf_rockopd.policies.rock_set import select_rock_tokens

EOS, PAD, IM_START = 256, 257, 258  # the tiny ChatML tokenizer's <|im_end|>, <pad>, <|im_start|>


def test_special_token_ids_cover_stop_pad_and_template_tokens():
    tokenizer = build_tiny_tokenizer()
    assert special_token_ids(tokenizer) == [EOS, PAD, IM_START]
    # A token the chat template writes is a control token even when the tokenizer does not mark it special, and the
    # generation config's extra stop ids count too.
    tokenizer.add_tokens([AddedToken("<|endoftext|>", special=False)])
    extra = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer.chat_template = tokenizer.chat_template + "{{ '<|endoftext|>' }}"
    model = build_tiny_causal_lm(build_tiny_tokenizer())
    model.generation_config.eos_token_id = [EOS, 65]
    assert special_token_ids(tokenizer, model) == [65, EOS, PAD, IM_START, extra]


def test_select_rock_tokens_excludes_ids_whatever_their_score():
    count = torch.tensor([100.0, 50.0, 10.0, 1.0])
    divergence = torch.tensor([9.0, 0.1, 2.0, 9.0])  # id 0 has by far the highest R(v)
    assert select_rock_tokens(count, divergence, top_k=1, exclude_top_frequent=0)[0] == [0]
    assert select_rock_tokens(count, divergence, top_k=1, exclude_top_frequent=0, exclude_ids=[0])[0] == [2]
    assert select_rock_tokens(count, divergence, top_k=4, exclude_top_frequent=0, exclude_ids=[0, 2])[0] == [1]


def _boost_eos_divergence(policy, factor: float = 1000.0):
    """Make eos the highest-R(v) id of the run: its measured divergence, as the policy receives it, times `factor`."""
    update = policy.update

    def boosted(batch, weights):
        if batch.divergence is not None:
            batch.divergence = torch.where(batch.token_ids == EOS, batch.divergence * factor, batch.divergence)
        return update(batch, weights)

    policy.update = boosted


@pytest.mark.parametrize("allow", [False, True])
def test_rock_online_run_never_freezes_eos(tmp_path, tokenizer, student, teacher, allow):
    kwargs = {"warmup_steps": 1, "refresh_every": 1, "persistence": 1, "top_k": 3, "min_count": 1,
              "exclude_top_frequent": 0, "stagnation_tol": 1e9}
    if allow:
        kwargs["allow_special_tokens"] = True
    # lmbda=0: the dataset's own answers, each ending with <|im_end|>, so eos is in every completion.
    args = make_args(tmp_path / "out", lmbda=0.0, max_steps=3, rock_policy="rock_online", rock_policy_kwargs=kwargs)
    trainer = RockOPDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=make_dataset(),
                             processing_class=tokenizer)
    policy = trainer.rock_policy
    assert {EOS, PAD, IM_START} <= set(policy.special_ids)
    _boost_eos_divergence(policy)
    trainer.train()
    scores = policy._scores
    assert int(torch.argmax(torch.nan_to_num(scores, nan=-1.0))) == EOS  # eos is the best-scoring id of the run
    rocks = policy.rock_ids()
    assert rocks, "the run must have frozen some ids"
    assert (EOS in rocks) is allow
    if not allow:
        assert not set(rocks) & set(policy.special_ids)
    # rock_tokens.json: rows best first by R(v), token_ids in the same order.
    trainer.rock_engine.write_rock_tokens(tmp_path / "run", step=3)
    saved = json.loads((tmp_path / "run" / "rock_tokens.json").read_text())
    row_scores = [row["rock_score"] for row in saved["tokens"]]
    assert row_scores == sorted(row_scores, reverse=True)
    assert saved["token_ids"] == [row["token_id"] for row in saved["tokens"]]


def test_rock_online_config_checks_allow_special_tokens():
    from hf_rockopd.policies import RockOnlineConfig

    with pytest.raises(ValueError, match="allow_special_tokens must be true or false, got 'yes'"):
        RockOnlineConfig(allow_special_tokens="yes")


def _table(tokens_meta: dict | None = None):
    from hf_rockopd.lab import load_token_table

    # id 256 (<|im_end|>) has the highest R(v): 3 occurrences at divergence 5.
    frame = pd.DataFrame({
        "prompt_index": [0] * 9,
        "token_id": [256, 256, 256, 65, 65, 65, 66, 66, 67],
        "token": ["<|im_end|>"] * 3 + ["A"] * 3 + ["B"] * 2 + ["C"],
        "divergence": [5.0] * 3 + [1.0] * 3 + [0.5] * 2 + [0.1],
    })
    table = load_token_table(frame)
    if tokens_meta is not None:
        table.meta.update(tokens_meta)
    return table


def test_score_token_table_excludes_special_tokens():
    from hf_rockopd.lab import score_token_table

    table = _table({"special_ids": [256]})
    assert score_token_table(table, top_k=1, exclude_top_frequent=0).rock_ids == [65]
    assert score_token_table(table, top_k=1, exclude_top_frequent=0, allow_special_tokens=True).rock_ids == [256]
    assert score_token_table(table, top_k=1, exclude_top_frequent=0, exclude_ids=[65, 256]).rock_ids == [66]
    # A table collected before the tokenizer's special ids were recorded: control tokens are known by their form.
    assert score_token_table(_table(), top_k=1, exclude_top_frequent=0).rock_ids == [65]


def test_analyze_score_command_excludes_special_tokens(tmp_path):
    import pyarrow as pa

    from hf_rockopd.cli import main
    from hf_rockopd.lab.table import prepare_table_dir, write_part

    frame = _table().frame
    meta = {"vocab_size": 259, "special_ids": [256]}
    prepare_table_dir(tmp_path / "table", meta)
    write_part(tmp_path / "table", 0, {c: pa.array(frame[c].to_numpy()) for c in frame.columns}, meta)
    out = tmp_path / "rock_set.json"
    argv = ["analyze", "score", str(tmp_path / "table"), "--top_k", "1", "--exclude_top_frequent", "0", "--out", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["token_ids"] == [65]
    assert main([*argv, "--allow_special_tokens"]) == 0
    assert json.loads(out.read_text())["token_ids"] == [256]
