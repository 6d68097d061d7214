"""A token policy's state in a checkpoint: written before the model, restored on resume, or reset when asked.

Example:
```python
>>> import tempfile
>>> from hf_rockopd.engine.state import load_policy_state, save_policy_state
>>> from hf_rockopd.policies import get_policy
>>> checkpoint = tempfile.mkdtemp()
>>> path = save_policy_state(get_policy("rock_freeze", token_ids=[3]), checkpoint)
>>> load_policy_state(get_policy("rock_freeze", token_ids=[3]), checkpoint)
```
"""

from __future__ import annotations

import os

import torch
from transformers.utils import logging

from ..policies import TokenPolicy


logger = logging.get_logger(__name__)

__all__ = ["POLICY_STATE_NAME", "load_policy_state", "save_policy_state"]

POLICY_STATE_NAME = "rock_policy_state.pt"


def save_policy_state(policy: TokenPolicy, checkpoint: str | os.PathLike) -> str:
    """Write `policy`'s name and state to `checkpoint/rock_policy_state.pt` (creating the folder); return the path."""
    os.makedirs(checkpoint, exist_ok=True)
    path = os.path.join(os.fspath(checkpoint), POLICY_STATE_NAME)
    torch.save({"policy": policy.name, "state": policy.state_dict()}, path)
    return path


def load_policy_state(policy: TokenPolicy, checkpoint: str | os.PathLike) -> None:
    """Restore `policy` from `checkpoint/rock_policy_state.pt`.

    Raises `FileNotFoundError` when the file is missing and `ValueError` when it is unreadable, holds no state, or was
    saved by another policy; the policy's own `load_state_dict` may raise `KeyError`/`TypeError` on a foreign state.
    """
    path = os.path.join(os.fspath(checkpoint), POLICY_STATE_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the checkpoint has no {POLICY_STATE_NAME}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise ValueError(f"{POLICY_STATE_NAME} is unreadable ({type(err).__name__}: {err})") from err
    if not isinstance(payload, dict) or "state" not in payload:
        raise ValueError(f"{POLICY_STATE_NAME} does not hold a policy state")
    if payload.get("policy") != policy.name:
        raise ValueError(f"it was saved by policy {payload.get('policy')!r}, but this run uses {policy.name!r}")
    policy.load_state_dict(payload["state"])
