"""`hf-rockopd ablate`: token policies x seeds at one budget, resumable; the command line of
`hf_rockopd.ablate.runner.run_ablation` (the job itself lives in the library, which never imports `commands/`).

```
hf-rockopd ablate --config examples/configs/ablate_qwen.yaml
```
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence

from ..ablate.arguments import DEFAULT_TRAINING_ARGS, AblateArguments, check_training_budget
from ..ablate.runner import run_ablation
from ..models.student_config import StudentModelConfig
from ..trainers import RockOPDConfig
from .parsing import Command

__all__ = ["ABLATE", "COMMANDS", "ablate", "main", "parse_arguments"]


def ablate(
    ablate_args: AblateArguments, args: RockOPDConfig, model_args: StudentModelConfig, *, argv: list[str]
) -> int:
    """Run `hf-rockopd ablate` and print the summary table and where its files are."""
    out = run_ablation(ablate_args, args, command=shlex.join(["hf-rockopd", "ablate", *argv]), model_args=model_args)
    summary = out["summary"]
    print(f"\ntrained {len(out['trained'])} run(s); finished ones are skipped.\n")
    print(summary["markdown"])
    for name, path in summary["files"].items():
        print(f"{name + ':':7s}{path}")
    return 0


ABLATE = Command(
    "ablate",
    "the paper's token-policy ablation: policies x seeds at one budget, resumable, compared with uniform",
    (AblateArguments, RockOPDConfig, StudentModelConfig),
    ablate,
    defaults=DEFAULT_TRAINING_ARGS,
    with_argv=True,
)
COMMANDS = (ABLATE,)


def parse_arguments(
    argv: Sequence[str] | None = None,
) -> tuple[AblateArguments, RockOPDConfig, StudentModelConfig]:
    """Parse `hf-rockopd ablate` options (flags, and a YAML file given with `--config`; flags win).

    Example:
    ```python
    >>> from hf_rockopd.commands.ablate import parse_arguments
    >>> ablate, args, model_args = parse_arguments(["--policies", "uniform", "soft", "--seeds", "0", "1",
    ...                                             "--max_steps", "4", "--use_peft", "--lora_r", "8"])
    >>> ablate.policies, ablate.seeds, args.max_steps, args.output_dir, model_args.use_peft, model_args.lora_r
    (['uniform', 'soft'], [0, 1], 4, 'runs/ablate', True, 8)
    ```
    """
    ablate_args, args, model_args = ABLATE.parse(list(sys.argv[1:] if argv is None else argv))
    check_training_budget(args)
    return ablate_args, args, model_args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-rockopd ablate` (options as in [`parse_arguments`]); the dispatcher runs `ABLATE`."""
    return ABLATE(list(sys.argv[1:] if argv is None else argv))
