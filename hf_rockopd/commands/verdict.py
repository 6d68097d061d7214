"""`hf-rockopd verdict --runs RUN_DIR [RUN_DIR ...]`: the held-out verdict of distill runs that share a base evaluation.

Each run is the output directory of `hf-rockopd distill` with one token policy, trained at the same budget and
evaluated on the same problems (one `eval_cache_dir`: the base student evaluated once). The verdict pairs every
problem: each policy's student after training against the base student (exact McNemar), and the rock policy against
`uniform`. It writes `result.json` (its shape is `hf_rockopd.evaluation.paired.distillation_verdict`'s), the details
beside it (intervals, discordant counts, the share of the teacher-student gap closed), a plot of the checkpoint
evaluations, and the verdict into each run's `run_report.json`, so that `hf-rockopd card` shows it.

Example:
```bash
hf-rockopd verdict --runs runs/qwen-long/uniform runs/qwen-long/rock_online --out examples/reports/real_budget/result.json
```
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from .parsing import Command

__all__ = ["COMMANDS", "VerdictArguments", "verdict"]


@dataclass
class VerdictArguments:
    """Options of `verdict`.

    Example:
    ```python
    >>> from hf_rockopd.commands.verdict import VerdictArguments
    >>> VerdictArguments(runs=["runs/nowhere"], out="result.json")
    Traceback (most recent call last):
    ...
    ValueError: Not finished distill runs: runs/nowhere/run_report.json, ... missing. Finish each run first (...).
    ```
    """

    runs: list[str] = field(metadata={"help": "Output directories of `hf-rockopd distill`, one per token policy."})
    out: str = field(
        default="result.json",
        metadata={"help": "The verdict's JSON; the details (<out stem>_details.json) and curves.png go beside it."},
    )
    baseline: str = field(default="uniform", metadata={"help": "The policy the others are compared with."})

    def __post_init__(self):
        if not self.runs:
            raise ValueError("runs is empty: give the output directory of at least one `hf-rockopd distill` run.")
        repeated = sorted({run for run in self.runs if self.runs.count(run) > 1})
        if repeated:
            raise ValueError(f"runs names {repeated} more than once: give one run per policy.")
        missing = [
            f"{run}/{name}" for run in self.runs for name in ("run_report.json", "eval_before.json", "eval_after.json")
            if not os.path.isfile(os.path.join(run, name))
        ]
        if missing:
            raise ValueError(
                f"Not finished distill runs: {', '.join(missing)} missing. Finish each run first (the same "
                "`hf-rockopd distill` command resumes it)."
            )


def _short(name: str) -> str:
    """A model's last name component: a Hub id's repository, a local folder's name (no local path in a figure)."""
    return os.path.basename(os.path.normpath(name))


def _read(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def verdict(args: VerdictArguments) -> int:
    """Run `verdict`: print the table, write result.json, its details, the curves and each run's report."""
    from ..distill.checkpoints import CHECKPOINT_EVALS_NAME, read_checkpoint_evals
    from ..evaluation.paired import distillation_verdict
    from ..publishing.plots import plot_checkpoint_curves
    from ..publishing.run_report import write_run_report

    reports = {run: _read(os.path.join(run, "run_report.json")) for run in args.runs}
    policies = {run: report["policy"]["name"] for run, report in reports.items()}
    if len(set(policies.values())) != len(policies):
        raise ValueError(f"Two runs have the same policy ({policies}); give one run per policy.")
    befores = {run: _read(os.path.join(run, "eval_before.json")) for run in args.runs}
    first = args.runs[0]
    for run in args.runs[1:]:
        flags = [[r.get("correct") for r in befores[name]["records"]] for name in (run, first)]
        same = flags[0] == flags[1]
        if not same or reports[run]["teacher"]["name"] != reports[first]["teacher"]["name"]:
            raise ValueError(
                f"{run} and {first} were not evaluated on the same base student, teacher and problems; a verdict "
                "pairs runs that share one evaluation cache (eval_cache_dir)."
            )
    steps = {run: report["training"].get("global_step") for run, report in reports.items()}
    if len(set(steps.values())) != 1:
        raise ValueError(f"The runs trained for different numbers of steps ({steps}): not an identical budget.")
    afters = {policies[run]: _read(os.path.join(run, "eval_after.json")) for run in args.runs}
    result, details = distillation_verdict(
        befores[first], afters, teacher=reports[first]["teacher"]["name"],
        student=reports[first]["student"]["base_model"], steps=steps[first], baseline_policy=args.baseline,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    details_path = os.path.splitext(args.out)[0] + "_details.json"
    with open(details_path, "w", encoding="utf-8") as f:
        json.dump(details, f, indent=2)
    curves = {policies[run]: read_checkpoint_evals(os.path.join(run, CHECKPOINT_EVALS_NAME)) for run in args.runs}
    if any(curves.values()):
        plot_checkpoint_curves(curves, os.path.join(os.path.dirname(os.path.abspath(args.out)), "curves.png"),
                               title=f"{_short(result['pair']['student'])} distilled from "
                               f"{_short(result['pair']['teacher'])}, {result['steps']} steps",
                               teacher_accuracy=_teacher_on_slice(befores[first]["records"], curves))
    for run, report in reports.items():
        policy = policies[run]
        report["verdict"] = {
            "policy": policy, "num_eval_problems": result["num_eval_problems"], "steps": result["steps"],
            "teacher_accuracy": result["teacher_accuracy"], "teacher": details["teacher"],
            **result["runs"][policy], **details["runs"][policy],
            "p_value_rocks_vs_uniform": result["p_value_rocks_vs_uniform"],
            **_versus(policy, details.get("rocks_vs_uniform"), args.baseline),
        }
        write_run_report(run, report)
    print(f"{'policy':<14} {'before':>22} {'after':>22} {'p vs before':>12} {'cut':>6} {'loops':>6}")
    for policy, row in result["runs"].items():
        d = details["runs"][policy]
        interval = "{:.3f} [{:.3f}, {:.3f}]"
        print(f"{policy:<14} {interval.format(d['before']['estimate'], d['before']['low'], d['before']['high']):>22} "
              f"{interval.format(d['after']['estimate'], d['after']['low'], d['after']['high']):>22} "
              f"{row['p_value_vs_before']:>12.4f} {row['cut_after']:>6.3f} {row['loops_after']:>6.3f}")
    if result["p_value_rocks_vs_uniform"] is not None:
        print(f"rocks vs uniform after training: paired exact McNemar p = {result['p_value_rocks_vs_uniform']:.4f}")
    print(f"wrote {args.out}, {details_path}")
    return 0


def _versus(policy: str, test: dict[str, Any] | None, baseline: str) -> dict[str, Any]:
    """The rocks-vs-uniform test seen from `policy`'s run: the other policy, its accuracy and the problems only each
    one solves (the card of either run states it from its own side). Empty for a run outside that comparison."""
    if not test or policy not in (test["rock_policy"], baseline):
        return {}
    mine = "first" if policy == test["rock_policy"] else "second"
    theirs = "second" if mine == "first" else "first"
    return {"versus": {
        "policy": baseline if mine == "first" else test["rock_policy"], "accuracy": test[f"accuracy_{theirs}"],
        "only_this": test[f"only_{mine}"], "only_other": test[f"only_{theirs}"], "p_value": test["p_value"],
    }}


def _teacher_on_slice(records: list[dict[str, Any]], curves: dict[str, list[dict[str, Any]]]) -> float | None:
    """The teacher's accuracy on the curves' problems: the checkpoint evaluations score the first `num_problems`
    held-out problems, where the teacher may do better or worse than on all of them (18 of the first 32 against 166
    of 250 on the real-budget run)."""
    size = next((row.get("num_problems") for rows in curves.values() for row in rows if row.get("num_problems")), None)
    flags = [record.get("teacher_correct") for record in records[:size]]
    if not size or len(flags) < size or None in flags:
        return None
    return sum(map(bool, flags)) / size


COMMANDS = (
    Command("verdict", "the held-out verdict of distill runs sharing a base evaluation (paired McNemar, result.json)",
            (VerdictArguments,), verdict),
)
