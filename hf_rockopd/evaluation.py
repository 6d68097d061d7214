"""GSM8K evaluation of a student: answer accuracy, held-out on-policy divergence and teacher agreement.

The student answers held-out problems greedily (batched, left-padded, chat template, KV cache). Its own completions
are then scored the way training scores them: at every completion position, the full-vocabulary divergence
(`hf_rockopd.losses.per_token_divergence`, TRL's `beta` convention, at the training temperature) between the student's
and the teacher's distributions that predicted the generated token. The results:

- `accuracy`: share of problems whose final numeric answer (`extract_numeric_answer`) equals the gold one;
- `mean_divergence`: mean per-token divergence over all completion tokens (up to and including eos), and
  `mean_divergence_non_rock` over the tokens outside a rock set (the ones training does not freeze);
- `top1_agreement`: share of completion positions where the student's and the teacher's argmax agree.

Example:
```python
from hf_rockopd.evaluation import evaluate_gsm8k, load_gsm8k_problems

problems = load_gsm8k_problems("gsm8k/train.jsonl", limit=32, tail=True)  # or "openai/gsm8k", or a Dataset
result = evaluate_gsm8k(student, tokenizer, problems, teacher=teacher, rock_ids="run/rock_tokens.json")
print(result.table())
result.save("eval.json")
```
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from transformers.utils import logging

from .losses import per_token_divergence
from .modeling import check_same_vocabulary, cut_at_eos, eos_token_ids, vocab_size
from .rock_set import load_rock_set, validate_token_ids


logger = logging.get_logger(__name__)

__all__ = [
    "EvalResult",
    "Problem",
    "encode_prompts",
    "evaluate_completions",
    "evaluate_gsm8k",
    "extract_numeric_answer",
    "format_results_table",
    "generate_completions",
    "load_gsm8k_problems",
    "parse_gold_answer",
    "score_completions",
]

Problem = tuple[list[dict[str, str]], float]
"""A GSM8K-style problem: `(chat messages of the question, gold numeric answer)`, as `analysis.knockout` takes it."""

# ---------------------------------------------------------------------------------------------------------------------
# Final-answer extraction
# ---------------------------------------------------------------------------------------------------------------------

# Thousands may be grouped by commas ("1,234") or by spaces, including the no-break and thin spaces of typeset
# output ("1 234"); a group is exactly three digits, so "3 4" stays two numbers and "1,23" is not 123.
_SPACE = "[ \u00a0\u2009\u202f]"
_INTEGER = rf"(?:\d{{1,3}}(?:,\d{{3}})+(?!\d)|\d{{1,3}}(?:{_SPACE}\d{{3}})+(?!\d)|\d+)"
# A minus sign counts only where it cannot be a subtraction or a hyphen ("5-3", "x-2"): not after a word character.
_MINUS = r"(?<![\w.)\]])[-\u2212]"
_NUMBER = re.compile(
    rf"(?P<sign>{_MINUS}\s?)?(?:[$€£¥]\s?)?(?P<sign2>[-\u2212])?(?P<int>{_INTEGER})?(?P<frac>\.\d+)?"
)
_ANSWER_PHRASE = re.compile(r"(?:final\s+)?answer\s*(?:is|=|:|would\s+be|will\s+be)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\s*\{")


def _numbers(text: str) -> list[float]:
    """Every number in `text`, in order, as floats (currency, separators and signs understood)."""
    values = []
    for match in _NUMBER.finditer(text):
        integer, frac = match.group("int"), match.group("frac")
        if integer is None and frac is None:
            continue
        digits = re.sub(f"[,{_SPACE[1:-1]}]", "", integer or "0") + (frac or "")
        value = float(digits)
        if match.group("sign") or match.group("sign2"):
            value = -value
        values.append(value)
    return values


def _boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}`, braces balanced (so `\\boxed{\\frac{1}{2}}` is whole)."""
    contents = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                contents.append(text[start:i])
                break
    return contents


def _boxed_value(content: str) -> float | None:
    frac = re.fullmatch(r"\s*(-?)\s*\\d?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}\s*", content)
    if frac:
        num, den = _numbers(frac.group(2)), _numbers(frac.group(3))
        if len(num) == 1 and len(den) == 1 and den[0] != 0:
            return (-1 if frac.group(1) else 1) * num[0] / den[0]
        return None
    values = _numbers(content)
    return values[-1] if values else None


def extract_numeric_answer(text: str) -> float | None:
    """The final numeric answer of a GSM8K-style solution, or `None` when it has none.

    Rules, first that applies: the number after the last `####`; the number in the last `\\boxed{...}` (a
    `\\frac{a}{b}` is `a / b`); the first number after the last "answer is" / "answer:" / "answer =" that is followed
    by one; else the last number in the text. Numbers may carry thousands separators ("1,234", "1 234"), currency
    ("$1,234.50"), units or a percent sign ("12 km", "45%"), a sign ("-5", "−5", "-$5") and a trailing period
    ("is 5."). A hyphen after a word character is a subtraction, not a sign ("10-3" ends with 3).

    Example:
    ```python
    >>> from hf_rockopd.evaluation import extract_numeric_answer
    >>> extract_numeric_answer("48 / 2 = 24 clips in May.\\n#### 72"), extract_numeric_answer("So she earned $1,200.")
    (72.0, 1200.0)
    >>> extract_numeric_answer("The answer is -3.5 degrees, not 4."), extract_numeric_answer("no idea") is None
    (-3.5, True)
    ```
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_numeric_answer takes a string, got {type(text).__name__}.")
    marked = text.rsplit("####", 1)
    if len(marked) == 2:
        values = _numbers(marked[1])
        if values:
            return values[0]
    for content in reversed(_boxed_contents(text)):
        value = _boxed_value(content)
        if value is not None:
            return value
    for phrase in reversed(list(_ANSWER_PHRASE.finditer(text))):
        # Only the rest of the phrase's line, so "The answer is below.\n3 + 4 = 7" falls through to the last number.
        line = text[phrase.end() :].split("\n", 1)[0]
        # "The answer is 18 - 2 = 16": the result is what follows the last "=".
        values = _numbers(line.rsplit("=", 1)[-1]) or _numbers(line)
        if values:
            return values[0]
    values = _numbers(text)
    return values[-1] if values else None


def parse_gold_answer(answer: str) -> float:
    """The gold answer of a GSM8K `answer` field: the number after its `####` marker.

    Raises `ValueError` when there is no `####` followed by a number, naming the text, so a malformed data set fails
    before any generation.

    Example:
    ```python
    >>> from hf_rockopd.evaluation import parse_gold_answer
    >>> parse_gold_answer("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\\n#### 1,072")
    1072.0
    ```
    """
    marked = str(answer).rsplit("####", 1)
    values = _numbers(marked[1]) if len(marked) == 2 else []
    if not values:
        raise ValueError(
            f"No gold answer in {str(answer)[-80:]!r}: a GSM8K answer ends with '#### <number>'. Fix the data, or "
            "pass an answer field that holds GSM8K solutions."
        )
    return values[0]


def _is_correct(prediction: float | None, gold: float) -> bool:
    return prediction is not None and math.isclose(prediction, gold, rel_tol=1e-9, abs_tol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------------------------------

GSM8K_HUB_ID = "openai/gsm8k"


def load_gsm8k_problems(
    source: Any,
    *,
    limit: int | None = None,
    tail: bool = False,
    split: str = "train",
    question_field: str = "question",
    answer_field: str = "answer",
) -> list[Problem]:
    """GSM8K-style problems as `(messages, gold)` pairs, from a JSON-lines file, a `datasets.Dataset`, or the Hub.

    Args:
        source: a `.jsonl`/`.json` path, a `datasets.Dataset`, or `"openai/gsm8k"` (loaded with `load_dataset(...,
            "main", split=split)`; needs the Hub or its local cache).
        limit: keep this many problems (default: all).
        tail: take them from the end instead of the start: the end of a training file as a held-out set.
        question_field, answer_field: the columns holding the question and the GSM8K solution (`#### n` gold).

    Raises:
        ValueError: a missing column (the message lists the columns there are), an empty set, or an answer without a
            `####` gold number (the message names the row).

    Example:
    ```python
    >>> import json, os, tempfile
    >>> from hf_rockopd.evaluation import load_gsm8k_problems
    >>> path = os.path.join(tempfile.mkdtemp(), "p.jsonl")
    >>> _ = open(path, "w").write(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\\n#### 2"}) + "\\n")
    >>> load_gsm8k_problems(path)
    [([{'role': 'user', 'content': '1 + 1?'}], 2.0)]
    ```
    """
    from datasets import Dataset, load_dataset

    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (or None for all problems), got {limit}.")
    if isinstance(source, Dataset):
        dataset, name = source, "the dataset"
    elif isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        if os.path.isfile(name):
            dataset = load_dataset("json", data_files=name, split="train")
        elif name == GSM8K_HUB_ID:
            dataset = load_dataset(GSM8K_HUB_ID, "main", split=split)
        else:
            raise FileNotFoundError(
                f"No problem file at {name!r}. Give a JSON-lines file with `{question_field}` and `{answer_field}` "
                f"per line, or {GSM8K_HUB_ID!r} to load GSM8K from the Hub."
            )
    else:
        raise TypeError(f"source must be a path, a datasets.Dataset or {GSM8K_HUB_ID!r}, got {type(source).__name__}.")
    missing = [f for f in (question_field, answer_field) if f not in dataset.column_names]
    if missing:
        raise ValueError(
            f"{name} has no column {missing} (columns: {dataset.column_names}). GSM8K-style problems need "
            f"`{question_field}` and `{answer_field}`; pass question_field=/answer_field= (`--question-field`, "
            "`--answer-field`) to name other columns."
        )
    if len(dataset) == 0:
        raise ValueError(f"{name} holds no problem. Give at least one problem.")
    indices = range(len(dataset))
    if limit is not None:
        indices = indices[-limit:] if tail else indices[:limit]
    rows = dataset.select(indices)
    problems = []
    for index, question, answer in zip(indices, rows[question_field], rows[answer_field]):
        try:
            gold = parse_gold_answer(answer)
        except ValueError as err:
            raise ValueError(f"{name}, row {index}: {err}") from None
        problems.append(([{"role": "user", "content": str(question)}], gold))
    return problems


# ---------------------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class EvalResult:
    """The evaluation of a student on GSM8K-style problems; `to_dict()` is the JSON the run report stores.

    Parameters:
        accuracy: share of problems whose extracted final answer equals the gold one.
        num_problems: problems evaluated.
        mean_divergence: mean per-token divergence of the student's own greedy completions against the teacher over
            all completion tokens (None without a teacher).
        mean_divergence_non_rock: the same over tokens outside the rock set (None without rock ids or teacher).
        rock_token_share: share of completion tokens that are rock ids (None without rock ids).
        top1_agreement: share of completion positions where student and teacher argmax agree (None without teacher).
        num_tokens: completion tokens scored (up to and including each eos).
        mean_completion_length: mean completion length in tokens.
        clipped_ratio: share of completions that hit `max_new_tokens` without an eos.
        settings: how it was measured (max_new_tokens, batch_size, beta, temperature, num_rock_ids, seconds, ...).
        records: per-problem details (gold, prediction, correct, length, divergence, text); kept out of `to_dict()`
            unless asked for, so run reports stay small.

    Example:
    ```python
    >>> from hf_rockopd.evaluation import EvalResult
    >>> r = EvalResult(accuracy=0.5, num_problems=2, mean_divergence=0.1, mean_divergence_non_rock=None,
    ...                rock_token_share=None, top1_agreement=0.9, num_tokens=10, mean_completion_length=5.0,
    ...                clipped_ratio=0.0, settings={"max_new_tokens": 8})
    >>> EvalResult.from_dict(r.to_dict()) == r
    True
    ```
    """

    accuracy: float
    num_problems: int
    mean_divergence: float | None
    mean_divergence_non_rock: float | None
    rock_token_share: float | None
    top1_agreement: float | None
    num_tokens: int
    mean_completion_length: float
    clipped_ratio: float
    settings: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] | None = field(default=None, compare=False, repr=False)
    # Per completion token, in order: the generated id and its divergence; never serialized, kept so that
    # `with_rock_ids` can fill in the rock figures later without scoring again.
    token_ids: torch.Tensor | None = field(default=None, compare=False, repr=False)
    token_divergence: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def to_dict(self, include_records: bool = False) -> dict[str, Any]:
        """The JSON-ready dict (the run report's `eval.before` / `eval.after`); records only if asked for."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("token_ids", "token_divergence")}
        data["settings"] = dict(self.settings)
        if not include_records or self.records is None:
            data.pop("records")
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvalResult:
        """Read back a `to_dict()` (or a saved `eval.json`); a missing key is a `ValueError` naming it."""
        if not isinstance(data, Mapping):
            raise ValueError(f"An evaluation result is a JSON object, got {type(data).__name__}.")
        names = [f.name for f in fields(cls)]
        names = [n for n in names if n not in ("token_ids", "token_divergence")]
        required = [n for n in names if n not in ("settings", "records")]
        missing = [n for n in required if n not in data]
        if missing:
            raise ValueError(f"Not an evaluation result: keys {missing} are missing (got {sorted(data)}).")
        return cls(**{n: data[n] for n in names if n in data})

    def save(self, path: str | os.PathLike, include_records: bool = False) -> str:
        """Write `to_dict()` as JSON to `path`; returns the path."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(include_records=include_records), f, indent=2)
        return os.fspath(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> EvalResult:
        """Read a file written by `save`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def with_rock_ids(self, rock_ids: Sequence[int]) -> EvalResult:
        """A copy with `mean_divergence_non_rock` and `rock_token_share` for `rock_ids`, from the kept per-token scores.

        Before training there is no rock set yet; this fills in the "before" figures once training has found one,
        without generating or scoring again. Only a result made in this process (not one read from JSON) has the
        per-token scores.

        Example:
        ```python
        before = evaluate_gsm8k(student, tokenizer, problems, teacher=teacher)
        trainer.train()
        before = before.with_rock_ids(trainer.rock_policy.rock_ids())
        ```
        """
        if self.token_ids is None:
            raise ValueError(
                "This result has no per-token scores (it was read from JSON); evaluate again with rock_ids= instead."
            )
        ids = torch.as_tensor(list(rock_ids), dtype=torch.long)
        is_rock = torch.isin(self.token_ids, ids)
        non_rock = self.token_divergence is not None and bool((~is_rock).any())
        settings = {**self.settings, "num_rock_ids": len(ids)}
        return replace(
            self,
            rock_token_share=float(is_rock.double().mean()) if len(self.token_ids) else None,
            mean_divergence_non_rock=float(self.token_divergence[~is_rock].mean()) if non_rock else None,
            settings=settings,
        )

    def table(self) -> str:
        """A two-column text table of the metrics."""
        return format_results_table({"value": self})


_TABLE_ROWS = (
    ("accuracy", "accuracy", "{:.3f}"),
    ("mean divergence", "mean_divergence", "{:.4f}"),
    ("mean divergence (non-rock)", "mean_divergence_non_rock", "{:.4f}"),
    ("rock-token share", "rock_token_share", "{:.3f}"),
    ("top-1 agreement", "top1_agreement", "{:.3f}"),
    ("problems", "num_problems", "{:d}"),
    ("completion tokens", "num_tokens", "{:d}"),
    ("mean completion length", "mean_completion_length", "{:.1f}"),
    ("clipped ratio", "clipped_ratio", "{:.3f}"),
)


def format_results_table(results: Mapping[str, EvalResult | Mapping[str, Any]]) -> str:
    """A text table with one column per result (e.g. `{"before": r0, "after": r1}`); None shows as `-`.

    Example:
    ```python
    print(format_results_table({"before": before, "after": after}))
    ```
    """
    columns = {k: v.to_dict() if isinstance(v, EvalResult) else dict(v) for k, v in results.items()}
    rows = [["metric", *columns]]
    for label, key, fmt in _TABLE_ROWS:
        rows.append([label, *("-" if c.get(key) is None else fmt.format(c[key]) for c in columns.values())])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Generation and scoring
# ---------------------------------------------------------------------------------------------------------------------


def encode_prompts(tokenizer: Any, problems: Sequence[Problem]) -> list[list[int]]:
    """Token ids of each problem's chat prompt (chat template with the generation prompt, no extra special tokens).

    These are the ids `generate_completions` feeds the model; use them with `evaluate_completions` for completions
    made elsewhere.
    """
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m, _ in problems]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


@torch.no_grad()
def generate_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    show_progress: bool = True,
) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy completions of each problem, batched and left-padded: `(prompt ids, completion ids)` per problem.

    Each completion stops at (and includes) its first eos, or has `max_new_tokens` tokens.
    """
    from tqdm.auto import tqdm

    # analysis imports this module's answer extraction, so its generation helper is imported here, not at the top.
    from .analysis import _generate

    eos_ids = eos_token_ids(tokenizer, model)
    was_training = model.training
    model.eval()
    prompts, completions = [], []
    try:
        for start in tqdm(range(0, len(problems), batch_size), desc="generate", disable=not show_progress):
            chunk = problems[start : start + batch_size]
            sequences, prompt_mask, prompt_len = _generate(model, tokenizer, [m for m, _ in chunk], max_new_tokens)
            for row, mask in zip(sequences.cpu(), prompt_mask.cpu()):
                prompts.append(row[:prompt_len][mask.bool()].tolist())
                completions.append(cut_at_eos(row[prompt_len:].tolist(), eos_ids))
    finally:
        model.train(was_training)
    return prompts, completions


def _completion_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int
) -> torch.Tensor:
    """Logits of the positions that predict the completion tokens: those at `prompt_len - 1 ... end - 1`."""
    # Position ids from the mask, as `generate` derives them, so left padding does not shift any position.
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    keep = input_ids.shape[1] - prompt_len + 1
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=keep
    ).logits
    return logits[:, -keep:-1]


# Student and teacher logits of a scoring forward are (rows, completion length, vocabulary) float32 each; with
# SmolLM2's 49,152 ids, 2,048 positions are 0.4 GB per model (16 completions of 256 tokens would be 0.8 GB).
_SCORE_POSITIONS = 2048


def _score_chunks(completion_ids: Sequence[Sequence[int]], batch_size: int) -> list[tuple[int, int]]:
    """`(start, stop)` row ranges of at most `batch_size` rows and, past one row, `_SCORE_POSITIONS` positions."""
    chunks, start = [], 0
    while start < len(completion_ids):
        stop, longest = start + 1, max(1, len(completion_ids[start]))
        while stop < len(completion_ids) and stop - start < batch_size:
            longest = max(longest, len(completion_ids[stop]))
            if (stop - start + 1) * longest > _SCORE_POSITIONS:
                break
            stop += 1
        chunks.append((start, stop))
        start = stop
    return chunks


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
    two distributions that predicted it, and whether both argmaxes agree. Batches are left-padded prompts followed by
    right-padded completions, with position ids from the attention mask, so a completion's scores do not depend on
    what it is batched with.

    Returns:
        one dict per completion: `divergence` (float32, one value per token), `agree` (bool, per token).
    """
    from tqdm.auto import tqdm

    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"Got {len(prompt_ids)} prompts but {len(completion_ids)} completions; give one of each.")
    check_same_vocabulary(student, teacher)
    device = next(student.parameters()).device
    teacher_device = next(teacher.parameters()).device
    states = (student.training, teacher.training)
    student.eval()
    teacher.eval()
    results: list[dict[str, torch.Tensor]] = []
    try:
        for start, stop in tqdm(
            _score_chunks(completion_ids, batch_size), desc="score", disable=not show_progress
        ):
            prompts = [list(p) for p in prompt_ids[start:stop]]
            completions = [list(c) for c in completion_ids[start:stop]]
            prompt_len = max(len(p) for p in prompts)
            completion_len = max(1, max(len(c) for c in completions))
            ids = torch.full((len(prompts), prompt_len + completion_len), pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, c) in enumerate(zip(prompts, completions)):
                ids[row, prompt_len - len(p) : prompt_len + len(c)] = torch.tensor(p + c, dtype=torch.long)
                mask[row, prompt_len - len(p) : prompt_len + len(c)] = 1
            s_logits = _completion_logits(student, ids.to(device), mask.to(device), prompt_len)
            t_logits = _completion_logits(teacher, ids.to(teacher_device), mask.to(teacher_device), prompt_len)
            for row, c in enumerate(completions):
                s, t = s_logits[row, : len(c)].float(), t_logits[row, : len(c)].float().to(s_logits.device)
                results.append(
                    {
                        "divergence": per_token_divergence(s, t, beta, temperature).cpu(),
                        "agree": (s.argmax(-1) == t.argmax(-1)).cpu(),
                    }
                )
    finally:
        student.train(states[0])
        teacher.train(states[1])
    return results


def _rock_id_list(rock_ids: Any, vocab_size: int) -> list[int] | None:
    if rock_ids is None:
        return None
    if isinstance(rock_ids, (str, os.PathLike)):
        return load_rock_set(rock_ids, vocab_size=vocab_size)["token_ids"]
    return validate_token_ids(list(rock_ids), vocab_size, source="rock_ids")


def _check_problems(problems: Sequence[Problem]) -> None:
    if len(problems) == 0:
        raise ValueError("No problem to evaluate. Give at least one (messages, gold) problem (see load_gsm8k_problems).")
    for index, problem in enumerate(problems):
        if not (isinstance(problem, (tuple, list)) and len(problem) == 2 and isinstance(problem[1], (int, float))):
            raise ValueError(
                f"Problem {index} is {problem!r:.80}; a problem is a (messages, gold number) pair, as "
                "load_gsm8k_problems returns."
            )


def evaluate_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    teacher: torch.nn.Module | None = None,
    rock_ids: Sequence[int] | str | os.PathLike | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    beta: float = 1.0,
    temperature: float = 1.0,
    show_progress: bool = False,
) -> EvalResult:
    """Evaluate given completions of `problems` (by the student `model`): accuracy, divergence, agreement.

    `evaluate_gsm8k` calls this on the student's greedy completions; call it directly for completions made elsewhere
    (`encode_prompts` gives the prompt ids). A completion without eos that has `max_new_tokens` tokens counts as
    clipped. See `evaluate_gsm8k` for the arguments.

    Example:
    ```python
    prompts = encode_prompts(tokenizer, problems)
    completions = [tokenizer("The answer is 4.<|im_end|>")["input_ids"] for _ in problems]
    result = evaluate_completions(student, tokenizer, problems, prompts, completions, teacher=teacher)
    ```
    """
    _check_problems(problems)
    if not len(problems) == len(prompt_ids) == len(completion_ids):
        raise ValueError(
            f"Got {len(problems)} problems, {len(prompt_ids)} prompts and {len(completion_ids)} completions; give one "
            "prompt and one completion per problem."
        )
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size} and {max_new_tokens}.")
    started = time.perf_counter()
    vocab = vocab_size(model)
    rocks = _rock_id_list(rock_ids, vocab)
    eos_ids = eos_token_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids or [0])[0]

    records = []
    for (_, gold), completion in zip(problems, completion_ids):
        text = tokenizer.decode(list(completion), skip_special_tokens=True)
        prediction = extract_numeric_answer(text)
        ended = any(int(t) in eos_ids for t in completion)
        records.append(
            {
                "gold": gold,
                "prediction": prediction,
                "correct": _is_correct(prediction, gold),
                "num_tokens": len(completion),
                "clipped": not ended and len(completion) >= max_new_tokens,
                "completion": text,
            }
        )
    lengths = [r["num_tokens"] for r in records]
    num_tokens = sum(lengths)
    token_ids = torch.tensor([int(t) for c in completion_ids for t in c], dtype=torch.long)
    is_rock = torch.isin(token_ids, torch.tensor(rocks, dtype=torch.long)) if rocks is not None else None

    mean_div = mean_div_non_rock = agreement = divergence = None
    if teacher is not None and num_tokens > 0:
        scores = score_completions(
            model, teacher, prompt_ids, completion_ids, pad_token_id=pad, batch_size=batch_size, beta=beta,
            temperature=temperature, show_progress=show_progress,
        )
        divergence = torch.cat([s["divergence"] for s in scores]).double()
        agree = torch.cat([s["agree"] for s in scores])
        if not torch.isfinite(divergence).all():
            raise ValueError(
                "The student-teacher divergence is not finite on some completion tokens; check both models' weights "
                "and dtype (float16 logits can overflow; use float32)."
            )
        mean_div, agreement = float(divergence.mean()), float(agree.double().mean())
        for record, score in zip(records, scores):
            record["mean_divergence"] = float(score["divergence"].double().mean()) if len(score["divergence"]) else None
        if is_rock is not None and (~is_rock).any():
            mean_div_non_rock = float(divergence[~is_rock].mean())
    elif teacher is not None:
        logger.warning("Every completion is empty: no token to score against the teacher.")

    result = EvalResult(
        accuracy=sum(r["correct"] for r in records) / len(records),
        num_problems=len(records),
        mean_divergence=mean_div,
        mean_divergence_non_rock=mean_div_non_rock,
        rock_token_share=float(is_rock.double().mean()) if is_rock is not None and num_tokens else None,
        top1_agreement=agreement,
        num_tokens=num_tokens,
        mean_completion_length=num_tokens / len(records),
        clipped_ratio=sum(r["clipped"] for r in records) / len(records),
        settings={
            "max_new_tokens": max_new_tokens,
            "batch_size": batch_size,
            "beta": beta,
            "temperature": temperature,
            "num_rock_ids": len(rocks) if rocks is not None else 0,
            "teacher": teacher is not None,
            "decoding": "greedy",
            "scoring_seconds": round(time.perf_counter() - started, 3),
        },
        records=records,
        token_ids=token_ids,
        token_divergence=divergence,
    )
    return result


def evaluate_gsm8k(
    model: torch.nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    teacher: torch.nn.Module | None = None,
    rock_ids: Sequence[int] | str | os.PathLike | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    beta: float = 1.0,
    temperature: float = 1.0,
    show_progress: bool = True,
) -> EvalResult:
    """Evaluate a student on GSM8K-style problems: accuracy, held-out on-policy divergence, teacher agreement.

    The student answers every problem greedily (batched, left-padded, chat template, KV cache); its completions are
    then scored against the teacher with the training divergence (`beta`, `temperature`: use the training run's).

    Args:
        model: the student.
        tokenizer: its tokenizer (shared with the teacher); its chat template formats the questions.
        problems: `(messages, gold)` pairs (`load_gsm8k_problems`).
        teacher: the teacher; without one only accuracy and lengths are measured.
        rock_ids: a rock set, as ids or a `rock_tokens.json` / `rock_set.json` path (checked against the student's
            vocabulary), for `mean_divergence_non_rock` and `rock_token_share`.
        max_new_tokens: the longest completion; longer answers are cut and counted in `clipped_ratio`.
        batch_size: problems per generation and scoring batch.
        beta, temperature: the divergence, as in training (TRL's convention: 1 reverse KL, 0 forward KL).
        show_progress: tqdm bars for generation and scoring.

    Returns:
        `EvalResult`, with per-problem `records`.

    Example:
    ```python
    result = evaluate_gsm8k(student, tokenizer, load_gsm8k_problems("gsm8k.jsonl", limit=32, tail=True),
                            teacher=teacher, rock_ids="run/rock_tokens.json", max_new_tokens=256)
    print(result.accuracy, result.mean_divergence, result.top1_agreement)
    ```
    """
    _check_problems(problems)
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size} and {max_new_tokens}.")
    # Bad rock sets and vocabularies fail here, before minutes of generation.
    _rock_id_list(rock_ids, vocab_size(model))
    if teacher is not None:
        check_same_vocabulary(model, teacher)
    started = time.perf_counter()
    prompts, completions = generate_completions(
        model, tokenizer, problems, max_new_tokens=max_new_tokens, batch_size=batch_size, show_progress=show_progress
    )
    generation_seconds = time.perf_counter() - started
    result = evaluate_completions(
        model, tokenizer, problems, prompts, completions, teacher=teacher, rock_ids=rock_ids,
        max_new_tokens=max_new_tokens, batch_size=batch_size, beta=beta, temperature=temperature,
        show_progress=show_progress,
    )
    result.settings["generation_seconds"] = round(generation_seconds, 3)
    result.settings["wall_seconds"] = round(time.perf_counter() - started, 3)
    return result
