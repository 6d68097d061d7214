"""The two rock-token trainers behind one interface, so trainer-level tests run against both (the `kind` fixture).

- `gkd`: `RockOPDTrainer` on TRL's `GKDTrainer`; datasets of `messages`, batches of `input_ids`/`labels`.
- `distillation`: `RockDistillationTrainer` on TRL's `DistillationTrainer`; datasets of `prompt`s, batches of
  `prompt_ids`/`completion_ids`/`completion_mask` (and `tool_mask`).

`kind.batch(trainer)` is an off-policy batch (the dataset's own answers), so numbers are deterministic;
`kind.view(inputs)` is the same batch as `input_ids`/`attention_mask`/`labels` (-100 where no loss is taken), the form
the reference computations of the tests read.
"""

from __future__ import annotations

import torch
from conftest import COMPLETION_TOKENS, TRAIN_SETTINGS, make_args, make_dataset, qa
from datasets import Dataset

from hf_rockopd import RockDistillationConfig, RockDistillationTrainer, RockOPDTrainer


class _Kind:
    trainer_class: type

    def dataset(self, n: int = 16) -> Dataset:
        raise NotImplementedError

    def make(self, student, teacher, args, tokenizer, dataset=None, **kwargs):
        return self.trainer_class(
            model=student,
            teacher_model=teacher,
            args=args,
            train_dataset=dataset if dataset is not None else self.dataset(),
            processing_class=tokenizer,
            **kwargs,
        )


class GKDKind(_Kind):
    name = "gkd"
    trainer_class = RockOPDTrainer

    def args(self, output_dir, **overrides):
        return make_args(output_dir, **overrides)

    def dataset(self, n: int = 16) -> Dataset:
        return make_dataset(n)

    def batch(self, trainer, n: int = 4) -> dict:
        inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(n)])
        return {k: v for k, v in inputs.items() if torch.is_tensor(v)}

    def view(self, inputs: dict) -> dict:
        return inputs

    def drop_all_completion_tokens(self, inputs: dict) -> dict:
        return {**inputs, "labels": torch.full_like(inputs["labels"], -100)}


class DistillationKind(_Kind):
    name = "distillation"
    trainer_class = RockDistillationTrainer

    def args(self, output_dir, **overrides):
        # Same settings as `conftest.make_args`, under DistillationConfig's names; `lmbda` has no counterpart
        # (DistillationTrainer is always on-policy).
        overrides.pop("lmbda", None)
        if "max_new_tokens" in overrides:
            overrides["max_completion_length"] = overrides.pop("max_new_tokens")
        defaults = dict(output_dir=str(output_dir), max_completion_length=COMPLETION_TOKENS, **TRAIN_SETTINGS)
        defaults.update(overrides)
        return RockDistillationConfig(**defaults)

    def dataset(self, n: int = 16) -> Dataset:
        return Dataset.from_list([{"prompt": [{"role": "user", "content": qa(i)[0]}]} for i in range(n)])

    def batch(self, trainer, n: int = 4, tool_mask: bool = False) -> dict:
        return distillation_batch(trainer.processing_class, range(n), tool_mask=tool_mask)

    def view(self, inputs: dict) -> dict:
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            mask &= inputs["tool_mask"].bool()
        labels = torch.full_like(input_ids, -100)
        labels[:, inputs["prompt_ids"].size(1) :] = inputs["completion_ids"].masked_fill(~mask, -100)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def drop_all_completion_tokens(self, inputs: dict) -> dict:
        no_tokens = torch.zeros_like(inputs["completion_mask"])
        return {**inputs, "tool_mask": no_tokens, "num_items_in_batch": torch.tensor(0)}


def distillation_batch(tokenizer, indices, tool_mask: bool = False) -> dict:
    """A batch as `DistillationTrainer._generate_and_score_completions` builds it (prompts padded left, completions
    right), with the dataset's answers as completions; with `tool_mask`, every 5th completion token of each row is
    marked as tool output (0)."""
    prompts, completions = [], []
    for i in indices:
        question, answer = qa(i)
        messages = [{"role": "user", "content": question}]
        prompts.append(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        completions.append(tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"][: 12 + i])
    pad = tokenizer.pad_token_id
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.tensor([[pad] * (width_p - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [pad] * (width_c - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completions])
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }
    loss_mask = completion_mask
    if tool_mask:
        tools = torch.ones_like(completion_mask)
        tools[:, 2::5] = 0
        batch["tool_mask"] = tools
        loss_mask = completion_mask * tools
    batch["num_items_in_batch"] = loss_mask.sum()
    return batch


KINDS = {"gkd": GKDKind(), "distillation": DistillationKind()}
