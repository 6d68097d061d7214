"""The rock-token lab: collect token tables, score and select rock tokens, and test them the way the paper does.

Each step reads and writes plain files, so steps can be rerun and compared (arXiv 2605.09253, §3-§4):

- `collect_token_table` (`lab.collect`): roll out prompts with the student and score every generated token against the
  teacher with the training divergence (through `hf_rockopd.evaluation.rollout`, as evaluation does), into a *token table*
  (`lab.table`: one row per generated token, Parquet parts in a directory; `load_token_table` reads it).
- `score_token_table` (`lab.selection`): the Rock Score `R(v) = Freq(v) · mean divergence` per type and the paper's
  selection; `stability_sweep` (Jaccard of sub-corpora's top-K, to pick K); `matched_controls` (a random id set matched
  to the rocks' frequency distribution); `compare_token_tables` (early vs late checkpoints, Wilcoxon tests).
- `gradient_cosines` / `gradient_geometry` (`lab.gradients`): each token's cosine with G_balanced, and per-group
  gradient norms and cosines with Mann-Whitney tests.
- `knockout` (`lab.token_knockout`): ban one token at inference and test the accuracy change on GSM8K-style problems,
  with `paired_bootstrap` p-values and `benjamini_hochberg` q-values (`lab.stats`).
- `build_report` (`lab.report`): one Markdown and one HTML page with PNG figures (`lab.figures`, `lab.categories`).
- `load_prompts` / `load_problems` (`lab.prompts`): the inputs.

Example:
```python
from hf_rockopd.lab import collect_token_table, load_token_table, score_token_table

collect_token_table(student, teacher, tokenizer, prompts, "tables/early", max_new_tokens=256)
result = score_token_table(load_token_table("tables/early"), top_k=100)
print(result.rock_token_share, result.divergence_coverage)
result.save("rock_set.json")  # loadable by the `rock_freeze` policy as is
```
"""

from ..evaluation.answers import verify_answer
from .categories import DISCOURSE_WORDS, ROCK_CATEGORIES, category_table, token_category, token_label
from .collect import collect_token_table
from .gradients import gradient_cosines, gradient_geometry
from .prompts import load_problems, load_prompts
from .report import ReportResult, build_report
from .selection import (
    ScoreResult,
    compare_token_tables,
    comparison_groups,
    matched_controls,
    rare_high_divergence_ids,
    score_token_table,
    stability_sweep,
)
from .stats import benjamini_hochberg, paired_bootstrap
from .table import (
    GRAD_COSINE_FILE,
    TOKEN_TABLE_COLUMNS,
    TOKEN_TABLE_META,
    TokenTable,
    check_same_tokenizer,
    load_token_table,
)
from .token_knockout import knockout


__all__ = [
    "DISCOURSE_WORDS",
    "GRAD_COSINE_FILE",
    "ROCK_CATEGORIES",
    "TOKEN_TABLE_COLUMNS",
    "TOKEN_TABLE_META",
    "ReportResult",
    "ScoreResult",
    "TokenTable",
    "benjamini_hochberg",
    "build_report",
    "category_table",
    "check_same_tokenizer",
    "collect_token_table",
    "compare_token_tables",
    "comparison_groups",
    "gradient_cosines",
    "gradient_geometry",
    "knockout",
    "load_problems",
    "load_prompts",
    "load_token_table",
    "matched_controls",
    "paired_bootstrap",
    "rare_high_divergence_ids",
    "score_token_table",
    "stability_sweep",
    "verify_answer",
    "token_category",
    "token_label",
]
