"""Token policies: who decides how much each completion token counts in the distillation loss.

A policy sees a [`TokenBatch`] — for every loss position, the id of the token that position *predicts* (its label),
the validity mask and the step — and returns non-negative weights shaped like the mask. After the loss it may update
its statistics from the measured divergences. Policies never see the trainer.

Built-in policies (see `available_policies()`), each with a typed options dataclass:

| name             | class                 | options                | module          |
|------------------|-----------------------|------------------------|-----------------|
| `uniform`        | `UniformPolicy`       | `UniformConfig`        | `fixed.py`      |
| `rock_freeze`    | `RockFreezePolicy`    | `RockFreezeConfig`     | `fixed.py`      |
| `rock_online`    | `RockOnlinePolicy`    | `RockOnlineConfig`     | `online.py`     |
| `random_matched` | `RandomMatchedPolicy` | `RandomMatchedConfig`  | `matched.py`    |
| `loss_quantile`  | `LossQuantilePolicy`  | `LossQuantileConfig`   | `per_batch.py`  |
| `entropy`        | `EntropyPolicy`       | `EntropyConfig`        | `per_batch.py`  |

`base.py` holds the batch, the interface and the registry; `configs.py` the options; `statistics.py` the per-id
counts the rock policies share; `rock_set.py` the rock set itself (Rock Scores, the selection rule,
frequency-matched controls, the file format). Register your own policy with [`register_policy`] (an options
dataclass is optional: set the class's `config_class`).

Example:
```python
>>> from hf_rockopd.policies import RockOnlineConfig, RockOnlinePolicy, get_policy
>>> get_policy("rock_online", top_k=50).config == RockOnlinePolicy(config=RockOnlineConfig(top_k=50)).config
True
```
"""

from .base import (
    _REGISTRY,  # noqa: F401 - the registry itself, for tests that save and restore it
    TokenBatch,
    TokenPolicy,
    available_policies,
    build_policy_options,
    check_policy_kwargs,  # noqa: F401 - kept for callers of the former module
    get_policy,
    parse_policy_kwargs,
    policy_config_class,
    policy_summary,
    register_policy,
)
from .configs import (
    EntropyConfig,
    LossQuantileConfig,
    PolicyConfig,
    RandomMatchedConfig,
    RockFreezeConfig,
    RockOnlineConfig,
    UniformConfig,
)
from .fixed import RockFreezePolicy, UniformPolicy
from .matched import RandomMatchedPolicy
from .online import RockOnlinePolicy
from .per_batch import EntropyPolicy, LossQuantilePolicy
from .statistics import TokenStatistics


__all__ = [
    "EntropyConfig",
    "EntropyPolicy",
    "LossQuantileConfig",
    "LossQuantilePolicy",
    "PolicyConfig",
    "RandomMatchedConfig",
    "RandomMatchedPolicy",
    "RockFreezeConfig",
    "RockFreezePolicy",
    "RockOnlineConfig",
    "RockOnlinePolicy",
    "TokenBatch",
    "TokenPolicy",
    "TokenStatistics",
    "UniformConfig",
    "UniformPolicy",
    "available_policies",
    "build_policy_options",
    "get_policy",
    "parse_policy_kwargs",
    "policy_config_class",
    "policy_summary",
    "register_policy",
]
