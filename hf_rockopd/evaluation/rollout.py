"""The one way to roll out and score completions: evaluation, the lab's token tables, the knockout and the gradient
cosines all generate and score here, so a completion and its divergence are the same whichever of them asks.

- `encode_prompts`: the chat prompt ids a completion continues (chat template, generation prompt, no extra specials).
- `generate_completions`: batched, left-padded generation (greedy, or seeded sampling; an optional token ban), stopped
  at any of the model's stop ids (`modeling.eos_token_ids`: the generation config's list) and cut after the first one
  (`modeling.cut_at_eos`).
- `completion_logits` / `scored_chunks` / `score_completions`: the student's and the teacher's logits at the positions
  that predicted each completion token, with position ids from the attention mask, so a completion's scores do not
  depend on its padding or on what it is batched with, and match what `generate` computed when it chose the token.

Example:
```python
prompts, completions = generate_completions(student, tokenizer, [[{"role": "user", "content": "1 + 1?"}]])
scores = score_completions(student, teacher, prompts, completions, pad_token_id=tokenizer.pad_token_id)
print(scores[0]["divergence"].mean())
```
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..losses import per_token_divergence, sparse_divergence, unpack_topk
from ..models.introspection import check_same_vocabulary, cut_at_eos, eos_token_ids, vocab_size
from ..teachers import TopKTeacher
from .journal import GenerationJournal


__all__ = [
    "as_chat",
    "completion_logits",
    "encode_prompts",
    "eval_mode",
    "generate_completions",
    "pack_completions",
    "pad_token_id",
    "score_completions",
    "scored_chunks",
]

Chat = list[dict[str, str]]


def as_chat(prompt: Any) -> Chat:
    """A prompt as chat messages: a string is one user message, a `(messages, reference)` problem its messages.

    Example:
    ```python
    >>> from hf_rockopd.evaluation.rollout import as_chat
    >>> as_chat("1 + 1?"), as_chat(([{"role": "user", "content": "2 + 2?"}], 4.0))
    ([{'role': 'user', 'content': '1 + 1?'}], [{'role': 'user', 'content': '2 + 2?'}])
    ```
    """
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    # A chat's items are message dicts, never numbers or strings, so a pair ending in a reference answer is a problem.
    pair = isinstance(prompt, (tuple, list)) and len(prompt) == 2
    if pair and (prompt[1] is None or isinstance(prompt[1], (int, float, str))):
        return list(prompt[0])
    return list(prompt)


def _prompt_texts(tokenizer: Any, prompts: Sequence[Any]) -> list[str]:
    return [tokenizer.apply_chat_template(as_chat(p), tokenize=False, add_generation_prompt=True) for p in prompts]


def encode_prompts(tokenizer: Any, prompts: Sequence[Any]) -> list[list[int]]:
    """Token ids of each prompt's chat (chat template with the generation prompt, no extra special tokens), unpadded.

    `prompts` are chats, strings or `(messages, gold)` problems (`as_chat`). These are the ids `generate_completions`
    feeds the model; use them with `score_completions` or `evaluation.evaluate_completions` for completions made
    elsewhere.

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_tokenizer
    >>> from hf_rockopd.evaluation.rollout import encode_prompts
    >>> tokenizer = build_tiny_tokenizer()
    >>> encode_prompts(tokenizer, ["hi"]) == encode_prompts(tokenizer, [([{"role": "user", "content": "hi"}], 0.0)])
    True
    ```
    """
    return [list(ids) for ids in tokenizer(_prompt_texts(tokenizer, prompts), add_special_tokens=False)["input_ids"]]


def pad_token_id(tokenizer: Any) -> int:
    """The id that fills padded positions: the tokenizer's pad, else its eos (masked out either way).

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_tokenizer
    >>> pad_token_id(build_tiny_tokenizer())
    257
    ```
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad) if pad is not None else 0


@contextmanager
def eval_mode(*models: torch.nn.Module) -> Iterator[None]:
    """Put `models` in eval mode for the block and restore each one's training flag after it.

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_causal_lm
    >>> model = build_tiny_causal_lm().train()
    >>> with eval_mode(model):
    ...     model.training
    False
    >>> model.training
    True
    ```
    """
    states = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        yield
    finally:
        for m, state in zip(models, states):
            m.train(state)


class _Progress:
    """A logits processor that only moves a progress bar by one token per row at each decoding step."""

    def __init__(self, bar: Any, rows: int) -> None:
        self.bar, self.rows = bar, rows

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.bar.update(self.rows)
        return scores


@torch.no_grad()
def generate_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Any],
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    do_sample: bool = False,
    temperature: float = 1.0,
    suppress_tokens: Sequence[int] | None = None,
    show_progress: bool = True,
    journal: GenerationJournal | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """Completions of each prompt, batched and left-padded: `(prompt ids, completion ids)` per prompt.

    Generation stops at any of the model's stop ids (`modeling.eos_token_ids`: its generation config's list, else the
    tokenizer's eos); each completion is cut after its first one (`modeling.cut_at_eos`), so it ends with it or has
    `max_new_tokens` tokens. Decoding is greedy unless `do_sample` (then at `temperature`, no top-k/top-p; seed torch
    first for a reproducible draw). `suppress_tokens` bans ids: their logits are -inf at every step (the knockout).

    Args:
        prompts: chats, strings or `(messages, gold)` problems (`as_chat`).
        journal: a [`~hf_rockopd.evaluation.journal.GenerationJournal`]: batches it holds are read back, not generated
            again, and each new batch is written to it as soon as it is done, so a killed run resumes at its batch.

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer
    >>> from hf_rockopd.evaluation.rollout import generate_completions
    >>> tokenizer = build_tiny_tokenizer()
    >>> prompts, completions = generate_completions(build_tiny_causal_lm(tokenizer), tokenizer, ["hi", "2 + 2?"],
    ...                                             max_new_tokens=4, show_progress=False)
    >>> [len(c) <= 4 for c in completions], prompts[0] == encode_prompts(tokenizer, ["hi"])[0]
    ([True, True], True)
    ```
    """
    from tqdm.auto import tqdm
    from transformers import LogitsProcessorList

    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size} and {max_new_tokens}.")
    eos_ids = eos_token_ids(tokenizer, model)
    device = next(model.parameters()).device
    prompt_ids: list[list[int]] = []
    completion_ids: list[list[int]] = []
    # Progress in token slots (prompts x max_new_tokens), moved at every decoding step: a bar per batch sat at 0 for
    # minutes on a CPU. A batch that stops early jumps to its end.
    desc = "generate"
    if journal is not None and len(journal):
        # Said on the bar: a resumed run should show that it did not start again.
        batches = f"{len(journal)} batch" + ("es" if len(journal) != 1 else "")
        desc = f"generate ({batches} resumed from {os.path.basename(journal.path)})"
    bar = tqdm(total=len(prompts) * max_new_tokens, desc=desc, unit="tok", disable=not show_progress)
    with eval_mode(model), bar:
        for start in range(0, len(prompts), batch_size):
            rows = len(prompts[start : start + batch_size])
            slots_before = bar.n
            done = journal.batch(start) if journal is not None else None
            if done is not None and len(done[0]) == rows:
                prompt_ids.extend(done[0])
                completion_ids.extend(done[1])
                bar.update(rows * max_new_tokens)
                continue
            texts = _prompt_texts(tokenizer, prompts[start : start + batch_size])
            # Left padding, so every completion starts at the same column.
            padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
            try:
                enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            finally:
                tokenizer.padding_side = padding_side
            sequences = model.generate(
                input_ids=enc["input_ids"],
                attention_mask=enc["attention_mask"],
                max_new_tokens=max_new_tokens,
                do_sample=do_sample,
                temperature=temperature if do_sample else None,
                top_p=None,
                top_k=None,
                pad_token_id=pad_token_id(tokenizer),
                eos_token_id=eos_ids or None,
                # A ban: the token's logit is -inf at every step (transformers' SuppressTokensLogitsProcessor).
                suppress_tokens=list(suppress_tokens) if suppress_tokens else None,
                logits_processor=LogitsProcessorList([_Progress(bar, rows)]) if show_progress else None,
            )
            bar.update(slots_before + rows * max_new_tokens - bar.n)
            prompt_len = enc["input_ids"].shape[1]
            for row, mask in zip(sequences.cpu(), enc["attention_mask"].cpu()):
                prompt_ids.append(row[:prompt_len][mask.bool()].tolist())
                completion_ids.append(cut_at_eos(row[prompt_len:].tolist(), eos_ids))
            if journal is not None:
                journal.record(start, prompt_ids[-rows:], completion_ids[-rows:])
    return prompt_ids, completion_ids


def pack_completions(
    prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One batch: left-padded prompts then right-padded completions: `(input ids, attention mask, prompt length)`.

    Example:
    ```python
    >>> ids, mask, prompt_len = pack_completions([[1, 2], [3]], [[4], [5, 6]], pad_token_id=0)
    >>> ids.tolist(), mask.tolist(), prompt_len
    ([[1, 2, 4, 0], [0, 3, 5, 6]], [[1, 1, 1, 0], [0, 1, 1, 1]], 2)
    ```
    """
    prompt_len = max(len(p) for p in prompt_ids)
    completion_len = max(1, max(len(c) for c in completion_ids))
    ids = torch.full((len(prompt_ids), prompt_len + completion_len), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        ids[row, prompt_len - len(p) : prompt_len + len(c)] = torch.tensor([*p, *c], dtype=torch.long)
        mask[row, prompt_len - len(p) : prompt_len + len(c)] = 1
    return ids, mask, prompt_len


def completion_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int
) -> torch.Tensor:
    """`(B, end - prompt_len, V)` logits of the positions that predict the completion (`prompt_len - 1 ... end - 2`).

    Position ids come from the attention mask, as `generate` derives them, so left padding shifts no position and a
    token's logits are those it was generated from. `logits_to_keep` projects only those positions, never the
    prompt's: the head is the largest matrix product of a small model (SmolLM2: 49,152 × 576).

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_causal_lm
    >>> ids, mask, prompt_len = pack_completions([[1, 2, 3]], [[4, 5]], pad_token_id=0)
    >>> completion_logits(build_tiny_causal_lm(), ids, mask, prompt_len).shape[:2]
    torch.Size([1, 2])
    ```
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    keep = input_ids.shape[1] - prompt_len + 1
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=keep
    ).logits
    return logits[:, -keep:-1]


# Student and teacher logits of a scoring forward are (rows, completion length, vocabulary) float32 each, and the
# divergence makes several more of that size; with SmolLM2's 49,152 ids, 2,048 positions are 0.4 GB per tensor. The
# budget is in logit entries, so a larger vocabulary gets fewer positions: at Qwen2.5's 151,936 ids a fixed 2,048
# positions made the student evaluation peak at 21.2 GB (examples/reports/qwen_pair_baseline).
_SCORE_POSITIONS = 2048
_SCORE_ENTRIES = _SCORE_POSITIONS * 49_152


def _score_chunks(
    completion_ids: Sequence[Sequence[int]], batch_size: int, max_positions: int = _SCORE_POSITIONS
) -> list[tuple[int, int]]:
    """`(start, stop)` row ranges of at most `batch_size` rows and, past one row, `max_positions` positions."""
    chunks, start = [], 0
    while start < len(completion_ids):
        stop, longest = start + 1, max(1, len(completion_ids[start]))
        while stop < len(completion_ids) and stop - start < batch_size:
            longest = max(longest, len(completion_ids[stop]))
            if (stop - start + 1) * longest > max_positions:
                break
            stop += 1
        chunks.append((start, stop))
        start = stop
    return chunks


def _completion_positions(completions: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every completion token of a packed chunk, in completion then position order."""
    rows = torch.cat([torch.full((len(c),), r, dtype=torch.long) for r, c in enumerate(completions)])
    return rows, torch.cat([torch.arange(len(c)) for c in completions])


@torch.no_grad()
def scored_chunks(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    batch_size: int = 8,
    show_progress: bool = False,
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """`(start, stop, student logits, teacher logits)` per scoring batch of completions `start:stop`.

    The logits are float32 `(N, V)` on the student's device, one row per completion token of those completions in
    order (N is the sum of their lengths): the distributions that predicted each token. Batches hold at most
    `batch_size` completions and a bounded number of positions. Call it inside `eval_mode(student, teacher)`.

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_causal_lm
    >>> model = build_tiny_causal_lm()
    >>> [(a, b, s.shape[0]) for a, b, s, _ in scored_chunks(model, model, [[1], [2]], [[3, 4], [5]], pad_token_id=0)]
    [(0, 2, 3)]
    ```
    """
    from tqdm.auto import tqdm

    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"Got {len(prompt_ids)} prompts but {len(completion_ids)} completions; give one of each.")
    device = next(student.parameters()).device
    teacher_device = next(teacher.parameters()).device
    max_positions = max(1, _SCORE_ENTRIES // vocab_size(student))
    chunks = _score_chunks(completion_ids, batch_size, max_positions)
    # Counted in tokens, not batches: two batches of a 16-problem evaluation gave a bar that said nothing for minutes.
    bar = tqdm(total=sum(len(c) for c in completion_ids), desc="score", unit="tok", disable=not show_progress)
    for start, stop in chunks:
        completions = [list(c) for c in completion_ids[start:stop]]
        ids, mask, prompt_len = pack_completions(
            [list(p) for p in prompt_ids[start:stop]], completions, pad_token_id
        )
        s_logits = completion_logits(student, ids.to(device), mask.to(device), prompt_len)
        t_logits = completion_logits(teacher, ids.to(teacher_device), mask.to(teacher_device), prompt_len)
        rows, cols = _completion_positions(completions)
        s = s_logits[rows.to(device), cols.to(device)].float()
        t = t_logits[rows.to(teacher_device), cols.to(teacher_device)].float().to(device)
        bar.update(len(rows))
        yield start, stop, s, t
    bar.close()


@torch.no_grad()
def score_completions(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    batch_size: int = 8,
    beta: float = 1.0,
    temperature: float = 1.0,
    show_progress: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Per-token divergence and top-1 agreement of given completions, scored as training scores them.

    For each completion token, the full-vocabulary `per_token_divergence(student, teacher, beta, temperature)` of the
    two distributions that predicted it (`scored_chunks`), and whether both argmaxes agree. A completion's scores do
    not depend on what it is batched with.

    `teacher` may also be a top-k source (`hf_rockopd.teachers`: a served teacher, an offline cache): the
    divergence is then the tail-bin one over its listed ids (`losses.sparse`), as training computes it against the
    same source, and the teacher's argmax is its most likely listed id.

    Returns:
        one dict per completion: `divergence` (float32, one value per token), `agree` (bool, per token).

    Example:
    ```python
    >>> from hf_rockopd.models import build_tiny_causal_lm
    >>> model = build_tiny_causal_lm()
    >>> scores = score_completions(model, model, [[1, 2]], [[3, 4]], pad_token_id=0)
    >>> float(scores[0]["divergence"].abs().max()) < 1e-6, scores[0]["agree"].tolist()
    (True, [True, True])
    ```
    """
    if isinstance(teacher, TopKTeacher):
        return _score_against_topk(
            student, teacher, prompt_ids, completion_ids, pad_token_id=pad_token_id, batch_size=batch_size,
            beta=beta, temperature=temperature, show_progress=show_progress,
        )  # fmt: skip
    check_same_vocabulary(student, teacher)
    results: list[dict[str, torch.Tensor]] = []
    with eval_mode(student, teacher):
        chunks = scored_chunks(
            student, teacher, prompt_ids, completion_ids, pad_token_id=pad_token_id, batch_size=batch_size,
            show_progress=show_progress,
        )
        for start, stop, s, t in chunks:
            divergence = per_token_divergence(s, t, beta, temperature).cpu()
            agree = (s.argmax(-1) == t.argmax(-1)).cpu()
            lengths = [len(c) for c in completion_ids[start:stop]]
            for d, a in zip(divergence.split(lengths), agree.split(lengths)):
                results.append({"divergence": d, "agree": a})
    return results


@torch.no_grad()
def _score_against_topk(
    student: torch.nn.Module,
    teacher: TopKTeacher,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    batch_size: int,
    beta: float,
    temperature: float,
    show_progress: bool,
) -> list[dict[str, torch.Tensor]]:
    """`score_completions` against a top-k source: the student's logits of each completion token, the source's packed
    targets of the same token (asked for completion positions only), the tail-bin divergence."""
    from tqdm.auto import tqdm

    device = next(student.parameters()).device
    results: list[dict[str, torch.Tensor]] = []
    chunks = _score_chunks(completion_ids, batch_size, max(1, _SCORE_ENTRIES // vocab_size(student)))
    bar = tqdm(total=sum(len(c) for c in completion_ids), desc="score", unit="tok", disable=not show_progress)
    with eval_mode(student):
        for step, (start, stop) in enumerate(chunks):
            completions = [list(c) for c in completion_ids[start:stop]]
            ids, mask, prompt_len = pack_completions([list(p) for p in prompt_ids[start:stop]], completions, pad_token_id)
            needed = torch.zeros_like(mask, dtype=torch.bool)
            needed[:, prompt_len:] = mask[:, prompt_len:].bool()
            targets = teacher.targets(ids, mask, step=step, needed=needed)
            s_logits = completion_logits(student, ids.to(device), mask.to(device), prompt_len)
            rows, cols = _completion_positions(completions)
            s = s_logits[rows.to(device), cols.to(device)].float()
            t_ids, t_lp = unpack_topk(targets[rows, prompt_len + cols].to(device))
            if bool((t_ids[:, 0] < 0).any()):
                raise ValueError(
                    f"The teacher source ({teacher.source}) returned no entry for some completion positions of "
                    f"completions {start}-{stop - 1}."
                )
            divergence = sparse_divergence(s, t_ids, t_lp, beta, temperature).cpu()
            agree = (s.argmax(-1) == t_ids.gather(1, t_lp.argmax(-1, keepdim=True)).squeeze(1)).cpu()
            bar.update(len(rows))
            for d, a in zip(divergence.split([len(c) for c in completions]), agree.split([len(c) for c in completions])):
                results.append({"divergence": d, "agree": a})
    bar.close()
    return results
