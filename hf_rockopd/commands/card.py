"""`hf-rockopd card RUN_DIR`: render the model card of a saved run, to check it before an upload."""

from __future__ import annotations

from dataclasses import dataclass, field

from .parsing import Command

__all__ = ["COMMANDS", "CardArguments", "card"]


@dataclass
class CardArguments:
    """Options of `card`.

    Example:
    ```python
    >>> from hf_rockopd.commands.card import CardArguments
    >>> CardArguments(run_dir="runs/smollm2-rockopd", model_id="me/smollm2-rockopd").out is None
    True
    ```
    """

    run_dir: str = field(
        metadata={"help": "Output directory of `hf-rockopd distill` (run_report.json, rock_tokens.json)."}
    )
    out: str | None = field(
        default=None, metadata={"help": "Card path (default RUN_DIR/README.md); the curves PNG goes next to it."}
    )
    model_id: str | None = field(
        default=None, metadata={"help": "Hub id shown in the loading snippet (e.g. me/smollm2-rockopd)."}
    )


def card(args: CardArguments) -> int:
    """Run `card`: write the model card and print its path."""
    from ..publishing.model_card import write_model_card

    print(f"wrote {write_model_card(args.run_dir, out=args.out, model_id=args.model_id)}")
    return 0


COMMANDS = (
    Command("card", "render the model card of a saved run (to check it before upload)", (CardArguments,), card,
            positionals=("run_dir",)),
)
