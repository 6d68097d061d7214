"""The wire format of a served teacher: vLLM's `/v1/completions` with token-id prompts and `prompt_logprobs`.

The one owner of the format, for both sides: [`completions_request`] builds what the trainer sends,
[`prompt_logprobs_entry`] what `hf-rockopd serve-teacher` answers, and [`parse_prompt_logprobs`] reads an answer back
into tensors, refusing anything malformed. The schema is vLLM's (and what TRL's
`VLLMClient.get_sequence_logprobs` reads):

```json
{"choices": [{"index": 0, "prompt_logprobs": [null,
    {"9707": {"logprob": -0.11, "rank": 1, "decoded_token": "Hello"}, "...": {}}, ...]}]}
```

`prompt_logprobs[i]` is the teacher's distribution of token `i` given the tokens before it (`null` at 0, which has no
context): its `k` most likely tokens, plus the sequence's own token at `i` when that is not among them (vLLM's rule),
so a position holds `k` or `k + 1` entries.

Example:
```python
>>> from hf_rockopd.teachers.protocol import completions_request, parse_prompt_logprobs
>>> completions_request([[1, 2]], top_k=2, model="t")["prompt_logprobs"]
2
>>> entry = {"5": {"logprob": -0.1, "rank": 1, "decoded_token": "a"}, "2": {"logprob": -3.0, "rank": 2}}
>>> ids, lp = parse_prompt_logprobs([None, entry], sequence=[1, 2], top_k=2, vocab_size=10)
>>> ids.tolist(), [round(x, 1) for x in lp[1].tolist()]
([[-1, -1, -1], [5, 2, -1]], [-0.1, -3.0, -inf])
```
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch


__all__ = ["MalformedTeacherResponse", "completions_request", "parse_prompt_logprobs", "prompt_logprobs_entry"]


class MalformedTeacherResponse(ValueError):
    """A served teacher answered something that is not a valid `prompt_logprobs` list for the sequence sent."""


def completions_request(sequences: Sequence[Sequence[int]], top_k: int, model: str) -> dict[str, Any]:
    """The `/v1/completions` body that scores `sequences` (token ids) with the teacher's top-`top_k` per position.

    `max_tokens=1` because vLLM's completions endpoint always generates (its one token is ignored); temperature 1
    because prompt log-probabilities are the model's own softmax, which a truncated distribution cannot re-temper.
    """
    return {
        "model": model,
        "prompt": [list(map(int, sequence)) for sequence in sequences],
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": int(top_k),
    }


def prompt_logprobs_entry(
    ids: Sequence[int],
    log_probs: Sequence[float],
    ranks: Sequence[int] | None = None,
    decode: Callable[[int], str] | None = None,
) -> dict[str, dict[str, Any]]:
    """One position of a `prompt_logprobs` answer: `{"<id>": {"logprob", "rank", "decoded_token"}}`.

    `ranks` default to 1, 2, ... in the order given (most likely first); the sequence's own token, appended when it is
    outside the top k, carries its true rank.
    """
    ranks = range(1, len(ids) + 1) if ranks is None else ranks
    return {
        str(int(i)): {"logprob": float(lp), "rank": int(rank), "decoded_token": decode(int(i)) if decode else None}
        for i, lp, rank in zip(ids, log_probs, ranks)
    }


def parse_prompt_logprobs(
    prompt_logprobs: Any, sequence: Sequence[int], top_k: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, log_probs)`, each `(len(sequence), top_k + 1)`, from one choice's `prompt_logprobs`.

    Row `i` is the teacher's distribution of token `i`, entries by rank, padded with id -1 and `-inf` (row 0 is all
    padding). Raises [`MalformedTeacherResponse`] naming the position when the answer does not fit the sequence: not a
    list of `len(sequence)` entries, an entry that is not a dict of id -> `{"logprob": float}`, a NaN or positive
    log-probability, an id outside `[0, vocab_size)`, more than `top_k + 1` entries, or listed probabilities summing
    past 1. A missing position (`null` past 0, or an empty dict) is an error too: a position without a teacher would
    be trained on nothing, silently.
    """
    n = len(sequence)
    if not isinstance(prompt_logprobs, list) or len(prompt_logprobs) != n:
        got = f"a list of {len(prompt_logprobs)}" if isinstance(prompt_logprobs, list) else type(prompt_logprobs).__name__
        raise MalformedTeacherResponse(f"prompt_logprobs should be a list of {n} positions (one per token), got {got}.")
    width = top_k + 1
    ids = torch.full((n, width), -1, dtype=torch.long)
    values = torch.full((n, width), -math.inf, dtype=torch.float32)
    for position in range(1, n):
        entry = prompt_logprobs[position]
        if not isinstance(entry, dict) or not entry:
            raise MalformedTeacherResponse(f"position {position}: expected a dict of token id -> logprob, got {entry!r}.")
        if len(entry) > width:
            raise MalformedTeacherResponse(
                f"position {position}: {len(entry)} entries, more than top_k + 1 = {width} (was the server asked for "
                "another prompt_logprobs?)."
            )
        try:
            items = sorted(
                ((int(token), float(item["logprob"]), int(item.get("rank") or 0)) for token, item in entry.items()),
                key=lambda item: (item[2] if item[2] > 0 else math.inf, -item[1]),
            )
        except (TypeError, ValueError, KeyError) as err:
            raise MalformedTeacherResponse(f"position {position}: unreadable entry {entry!r} ({err}).") from err
        row_ids = [token for token, _, _ in items]
        row_lp = [lp for _, lp, _ in items]
        bad_id = next((t for t in row_ids if not 0 <= t < vocab_size), None)
        if bad_id is not None:
            raise MalformedTeacherResponse(
                f"position {position}: token id {bad_id} is outside the student's vocabulary [0, {vocab_size}): the "
                "server's model does not share the student's tokenizer."
            )
        if any(math.isnan(lp) or lp > 1e-4 for lp in row_lp):
            raise MalformedTeacherResponse(f"position {position}: log-probabilities must be <= 0 and not NaN: {row_lp}.")
        if len(set(row_ids)) != len(row_ids):
            raise MalformedTeacherResponse(f"position {position}: a token id is listed twice: {row_ids}.")
        if sum(math.exp(lp) for lp in row_lp) > 1.0 + 1e-3:
            raise MalformedTeacherResponse(f"position {position}: the listed probabilities sum past 1: {row_lp}.")
        ids[position, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        values[position, : len(row_lp)] = torch.tensor(row_lp, dtype=torch.float32)
    return ids, values
