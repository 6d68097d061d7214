"""The ablation of token policies (`hf-rockopd ablate`): policies × seeds at an identical budget, compared with
plain OPD (`uniform`) over problems and seeds.

`hf_rockopd.ablate.stats` holds its statistics, pure functions on per-problem outcomes.
"""

from .stats import (
    BASELINE_POLICY,
    AblationStats,
    PairedDifference,
    PolicySummary,
    RunOutcomes,
    ablation_stats,
    ablation_table,
    crossed_bootstrap,
    paired_difference,
    seed_interval,
)

__all__ = [
    "BASELINE_POLICY",
    "AblationStats",
    "PairedDifference",
    "PolicySummary",
    "RunOutcomes",
    "ablation_stats",
    "ablation_table",
    "crossed_bootstrap",
    "paired_difference",
    "seed_interval",
]
