"""Evaluation of a student on held-out problems, and what it is built from.

- `rollout`: the one way to generate and score completions (evaluation, teacher reference, lab, knockout);
- `answers`: final answers, checked by `math-verify` (`verify_answer`, the verifiers, cut answers);
- `loops`, `quality`: text-level quality (loops, repetition, distinct-n, finished answers, accuracy intervals);
- `teacher_reference`: the teacher's cached completions of the same problems;
- `evaluate`: the evaluation (`EvalResult`, `evaluate_gsm8k`, `evaluate_completions`); `table`: its text table.

The names below load their module on first use, so `hf_rockopd.evaluation.answers` (used by the command line's
option checks) does not import torch.

Example:
```python
>>> from hf_rockopd.evaluation import verify_answer
>>> verify_answer("So the answer is \\\\boxed{\\\\frac{1}{2}}.", "0.5")
True
```
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["EvalResult", "evaluate_completions", "evaluate_gsm8k", "format_results_table", "verify_answer"]

_HOMES = {
    "EvalResult": "evaluate",
    "evaluate_completions": "evaluate",
    "evaluate_gsm8k": "evaluate",
    "format_results_table": "table",
    "verify_answer": "answers",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
