"""The student's course during training: at each saved checkpoint, an evaluation on a slice of the held-out problems
(accuracy with its interval, cut and loop rates, teacher-forced divergence), appended to `checkpoint_evals.jsonl`.

These points draw the accuracy and divergence curves of a long run; the verdict itself comes from the full evaluation
after training. A line is written once per step: a resumed run evaluates the checkpoint it resumed from if that line
is missing (the kill came between the save and its evaluation) and never repeats one. The base student's point (step
0) is the same for every policy run on the same problems, so it is cached beside the teacher's reference.

Example:
```python
from hf_rockopd.distill.checkpoints import CheckpointEvaluation, read_checkpoint_evals
trainer.add_callback(CheckpointEvaluation("run/checkpoint_evals.jsonl", evaluate, step0_cache="shared/step0.json"))
trainer.train()
read_checkpoint_evals("run/checkpoint_evals.jsonl")  # [{"step": 0, "accuracy": ...}, {"step": 50, ...}, ...]
```
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback
from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = [
    "CHECKPOINT_EVALS_NAME",
    "CheckpointEvaluation",
    "check_checkpoint_eval_steps",
    "read_checkpoint_evals",
    "save_step0_line",
    "step0_key",
]

CHECKPOINT_EVALS_NAME = "checkpoint_evals.jsonl"
_FIELDS = ("accuracy", "accuracy_low", "accuracy_high", "cut_ratio", "loop_rate", "finished_rate",
           "teacher_forced_divergence", "mean_completion_length", "num_problems")


def check_checkpoint_eval_steps(every: int, save_strategy: Any, save_steps: float) -> None:
    """Refuse a `checkpoint_eval_steps` that no saved checkpoint would meet, before any model loads.

    Example:
    ```python
    >>> from hf_rockopd.distill.checkpoints import check_checkpoint_eval_steps
    >>> check_checkpoint_eval_steps(50, "steps", 10)  # checkpoints 50, 100, ... are evaluated
    >>> check_checkpoint_eval_steps(25, "steps", 10)
    Traceback (most recent call last):
    ...
    ValueError: checkpoint_eval_steps = 25 is not a multiple of save_steps = 10: ... (e.g. 50).
    ```
    """
    strategy = str(getattr(save_strategy, "value", save_strategy))
    if not every or strategy == "no":
        return
    if strategy != "steps" or save_steps < 1 or every % int(save_steps):
        suggestion = 5 * int(save_steps) if strategy == "steps" and save_steps >= 1 else None
        raise ValueError(
            f"checkpoint_eval_steps = {every} is not a multiple of save_steps = {save_steps}: no saved checkpoint "
            "would be evaluated. Use save_strategy='steps' with an integer save_steps, and a checkpoint_eval_steps "
            "that is a multiple of it" + (f" (e.g. {suggestion})." if suggestion else ".")
        )


def read_checkpoint_evals(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The lines of a `checkpoint_evals.jsonl`, by step (a line cut by a kill is skipped).

    Example:
    ```python
    >>> import os, tempfile
    >>> from hf_rockopd.distill.checkpoints import read_checkpoint_evals
    >>> read_checkpoint_evals(os.path.join(tempfile.mkdtemp(), "none.jsonl"))
    []
    ```
    """
    if not os.path.isfile(path):
        return []
    rows: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[int(row["step"])] = row
    return [rows[step] for step in sorted(rows)]


def step0_key(base_key: dict[str, Any], num_problems: int) -> dict[str, Any]:
    """The key of the cached step-0 line: the base student's evaluation key and the slice's size.

    Example:
    ```python
    >>> from hf_rockopd.distill.checkpoints import step0_key
    >>> step0_key({"student": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}, 32)
    {'student': 'Qwen/Qwen2.5-Coder-0.5B-Instruct', 'head': 32}
    ```
    """
    return {**base_key, "head": num_problems}


def save_step0_line(path: str | os.PathLike, key: dict[str, Any], row: dict[str, Any]) -> None:
    """Write the base student's step-0 line where `CheckpointEvaluation(step0_cache=path, key=key)` reads it back.

    The file is replaced atomically, so a kill leaves the old line or the new one. A report that commits a finished
    run's step-0 line can put it back with this on a new machine, instead of evaluating the base student again.

    Example:
    ```python
    >>> import os, tempfile
    >>> from hf_rockopd.distill.checkpoints import save_step0_line, step0_key
    >>> path = os.path.join(tempfile.mkdtemp(), "step0.json")
    >>> save_step0_line(path, step0_key({"student": "s"}, 32), {"step": 0, "accuracy": 0.1875})
    ```
    """
    path = os.fspath(path)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"key": key, "row": row}, f)
    os.replace(path + ".tmp", path)


class CheckpointEvaluation(TrainerCallback):
    """Trainer callback: evaluate the student at the start (step 0, or the checkpoint resumed from) and at each save.

    Args:
        path: the `checkpoint_evals.jsonl` to append to.
        evaluate: `model -> EvalResult` on the slice (the run's settings and the teacher's reference of the slice).
        step0_cache: a JSON file holding the base student's line, shared by the runs of one comparison; None: the
            step-0 line is computed in each run.
        key: what the step-0 line depends on (`distill.evaluation.evaluation_key` of the base student); a cached
            line with another key is computed again.
        every: evaluate only the checkpoints whose step is a multiple of `every` (0: each one). A long run saves
            often, so that a stop loses few steps, and evaluates fewer of them: each evaluation costs minutes.
    """

    def __init__(self, path: str, evaluate: Callable[[Any], Any], *, step0_cache: str | None = None,
                 key: dict[str, Any] | None = None, on_line: Callable[[str], None] | None = None,
                 every: int = 0) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"every must be an integer >= 0 (0: each checkpoint), got {every!r}.")
        self.every = every
        self.on_line = on_line or logger.info
        self.path = os.fspath(path)
        self.evaluate = evaluate
        self.step0_cache = step0_cache
        self.key = json.loads(json.dumps(key)) if key is not None else None

    def _done(self) -> set[int]:
        return {row["step"] for row in read_checkpoint_evals(self.path)}

    def _append(self, row: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _cached_step0(self) -> dict[str, Any] | None:
        if self.step0_cache is None or not os.path.isfile(self.step0_cache):
            return None
        with open(self.step0_cache, encoding="utf-8") as f:
            cached = json.load(f)
        return cached.get("row") if cached.get("key") == self.key else None

    def _measure(self, step: int, model: Any) -> None:
        if step in self._done() or (step > 0 and self.every and step % self.every):
            return
        row = self._cached_step0() if step == 0 else None
        if row is None:
            started = time.perf_counter()
            result = self.evaluate(model)
            row = {"step": step, **{name: getattr(result, name) for name in _FIELDS},
                   "seconds": round(time.perf_counter() - started, 1)}
            if step == 0 and self.step0_cache is not None:
                save_step0_line(self.step0_cache, self.key, row)
        self._append(row)
        divergence = row["teacher_forced_divergence"]
        self.on_line(
            f"step {step}: accuracy {row['accuracy']:.3f} "
            f"[{row['accuracy_low']:.3f}, {row['accuracy_high']:.3f}] on {row['num_problems']} problems, "
            f"teacher-forced divergence {'not measured' if divergence is None else f'{divergence:.4f}'}, "
            f"cut {row['cut_ratio']:.2f}"
        )

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Step 0, or the checkpoint a resumed run starts from, if its line is missing (and it is one to evaluate)."""
        if state.is_world_process_zero and model is not None:
            self._measure(state.global_step, model)

    def on_save(self, args, state, control, model=None, **kwargs):
        """Each saved checkpoint (each `every`-th step's)."""
        if state.is_world_process_zero and model is not None:
            self._measure(state.global_step, model)
