"""`hf-rockopd`: the command line of the rock-token lab and the main job.

Every subcommand reads and writes plain files, so each step can be rerun and compared. Options are dataclass fields
spelled as in TRL's scripts (`--max_new_tokens 64`), and any of them can come from a YAML file (`--config FILE`):

```
hf-rockopd analyze collect --student S --teacher T --prompts gsm8k.jsonl --limit 500 --out tables/early
hf-rockopd analyze score tables/early --top_k 100 --out rock_set.json
hf-rockopd analyze stability tables/early --ks 25 50 100 150 200
hf-rockopd analyze controls tables/early --rock_set rock_set.json --out controls.json
hf-rockopd analyze compare tables/early tables/late --rock_set rock_set.json
hf-rockopd analyze gradients tables/early --rock_set rock_set.json
hf-rockopd analyze knockout --model S --problems gsm8k.jsonl --rock_set rock_set.json --top 20 --limit 200
hf-rockopd eval --model S --teacher T --problems gsm8k.jsonl --limit 32 --tail --rock_set rock_tokens.json --out eval.json
hf-rockopd analyze report tables/early --rock_set rock_set.json --knockout knockout.csv --out report/
hf-rockopd card runs/smollm2-rockopd --model_id me/smollm2-rockopd
hf-rockopd distill --config examples/configs/distill_smollm2.yaml
hf-rockopd serve-teacher --model T --port 8000 --max_top_k 64
hf-rockopd ablate --teacher T --student S --dataset gsm8k.jsonl --policies uniform rock_freeze --seeds 0 1 2 --output_dir runs/ablate
```

This module only dispatches: a subcommand's options and the function that runs it are a
[`~hf_rockopd.commands.parsing.Command`] in `hf_rockopd.commands`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from .commands.parsing import Command

# First word of a subcommand -> its module in hf_rockopd.commands. Imported on use, so that `analyze score` does not
# import the trainer's configuration (trl.experimental) that `distill` needs.
MODULES = {
    "analyze": "lab",
    "eval": "evaluate",
    "card": "card",
    "distill": "distill",
    "ablate": "ablate",
    "serve-teacher": "serve",
    "teacher-cache": "teacher_cache",
    "verdict": "verdict",
}


def commands(first_word: str | None = None) -> dict[str, Command]:
    """The subcommands by name (`"analyze score"`, `"eval"`, ...), all or those starting with `first_word`.

    Example:
    ```python
    >>> from hf_rockopd.cli import commands
    >>> sorted(commands("analyze"))[:2]
    ['analyze collect', 'analyze compare']
    ```
    """
    words = [first_word] if first_word in MODULES else list(MODULES)
    modules = [importlib.import_module(f"hf_rockopd.commands.{MODULES[word]}") for word in words]
    return {command.name: command for module in modules for command in module.COMMANDS}


def _usage(first_word: str | None = None) -> str:
    table = commands(first_word)
    width = max(len(name) for name in table)
    prefix = f"{first_word} " if first_word in MODULES else ""
    lines = [f"usage: hf-rockopd {prefix}COMMAND [options]   (hf-rockopd COMMAND --help lists its options)", ""]
    lines += [f"  {name:<{width}}  {command.help}" for name, command in table.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-rockopd`. Bad input exits with status 2 and one line saying what is wrong.

    Example:
    ```python
    >>> from hf_rockopd.cli import main
    >>> main(["analyze", "score", "no/such/table", "--top_k", "0"])
    2
    ```
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    words = 2 if argv[:1] == ["analyze"] else 1
    name = " ".join(argv[:words])
    known = commands(argv[0]) if argv[:1] and argv[0] in MODULES else {}
    if name not in known:
        group = "analyze" if words == 2 else None
        if argv[words - 1 : words] in ([], ["-h"], ["--help"]):
            print(_usage(group))
            return 0
        print(_usage(group) + f"\n\nhf-rockopd: error: unknown command {name!r}", file=sys.stderr)
        return 2
    try:
        return known[name](argv[words:])
    except (ValueError, OSError) as err:  # OSError: missing files and models (ModelNotFoundError)
        print(f"hf-rockopd {name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
