"""The data options that `hf-rockopd distill` and `hf-rockopd ablate` share ([`DatasetArguments`]): one definition,
so a flag means the same in both commands."""

from __future__ import annotations

from dataclasses import dataclass, field

from .chat import check_system_prompt


__all__ = ["DatasetArguments"]


@dataclass
class DatasetArguments:
    r"""
    Where the training prompts and held-out problems come from; a base of the commands' own argument classes.

    Parameters:
        > Data

        dataset (`str`, *optional*, defaults to `"openai/gsm8k"`):
            A Hub id or a local file (JSONL, JSON, Parquet, CSV) or folder, in TRL's formats: `messages`, `prompt`
            (text or chat), or question/answer pairs (`hf_rockopd.data.detect_columns`). A Hub id is looked for
            locally first (`hf_rockopd.data.resolve_dataset`: `$HF_ROCKOPD_DATA_DIR`, `../shared/data/<name>/`, the
            `datasets` cache), then on the Hub.
        dataset_config (`str` or `None`, *optional*, defaults to `None`):
            Hub configuration name (`None`: the dataset's default; `main` for `openai/gsm8k`).
        dataset_split (`str`, *optional*, defaults to `"train"`):
            The split training prompts (and, without `eval_dataset`, the held-out problems) are drawn from.
        prompt_column, answer_column (`str` or `None`, *optional*, defaults to `None`):
            The columns holding the prompt and the reference answer, when the guess is wrong.
        eval_dataset (`str` or `None`, *optional*, defaults to `None`):
            Held-out problems from another dataset (same formats and columns); `None` draws them from `dataset`.
        eval_dataset_config, eval_dataset_split (defaults `None`, `"test"`): its configuration and split.
        system_prompt (`str` or `None`, *optional*, defaults to `None`):
            A system turn before every training prompt and held-out problem (e.g. asking for short answers, so
            that completions end within `max_new_tokens`). `None`: the chat template's default.

    Example:
    ```python
    >>> from hf_rockopd.data.arguments import DatasetArguments
    >>> DatasetArguments(dataset="HuggingFaceH4/MATH-500", dataset_split="test").eval_dataset_split
    'test'
    ```
    """

    dataset: str = field(
        default="openai/gsm8k",
        metadata={"help": "Hub id or local file/folder (JSONL, JSON, Parquet, CSV) in TRL's formats: messages, prompt, "
                  "or question/answer; a local copy is used first."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub configuration (default: the dataset's)."})
    dataset_split: str = field(default="train", metadata={"help": "Split the prompts are drawn from."})
    prompt_column: str | None = field(default=None, metadata={"help": "Column holding the prompt (default: guessed)."})
    answer_column: str | None = field(
        default=None, metadata={"help": "Column holding the reference answer (default: guessed)."}
    )
    eval_dataset: str | None = field(
        default=None, metadata={"help": "Held-out problems from this dataset instead of from --dataset."}
    )
    eval_dataset_config: str | None = field(default=None, metadata={"help": "Hub configuration of --eval_dataset."})
    eval_dataset_split: str = field(default="test", metadata={"help": "Split of --eval_dataset."})
    system_prompt: str | None = field(
        default=None, metadata={"help": "System turn before every prompt and problem (default: the template's)."}
    )

    def __post_init__(self):
        check_system_prompt(self.system_prompt)
