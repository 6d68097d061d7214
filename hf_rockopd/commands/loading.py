"""What the lab and `eval` commands load: models, tokenizers and problems of any dataset, with the options for it.

The imports of other packages' loaders sit in one function each, inside the function, so a command's `--help` does
not import torch and a moved loader is a one-line change here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["LoadingArguments", "check_references", "load_model", "load_problems", "load_tokenizer"]


@dataclass
class LoadingArguments:
    """Where and in which precision the commands that run a model load it.

    Example:
    ```python
    >>> from hf_rockopd.commands.loading import LoadingArguments
    >>> LoadingArguments(dtype="bfloat16").device
    'cpu'
    ```
    """

    dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata={"help": "Dtype the models are loaded in."}
    )
    device: str = field(default="cpu", metadata={"help": "Device the models run on (cpu, cuda, cuda:1, ...)."})

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of float32, bfloat16, float16, got {self.dtype!r}.")


def load_model(name: str, loading: LoadingArguments):
    """A model by path or Hub id, found offline where possible (`hf_rockopd.models.resolve_causal_lm`), for inference.

    A LoRA adapter folder (`hf-rockopd distill --use_peft`'s output) is merged into its base, cut to the layers its
    `run_report.json` says the student kept. These commands only run models forward, so on CPU the linear layers
    are oneDNN-packed (`pack_for_inference`, benchmarks/decode.py): the same outputs to float32 rounding, generation
    2-2.5x faster on small batches.
    """
    import torch

    from ..models import pack_for_inference, resolve_causal_lm

    from ..models.adapters import is_adapter_dir, load_merged_adapter

    dtype = getattr(torch, loading.dtype)
    if is_adapter_dir(name):
        model = load_merged_adapter(name, dtype=dtype, kept_layers=_kept_layers(name), with_tokenizer=False).model
    else:
        model = resolve_causal_lm(name, dtype=dtype, with_tokenizer=False).model
    model = model.to(loading.device)
    pack_for_inference(model, skip=())  # the head too: nothing here reads its weight, only calls it
    return model


def _kept_layers(adapter_dir: str) -> list[int] | None:
    """The decoder layers of its base that an adapter's student kept, from the run's `run_report.json` if it has one."""
    import os

    from ..publishing.run_report import RUN_REPORT_NAME, load_run_report

    if not os.path.isfile(os.path.join(adapter_dir, RUN_REPORT_NAME)):
        return None
    return (load_run_report(adapter_dir).get("student") or {}).get("kept_layers")


def load_tokenizer(name: str):
    """The tokenizer of a path or Hub id, looked up locally first (`hf_rockopd.models.resolve_tokenizer`); an adapter
    folder without one of its own gives its base's."""
    import os

    from ..models import resolve_tokenizer
    from ..models.adapters import adapter_base_name, is_adapter_dir

    if is_adapter_dir(name) and not os.path.isfile(os.path.join(os.path.expanduser(name), "tokenizer_config.json")):
        name = adapter_base_name(name)
    return resolve_tokenizer(name)


def load_problems(source: Any, **kwargs: Any) -> list:
    """Problems of any dataset as `(messages, reference)` pairs (`hf_rockopd.data.load_problems`'s arguments)."""
    from ..data import load_problems as load

    return load(source, **kwargs)


def check_references(problems: list, verifier: str, where: str) -> None:
    """Raise `ValueError` naming the problem unless `verifier` can read every reference (`none` reads none)."""
    from ..evaluation.answers import reference_answer

    if verifier == "none":
        return
    for index, (_, reference) in enumerate(problems):
        if reference is None:
            raise ValueError(
                f"Problem {index} of {where!r} has no reference answer. Name the column with --answer_column, or "
                "evaluate without accuracy: --verifier none."
            )
        try:
            reference_answer(reference, verifier)
        except ValueError as err:
            raise ValueError(f"Problem {index} of {where!r}: {err}") from None
