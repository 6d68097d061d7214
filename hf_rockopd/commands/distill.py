"""`hf-rockopd distill`: the main job's command line (TRL's dialect: dataclass fields as flags, `--config`).

The options are the fields of [`~hf_rockopd.distill.DistillArguments`] (models, data, evaluation),
[`~hf_rockopd.RockOPDConfig`] (training, token policy, loss) and [`~hf_rockopd.distill.StudentModelConfig`] (TRL's
`ModelConfig`: LoRA and 4-bit), plus one `--policy.NAME` flag per option of the token policies
(`hf_rockopd.commands.policy_flags`). The options distill declared itself before it used TRL's `ModelConfig` parse
for one release with a `FutureWarning`: `--use_lora` is `--use_peft`, `--student_4bit` is `--load_in_4bit`.

```
hf-rockopd distill --config examples/configs/distill_smollm2.yaml
hf-rockopd distill --rock_policy rock_online --policy.top_k 50 --policy.warmup_steps 6 --use_peft --lora_r 8
```
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence

import torch

from ..distill import (  # the defaults live with the job, so ablate reads them without the command line
    DEFAULT_ROCK_ONLINE_KWARGS,
    DEFAULT_TRAINING_ARGS,
    DistillArguments,
    StudentModelConfig,
    run_distillation,
)
from ..policies import parse_policy_kwargs
from ..publishing.run_report import RUN_REPORT_NAME
from ..policies.rock_set import ROCK_TOKENS_NAME
from ..trainers.config import RockOPDConfig
from .parsing import Command, CommandParser
from .policy_flags import add_policy_options, policy_options, pop_policy_options

__all__ = ["COMMANDS", "DEFAULT_ROCK_ONLINE_KWARGS", "DEFAULT_TRAINING_ARGS", "build_parser", "main",
           "parse_arguments"]

# Flags of the options DistillArguments declared before TRL's ModelConfig took them over (one release).
RENAMED = {"--use_lora": "--use_peft", "--student_4bit": "--load_in_4bit"}


def _merge_policy_options(namespace: argparse.Namespace) -> None:
    """rock_policy_kwargs = the embedded rock_online defaults (when none are given), then the --policy.X flags."""
    flags = pop_policy_options(namespace)
    kwargs = parse_policy_kwargs(namespace.rock_policy_kwargs)
    if not kwargs and namespace.rock_policy == "rock_online":
        kwargs = dict(DEFAULT_ROCK_ONLINE_KWARGS)
    if flags:
        kwargs.update(policy_options(namespace.rock_policy, flags))
    namespace.rock_policy_kwargs = kwargs


def _current_option_names(namespace: argparse.Namespace) -> None:
    """Pass values under the names transformers reads now, so it has no deprecation to print about our defaults.

    `gradient_checkpointing` (TRL's default True, ours False) became `activation_checkpointing`; given only the old
    name, TrainingArguments copies it over with a FutureWarning. The value moves here instead, unchanged. Pinned
    memory needs an accelerator; without one torch warns and ignores it.
    """
    for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                     ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
        if getattr(namespace, new, None) is None and getattr(namespace, old, None) is not None:
            setattr(namespace, new, getattr(namespace, old))
            setattr(namespace, old, None)
    if getattr(namespace, "dataloader_pin_memory", False) and not torch.cuda.is_available():
        namespace.dataloader_pin_memory = False


def _prepare(namespace: argparse.Namespace) -> None:
    _merge_policy_options(namespace)
    _current_option_names(namespace)


def build_parser() -> CommandParser:
    """The parser of `hf-rockopd distill`: [`DistillArguments`], [`RockOPDConfig`], [`StudentModelConfig`]."""
    return DISTILL.parser()


def parse_arguments(argv: Sequence[str] | None = None) -> tuple[DistillArguments, RockOPDConfig, StudentModelConfig]:
    """Parse `hf-rockopd distill` options (flags, and a YAML file given with `--config`; flags win).

    Example:
    ```python
    >>> from hf_rockopd.commands.distill import parse_arguments
    >>> script, args, model_args = parse_arguments(["--max_steps", "2", "--use_peft", "--lora_r", "8"])
    >>> model_args.use_peft, model_args.lora_r, args.max_steps, args.output_dir, args.rock_policy_kwargs["warmup_steps"]
    (True, 8, 2, 'runs/smollm2-rockopd', 6)
    ```
    """
    return DISTILL.parse(list(sys.argv[1:] if argv is None else argv))


def distill(script: DistillArguments, args: RockOPDConfig, model_args: StudentModelConfig, *, argv: list[str]) -> int:
    """Run `hf-rockopd distill` and print the results table, the rock tokens and where everything was written."""
    result = run_distillation(script, args, model_args, command=shlex.join(["hf-rockopd", "distill", *argv]))
    evaluation = result.report["eval"]
    if evaluation["before"] and evaluation["after"]:
        from ..evaluation.table import format_results_table

        print("\n" + format_results_table({"before": evaluation["before"], "after": evaluation["after"]}))
    with open(os.path.join(result.output_dir, ROCK_TOKENS_NAME)) as f:
        rocks = json.load(f).get("tokens", [])
    shown = " ".join(repr(r.get("token", r.get("token_id"))) for r in rocks[:15])
    print(f"\nrock tokens ({len(rocks)}): {shown}{' ...' if len(rocks) > 15 else ''}")
    print(f"student:     {result.output_dir} ({'LoRA adapter' if model_args.use_peft else 'full model'})")
    print(f"run report:  {os.path.join(result.output_dir, RUN_REPORT_NAME)}")
    if result.model_card:
        print(f"model card:  {result.model_card}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-rockopd distill` (options as in [`parse_arguments`])."""
    return DISTILL(list(sys.argv[1:] if argv is None else argv))


DISTILL = Command(
    "distill",
    "rock-token OPD end to end: evaluate, train, evaluate, save, model card",
    (DistillArguments, RockOPDConfig, StudentModelConfig),
    distill,
    renamed=RENAMED,
    defaults=DEFAULT_TRAINING_ARGS,
    prepare=_prepare,
    extend=add_policy_options,
    with_argv=True,
)
COMMANDS = (DISTILL,)
