"""Teachers known by their top-k: served over HTTP, or an in-process model truncated to its top-k.

The engine asks a source for the teacher's targets of a batch and does not know which source it has. The in-process
full-vocabulary teacher stays a model (the engine projects its hidden states through its head, chunk by chunk); every
source here answers [`TopKTeacher.targets`] instead: a packed `(B, L, 2, W)` tensor
(`hf_rockopd.losses.sparse.pack_topk`) whose row `[b, i]` is the teacher's distribution of token `i` of sequence `b`
given the tokens before it: `W` = k + 1 entries (the top k, and the sequence's own token when it is outside them,
as vLLM's `prompt_logprobs` lists it), padding where there is no entry (position 0, padding, positions not asked for).

Example:
```python
>>> import torch
>>> from hf_rockopd.models import build_tiny_causal_lm
>>> from hf_rockopd.teachers import ModelTopKTeacher
>>> source = ModelTopKTeacher(build_tiny_causal_lm(), top_k=4)
>>> ids = torch.tensor([[40, 41, 42]])
>>> source.targets(ids, torch.ones_like(ids), step=0).shape
torch.Size([1, 3, 2, 5])
```
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn
from transformers.utils import logging

from ..losses import pack_topk
from ..models.introspection import backbone, logits_fn, vocab_size
from .client import TeacherClient, TeacherServerError


logger = logging.get_logger(__name__)

__all__ = [
    "ModelTopKTeacher",
    "ServedTeacher",
    "ServedTeachers",
    "TopKTeacher",
    "connect_served_teacher",
    "empty_targets",
    "topk_with_own_token",
]


@runtime_checkable
class TopKTeacher(Protocol):
    """A teacher known by its top-k log-probabilities (see the module docstring)."""

    top_k: int
    source: str  # how `rock_tokens.json` and the card name it: "server <url>", "in-process top-k", ...

    def targets(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        step: int,
        needed: torch.Tensor | None = None,
        routing: Sequence[str | None] | None = None,
    ) -> torch.Tensor:
        """Packed `(B, L, 2, top_k + 1)` targets; `needed` (`(B, L)` bool) marks the positions the loss reads, so a
        source may skip the rest (they are then padding). `routing` is the batch's `teacher` column (several
        teachers, [`ServedTeachers`]); one teacher ignores it."""
        ...

    def check_vocabulary(self, vocab_size: int, tokenizer: Any = None) -> None:
        """Raise a `ValueError` when the teacher cannot be compared with a student of `vocab_size` ids."""
        ...


def empty_targets(batch: int, length: int, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """All-padding packed targets: ids -1, log-probabilities `-inf`."""
    ids = torch.full((batch, length, width), -1, dtype=torch.long, device=device)
    return pack_topk(ids, torch.full(ids.shape, -math.inf, device=device))


class ModelTopKTeacher:
    """An in-process teacher truncated to its top-k, with the sequence's own token added as vLLM adds it: what a
    served teacher would send, without a server (for measuring what top-k costs, and for tests).

    Args:
        model: the teacher (its backbone and head run under `torch.no_grad`, one `chunk_size` rows at a time).
        top_k: entries per position.
        temperature: the teacher's log-probabilities are of `softmax(logits / temperature)`.
        chunk_size: rows projected through the head at once.
    """

    def __init__(self, model: nn.Module, top_k: int, temperature: float = 1.0, chunk_size: int = 512):
        self.model, self.top_k, self.temperature, self.chunk_size = model, int(top_k), float(temperature), chunk_size
        self.source = f"in-process top-{self.top_k}"

    def check_vocabulary(self, vocab: int, tokenizer: Any = None) -> None:
        if vocab_size(self.model) != vocab:
            raise ValueError(f"The teacher has vocab_size {vocab_size(self.model)}, the student {vocab}.")

    @torch.no_grad()
    def targets(self, input_ids, attention_mask, *, step: int, needed=None, routing=None) -> torch.Tensor:
        batch, length = input_ids.shape
        out = empty_targets(batch, length, self.top_k + 1, input_ids.device)
        # A sequence's first token has no distribution (nothing before it; vLLM sends None there), wherever left
        # padding puts it.
        wanted = attention_mask.bool() & (attention_mask.long().cumsum(-1) > 1)
        if needed is not None:
            wanted &= needed
        if not wanted.any():
            return out
        self.model.eval()
        hidden = backbone(self.model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = hidden.last_hidden_state[:, :-1][wanted[:, 1:]]  # hidden at i - 1 predicts token i
        tokens = input_ids[wanted]
        head = logits_fn(self.model)
        rows = []
        for start in range(0, hidden.shape[0], self.chunk_size):
            z = head(hidden[start : start + self.chunk_size]).float()
            lp = torch.log_softmax(z / self.temperature if self.temperature != 1.0 else z, dim=-1)
            rows.append(topk_with_own_token(lp, tokens[start : start + self.chunk_size], self.top_k))
        out[wanted] = torch.cat(rows)
        return out


def topk_with_own_token(log_probs: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Packed `(n, 2, k + 1)` rows: the top k of `log_probs` (`(n, V)`), then each row's own token (`tokens`, `(n,)`)
    when it is outside them, padding otherwise: what vLLM's `prompt_logprobs=k` lists for a position.

    Example:
    ```python
    >>> import torch
    >>> from hf_rockopd.teachers.sources import topk_with_own_token
    >>> lp = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), -1)
    >>> topk_with_own_token(lp, torch.tensor([3]), k=1)[0, 0].tolist()  # top-1 is id 0; the own token 3 is added
    [0.0, 3.0]
    ```
    """
    top_lp, top_ids = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
    own_lp = log_probs.gather(1, tokens[:, None])
    listed = (top_ids == tokens[:, None]).any(-1, keepdim=True)
    extra_ids = torch.where(listed, torch.full_like(tokens[:, None], -1), tokens[:, None])
    extra_lp = own_lp.masked_fill(listed, -math.inf)
    ids = torch.cat([top_ids, extra_ids], dim=-1)
    lp = torch.cat([top_lp, extra_lp], dim=-1)
    if ids.shape[-1] < k + 1:  # a vocabulary smaller than k
        pad = k + 1 - ids.shape[-1]
        ids = torch.cat([ids, ids.new_full((ids.shape[0], pad), -1)], dim=-1)
        lp = torch.cat([lp, lp.new_full((lp.shape[0], pad), -math.inf)], dim=-1)
    return pack_topk(ids, lp)


class ServedTeacher:
    """A teacher served over vLLM's API (see `hf_rockopd.teachers.protocol`), asked once per micro-batch.

    Only the sequences with a needed position are sent, each without its padding. A failure (unreachable after the
    client's retries, an HTTP error, a malformed answer) is a `TeacherServerError` naming the step and the URL:
    never a silent zero or a skipped loss.

    Args:
        client: the [`TeacherClient`] of the server.
        top_k: entries asked per position (`prompt_logprobs`).
        vocab_size: the student's vocabulary size; an id outside it is a malformed answer.
    """

    def __init__(self, client: TeacherClient, top_k: int, vocab_size: int | None = None):
        self.client, self.top_k, self.vocab_size = client, int(top_k), vocab_size
        self.source = f"server {client.url}"

    def check_vocabulary(self, vocab: int, tokenizer: Any = None) -> None:
        """Score a probe twice: its ids must lie in the student's vocabulary, and the two answers should agree to
        1e-4 (a warning otherwise: replicas or batch-dependent kernels answer differently)."""
        self.vocab_size = vocab
        text = "The answer is 42. Let me check: 6 x 7 = 42."
        probe = tokenizer(text)["input_ids"] if tokenizer is not None else list(range(1, min(vocab, 17)))
        try:
            first, second = (self.client.sequence_logprobs([probe], self.top_k, vocab)[0] for _ in range(2))
        except TeacherServerError as err:
            raise ValueError(f"The served teacher does not fit this student: {err}") from err
        same_ids = torch.equal(first[0], second[0])
        gap = (first[1] - second[1]).nan_to_num(0.0, posinf=0.0, neginf=0.0).abs().max().item() if same_ids else math.inf
        if gap > 1e-4:
            logger.warning(
                f"The teacher at {self.client.url} scored the same probe twice with different answers (largest "
                f"log-probability gap {gap:.2e}): replica- or batch-dependent serving. Training still works; losses "
                "will not be reproducible to the last digit."
            )

    def targets(self, input_ids, attention_mask, *, step: int, needed=None, routing=None) -> torch.Tensor:
        batch, length = input_ids.shape
        out = empty_targets(batch, length, self.top_k + 1, input_ids.device)
        valid = attention_mask.bool()
        rows = [b for b in range(batch) if (valid[b] & needed[b]).any()] if needed is not None else list(range(batch))
        sequences = [input_ids[b][valid[b]].tolist() for b in rows]
        try:
            answers = self.client.sequence_logprobs(sequences, self.top_k, self.vocab_size or 2**24)
        except TeacherServerError as err:
            raise TeacherServerError(f"Step {step}: {err}") from err
        for b, (ids, lp) in zip(rows, answers):
            out[b, valid[b]] = pack_topk(ids, lp).to(out.device)
        return out


class ServedTeachers:
    """Several served teachers, one per example: the batch's `teacher` column names each row's (the routing of TRL's
    experimental async multi-teacher distillation). Each teacher is asked once per micro-batch for its own rows.

    Args:
        teachers: name -> [`ServedTeacher`], all at the same `top_k`.

    Example:
    ```python
    >>> from hf_rockopd.teachers import ServedTeacher, ServedTeachers, TeacherClient
    >>> pair = ServedTeachers({name: ServedTeacher(TeacherClient(f"http://127.0.0.1:{port}"), top_k=8)
    ...                        for name, port in (("math", 8001), ("code", 8002))})
    >>> pair.source
    'servers math=http://127.0.0.1:8001, code=http://127.0.0.1:8002'
    ```
    """

    def __init__(self, teachers: dict[str, ServedTeacher]):
        if len({t.top_k for t in teachers.values()}) != 1:
            raise ValueError(f"Every teacher must be asked for the same top_k, got { {n: t.top_k for n, t in teachers.items()} }.")
        self.teachers = teachers
        self.top_k = next(iter(teachers.values())).top_k
        self.source = "servers " + ", ".join(f"{name}={t.client.url}" for name, t in teachers.items())

    def check_vocabulary(self, vocab: int, tokenizer: Any = None) -> None:
        for teacher in self.teachers.values():
            teacher.check_vocabulary(vocab, tokenizer)

    def targets(self, input_ids, attention_mask, *, step: int, needed=None, routing=None) -> torch.Tensor:
        known = ", ".join(map(repr, self.teachers))
        if routing is None:
            raise ValueError(
                f"Step {step}: several teachers are served ({known}), but the batch has no `teacher` column naming "
                "each example's teacher. Add one to the dataset."
            )
        unknown = sorted({str(name) for name in routing if name not in self.teachers})
        if unknown:
            raise ValueError(f"Step {step}: unknown teacher {', '.join(map(repr, unknown))} in the `teacher` column; "
                             f"the served teachers are {known}.")  # fmt: skip
        out = empty_targets(*input_ids.shape, self.top_k + 1, input_ids.device)
        needed = attention_mask.bool() if needed is None else needed
        for name, teacher in self.teachers.items():
            rows = torch.tensor([r == name for r in routing], device=input_ids.device)
            if rows.any():
                mine = needed & rows[:, None]
                out[rows] = teacher.targets(input_ids, attention_mask, step=step, needed=mine)[rows]
        return out


def connect_served_teacher(args: Any, tokenizer: Any = None) -> ServedTeacher | ServedTeachers:
    """The [`ServedTeacher`] of a trainer config (`teacher_server_url`, `teacher_top_k`, the timeout and retries),
    checked before any model loads: the server answers `/health` and `/v1/models`, and scores a probe at
    `teacher_top_k` (a server whose limit is lower refuses it: vLLM's `--max-logprobs` defaults to 20).

    Raises `ValueError` naming the URL and the fix.

    Example:
    ```python
    from hf_rockopd.teachers.sources import connect_served_teacher
    teacher = connect_served_teacher(RockOPDConfig(output_dir="out", teacher_server_url="http://127.0.0.1:8000",
                                                   teacher_top_k=16), tokenizer)
    ```
    """
    if isinstance(args.teacher_server_url, dict):
        return ServedTeachers(
            {name: _connect(url, args, tokenizer) for name, url in args.teacher_server_url.items()}
        )
    return _connect(args.teacher_server_url, args, tokenizer)


def _connect(url: str, args: Any, tokenizer: Any) -> ServedTeacher:
    client = TeacherClient(
        url,
        timeout=args.teacher_request_timeout,
        max_retries=args.teacher_max_retries,
        backoff=args.teacher_retry_backoff,
    )
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    vocab = len(tokenizer) if tokenizer is not None else 2**24
    probe = tokenizer("2 + 2 = 4")["input_ids"] if tokenizer is not None else [1, 2, 3, 4]
    try:
        client.health()
        model = client.model
        client.sequence_logprobs([probe], args.teacher_top_k, vocab)
    except TeacherServerError as err:
        hint = (
            f" If the server limits log-probabilities per position below teacher_top_k={args.teacher_top_k}, "
            f"restart it with a higher limit (vLLM: --max-logprobs {args.teacher_top_k}; hf-rockopd serve-teacher: "
            f"--max_top_k {args.teacher_top_k}) or lower teacher_top_k."
            if "refused" in str(err)
            else ""
        )
        raise ValueError(f"{err}{hint}") from err
    logger.info(f"Teacher served at {client.url}: model {model!r}, top-{args.teacher_top_k} per position.")
    return ServedTeacher(client, args.teacher_top_k, vocab_size=None)
