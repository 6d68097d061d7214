"""Put this report's committed records where `make distill-long` looks for them, on a machine without `runs/`.

A new machine starts with no `runs/`, so the long run would make its shared phases again (the teacher's reference,
about 1.5 h; the base student's evaluation, about 40 min) and train `uniform` again (about 4.5 h). The records of
both are committed here. This script copies them into place:

- `runs/qwen-long/shared/`: the teacher's reference and the base student's evaluation (`partial/`), and the step-0
  point of the curves (the first row of `uniform/checkpoint_evals.jsonl`, under the base evaluation's cache key).
  `hf-rockopd distill` reuses each one only if its key matches the models, problems and settings of the command;
  otherwise it makes it again. The teacher's top-64 cache (38 MB) is not committed and is made again (47 min).
- `runs/qwen-long/uniform/`: the finished `uniform` run's report, answers and curve, with the base evaluation
  written as its `eval_before.json` and its (empty) `rock_tokens.json`: what `hf-rockopd verdict` and
  `hf-rockopd card` read. Its adapter weights are not committed, so
  this folder is for the verdict and the card only; `make distill-long` would train `uniform` again in it (it has
  no `run_settings.json`). Run the `rock_online` and verdict commands themselves instead (the README).

Run from the repository root: `python examples/reports/real_budget/seed_runs.py`. Existing files are kept.
"""

from __future__ import annotations

import json
import os
import shutil

from hf_rockopd.distill.checkpoints import save_step0_line, step0_key
from hf_rockopd.distill.evaluation import BEFORE_CACHE_NAME, STEP0_CACHE_NAME, load_cached_evaluation
from hf_rockopd.evaluation.teacher_reference import TEACHER_REFERENCE_NAME
from hf_rockopd.policies.rock_set import ROCK_TOKENS_NAME, write_rock_tokens


HERE = os.path.dirname(os.path.abspath(__file__))
SHARED, UNIFORM = "runs/qwen-long/shared", "runs/qwen-long/uniform"


def _copy(source: str, target: str) -> None:
    if os.path.exists(target):
        print(f"kept {target} (already there)")
        return
    shutil.copyfile(source, target)
    print(f"{target} <- {os.path.relpath(source, HERE)}")


def main() -> None:
    os.makedirs(SHARED, exist_ok=True)
    os.makedirs(UNIFORM, exist_ok=True)
    partial = os.path.join(HERE, "partial")
    for name in (TEACHER_REFERENCE_NAME, BEFORE_CACHE_NAME, BEFORE_CACHE_NAME + ".tokens.pt"):
        _copy(os.path.join(partial, name), os.path.join(SHARED, name))

    cache = os.path.join(SHARED, BEFORE_CACHE_NAME)
    with open(cache, encoding="utf-8") as f:
        key = json.load(f)["settings"]["cache_key"]
    base = load_cached_evaluation(cache, key)
    with open(os.path.join(HERE, "uniform", "checkpoint_evals.jsonl"), encoding="utf-8") as f:
        step0 = json.loads(f.readline())
    assert step0["step"] == 0, step0
    target = os.path.join(SHARED, STEP0_CACHE_NAME)
    if not os.path.exists(target):
        save_step0_line(target, step0_key(key, step0["num_problems"]), step0)
        print(f"{target} <- step 0 of uniform/checkpoint_evals.jsonl")

    for name in ("run_report.json", "eval_after.json", "checkpoint_evals.jsonl"):
        _copy(os.path.join(HERE, "uniform", name), os.path.join(UNIFORM, name))
    target = os.path.join(UNIFORM, "eval_before.json")
    if not os.path.exists(target):
        base.with_rock_ids([]).save(target, include_records=True)  # as the run wrote it: uniform has no rock set
        print(f"{target} <- {cache}")
    if not os.path.exists(os.path.join(UNIFORM, ROCK_TOKENS_NAME)):
        # `hf-rockopd card` reads it. The `uniform` policy never down-weights a token (its rock_table() is empty), so
        # this is the file its trainer wrote at the end of training; 151936 is Qwen2.5's vocabulary (embedding rows).
        with open(os.path.join(UNIFORM, "run_report.json"), encoding="utf-8") as f:
            step = json.load(f)["training"]["global_step"]
        teacher = {"source": "in-process", "top_k": None, "divergence": "full vocabulary"}
        path = write_rock_tokens(UNIFORM, [], vocab_size=151936, policy="uniform", policy_kwargs={}, step=step,
                                 teacher=teacher)
        print(f"{path} <- the uniform policy's empty rock set at step {step}")


if __name__ == "__main__":
    main()
