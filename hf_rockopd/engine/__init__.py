"""The shared rock-token engine: token weights, projection of the weighted rows only, the fused loss, normalization,
`rock/*` and `completions/*` metrics, policy state in checkpoints and `rock_tokens.json`.

A trainer composes one [`RockTokenEngine`] (see `hf_rockopd.engine.core`); `weighting`, `metrics` and `state` hold its
parts as plain functions, `sharding` its FSDP2 support (teacher sharding, gathered heads, set-up checks).

Example:
```python
>>> from hf_rockopd.engine import POLICY_STATE_NAME, RockTokenEngine
>>> POLICY_STATE_NAME
'rock_policy_state.pt'
```
"""

from .core import RockArguments, RockTokenEngine, build_policy, check_supported_setup
from .state import POLICY_STATE_NAME, load_policy_state, save_policy_state
from .weighting import LossPlan, Projection


__all__ = [
    "POLICY_STATE_NAME",
    "LossPlan",
    "Projection",
    "RockArguments",
    "RockTokenEngine",
    "build_policy",
    "check_supported_setup",
    "load_policy_state",
    "save_policy_state",
]
