"""`hf-rockopd ablate`: token policies × seeds at one budget, resumable (the command lives with its job in
`hf_rockopd.ablate.runner`; this module only names it for the dispatcher)."""

from __future__ import annotations

from ..ablate.runner import COMMANDS

__all__ = ["COMMANDS"]
