"""Prompt batching for on-policy distillation: prompts are never cut; over-long prompts are a clear error."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from transformers.utils import logging
from trl.experimental.utils import DataCollatorForChatML


logger = logging.get_logger(__name__)

# Scanning more prompts than this before training costs more than it saves; beyond it the collator still checks
# every batch it builds.
MAX_PROMPTS_SCANNED = 100_000


class PromptTooLongError(ValueError):
    """A prompt does not fit in `max_length` tokens."""


@dataclass
class OnPolicyChatMLCollator(DataCollatorForChatML):
    """TRL's `DataCollatorForChatML`, but the prompt is never truncated.

    TRL's collator keeps the *last* `max_length` tokens of prompt + dataset completion, so a long dataset answer
    silently cuts the start of the question, and the student then generates from a mangled prompt. Here the prompt
    is kept whole and only the dataset completion (used when `lmbda < 1`) is shortened to fit; a prompt that alone
    exceeds `max_length` raises [`PromptTooLongError`]. Examples may carry `messages` (the last one is the dataset
    completion) or only a `prompt`: a list of messages, or a string already formatted with the chat template.

    Example:
    ```python
    >>> from hf_rockopd.trainers.data import OnPolicyChatMLCollator
    >>> from hf_rockopd.models import build_tiny_tokenizer
    >>> collator = OnPolicyChatMLCollator(tokenizer=build_tiny_tokenizer(), max_length=64)
    >>> batch = collator([{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}])
    >>> sorted(batch)[:3]
    ['attention_mask', 'byte_offsets', 'input_ids']
    ```
    """

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super().__call__([self._fit(example) for example in examples])
        if any("teacher" in example for example in examples):
            # Several served teachers: each row's teacher travels with the batch to the loss (see `teachers`).
            batch["teacher"] = [example.get("teacher") for example in examples]
        return batch

    def split(self, example: Mapping[str, Any]) -> tuple[list[int], list[int]]:
        """Token ids of the formatted prompt and of the dataset completion that follows it."""
        tokenizer = self.tokenizer
        prompt = example.get(self.prompt_key)
        messages = example.get(self.messages_key)
        if prompt is None and messages is None:
            raise ValueError(
                f"An example has neither {self.messages_key!r} nor {self.prompt_key!r}; it has {sorted(example)}. "
                "Give chat messages (the last one is the reference answer) or a prompt."
            )
        if prompt is None:
            if not messages:
                raise ValueError("An example has an empty `messages` list; give at least the user's question.")
            if messages[-1].get("role") != "assistant":
                # Only the question (on-policy data needs no reference answer): all of it is the prompt.
                prompt, messages = messages, None
            else:
                prompt = messages[:-1]
        if not isinstance(prompt, str):
            prompt = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if messages is None:
            return prompt_ids, []
        full = tokenizer.apply_chat_template(list(messages), add_generation_prompt=False, tokenize=False)
        if full.startswith(prompt):
            completion_ids = tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"]
        else:
            completion_ids = tokenizer(full, add_special_tokens=False)["input_ids"][len(prompt_ids) :]
        return prompt_ids, completion_ids

    def _fit(self, example: dict[str, Any]) -> dict[str, Any]:
        if "input_ids" in example:
            return example  # pre-tokenized: the parent uses its completion_mask and never truncates
        prompt_ids, completion_ids = self.split(example)
        if len(prompt_ids) > self.max_length:
            raise PromptTooLongError(
                f"A prompt has {len(prompt_ids)} tokens, more than max_length={self.max_length}. Cutting it would "
                "make the student answer a different question. Raise max_length or drop long prompts, e.g. "
                "dataset.filter(lambda ex: len(tokenizer.apply_chat_template(ex['messages'][:-1])) <= max_length)."
            )
        completion_ids = completion_ids[: self.max_length - len(prompt_ids)]
        ids = prompt_ids + completion_ids
        fitted = dict(example)
        messages = example.get(self.messages_key)
        if example.get(self.prompt_key) is None and messages and messages[-1].get("role") != "assistant":
            # TRL's collator formats `messages[:-1]` as the prompt; a chat without its answer turn is all prompt.
            fitted[self.prompt_key] = self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False
            )
        fitted.update(
            input_ids=ids,
            attention_mask=[1] * len(ids),
            completion_mask=[0] * len(prompt_ids) + [1] * len(completion_ids),
        )
        return fitted


def check_prompt_lengths(dataset: Iterable[Mapping[str, Any]], collator: OnPolicyChatMLCollator) -> None:
    """Raise [`PromptTooLongError`] naming every over-long prompt (up to 5) before any training starts.

    Example:
    ```python
    >>> from hf_rockopd.trainers.data import OnPolicyChatMLCollator, check_prompt_lengths
    >>> from hf_rockopd.models import build_tiny_tokenizer
    >>> collator = OnPolicyChatMLCollator(tokenizer=build_tiny_tokenizer(), max_length=64)
    >>> check_prompt_lengths([{"prompt": [{"role": "user", "content": "Hi"}]}], collator)  # fits: no error
    ```
    """
    if not hasattr(dataset, "__len__") or len(dataset) > MAX_PROMPTS_SCANNED:
        logger.info("Prompt lengths are checked batch by batch (dataset too large or streamed to scan up front).")
        return
    too_long = []
    for index, example in enumerate(dataset):
        if "input_ids" in example:
            continue
        n = len(collator.split(example)[0])
        if n > collator.max_length:
            too_long.append((index, n))
    if too_long:
        shown = ", ".join(f"#{i} ({n} tokens)" for i, n in too_long[:5])
        raise PromptTooLongError(
            f"{len(too_long)} of {len(dataset)} prompts are longer than max_length={collator.max_length}: {shown}. "
            "The student must see the whole prompt to answer it. Raise max_length in RockOPDConfig, or filter the "
            "dataset to prompts that fit."
        )
