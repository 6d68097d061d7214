"""The model options that `hf-rockopd distill` and `hf-rockopd ablate` share ([`ModelPairArguments`]): one
definition, so `--teacher`, `--student` and `--student_num_layers` mean the same in both commands."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sources import SMOLLM2_ID


__all__ = ["ModelPairArguments"]


@dataclass
class ModelPairArguments:
    r"""
    The teacher and the student of a run; a base of the commands' own argument classes (each checks the values
    its own way).

    Parameters:
        > Models

        teacher (`str`, *optional*, defaults to `"HuggingFaceTB/SmolLM2-135M-Instruct"`):
            Hub id or local path of the teacher (see `hf_rockopd.models.resolve_causal_lm` for where it is looked up).
        student (`str` or `None`, *optional*, defaults to `None`):
            Hub id or local path of the student. `None`: a layer-pruned copy of the teacher.
        student_num_layers (`int` or `None`, *optional*, defaults to `None`):
            Keep this many decoder layers of the student's base model, dropping one contiguous block from the middle
            (`hf_rockopd.models.middle_block_layers`). `None` keeps all layers of an explicit student and 24 layers of
            a teacher copy.

    Example:
    ```python
    >>> from hf_rockopd.models.arguments import ModelPairArguments
    >>> ModelPairArguments(student_num_layers=12).teacher
    'HuggingFaceTB/SmolLM2-135M-Instruct'
    ```
    """

    teacher: str = field(default=SMOLLM2_ID, metadata={"help": "Hub id or local path of the teacher."})
    student: str | None = field(
        default=None, metadata={"help": "Hub id or local path of the student; default: a pruned copy of the teacher."}
    )
    student_num_layers: int | None = field(
        default=None,
        metadata={"help": "Decoder layers kept, a middle block dropped (default: 24 for a teacher copy, all otherwise)."},
    )
