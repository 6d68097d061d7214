"""The settings candidates of the real-budget run, judged on the validation slice: one row per finished candidate run.

    python examples/reports/real_budget/validation.py RUN_DIR [RUN_DIR ...] [--shared SHARED_DIR] [--json OUT]
        [--resumed-from RUN_NAME=STEP] [--base EVAL_JSON]

Each RUN_DIR is a `hf-rockopd distill --eval_on validation` run (see README.md here); SHARED_DIR is their common
`eval_cache_dir`, whose teacher reference gives the teacher's accuracy and cut rate on the same problems. Prints a
Markdown table: settings, training throughput (completion tokens per second of training), the validation accuracy
with its Wilson interval and the teacher-forced divergence after training, and the cut rate.
"""

import argparse
import json
import os

from hf_rockopd.evaluation.paired import mcnemar_exact
from hf_rockopd.evaluation.quality import accuracy_interval


def correct(run_dir: str, stage: str, base: str | None = None) -> list[bool]:
    """Which validation problems the run's student solved `before` or `after` training (eval_<stage>.json); `base`
    is read for `before` when the run folder has no eval_before.json (the committed candidates share one)."""
    path = os.path.join(run_dir, f"eval_{stage}.json")
    if stage == "before" and not os.path.isfile(path) and base:
        path = base
    with open(path) as f:
        return [bool(r["correct"]) for r in json.load(f)["records"]]


def candidate(run_dir: str, resumed_from: int | None = None, base: str | None = None) -> dict:
    with open(os.path.join(run_dir, "run_report.json")) as f:
        report = json.load(f)
    training, history = report["training"], report["log_history"]
    steps = [row for row in history if "loss" in row and "completions/mean_length" in row]

    before, after = report["eval"]["before"], report["eval"]["after"]
    paired = mcnemar_exact(correct(run_dir, "before", base), correct(run_dir, "after"))
    resumed = training.get("resumed_from_step", 0) if resumed_from is None else resumed_from
    if training.get("timed_steps"):
        # The training clock (hf_rockopd.trainers.clock): time inside optimizer steps over every sitting.
        timed, seconds = training["timed_steps"], training["step_seconds"]
    elif training.get("global_step", len(steps)) > resumed:
        # Reports from before the clock: this sitting's train_seconds over this sitting's steps.
        timed, seconds = training.get("global_step", len(steps)) - resumed, training["train_seconds"]
    else:
        timed, seconds = 0, None  # a checkpoint evaluated without training, from a run that predates the clock
    timed_rows = steps[len(steps) - timed:] if timed else []
    return {
        "run": os.path.basename(os.path.normpath(run_dir)),
        "policy": report["policy"]["name"],
        "learning_rate": training["learning_rate"],
        "batch": training["per_device_train_batch_size"],
        "max_new_tokens": training["max_new_tokens"],
        "beta": training["beta"],
        "lmbda": training["lmbda"],
        "steps": training.get("global_step", len(steps)),
        "train_seconds": training["train_seconds"],
        "seconds_per_step": seconds / timed if timed and seconds else None,
        "resumed_from_step": resumed,
        "tokens_per_second": sum(row["completions/mean_length"] for row in timed_rows)
        * training["per_device_train_batch_size"] / seconds if timed and seconds else None,
        "clipped_in_training": sum(row["completions/clipped_ratio"] for row in steps) / max(1, len(steps)),
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "interval_after": [after["accuracy_low"], after["accuracy_high"]],
        "tf_divergence_before": before["teacher_forced_divergence"],
        "tf_divergence_after": after["teacher_forced_divergence"],
        "gained": paired.only_second,
        "lost": paired.only_first,
        "p_value_vs_before": paired.p_value,
        "cut_after": after["cut_ratio"],
        "num_problems": after["num_problems"],
    }


def teacher(shared: str) -> dict:
    with open(os.path.join(shared, "teacher_reference.json")) as f:
        reference = json.load(f)
    stops = set(reference["stop_ids"])
    cut = [len(c) >= reference["max_new_tokens"] and not stops & set(c) for c in reference["completion_ids"]]
    interval = accuracy_interval(reference["correct"])
    return {"accuracy": interval.estimate, "interval": [interval.low, interval.high], "cut": sum(cut) / len(cut),
            "num_problems": len(cut), "max_new_tokens": reference["max_new_tokens"],
            "mean_length": sum(map(len, reference["completion_ids"])) / len(cut)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--shared", default=None)
    parser.add_argument("--json", default=None)
    # Run reports written before they recorded `training.resumed_from_step` (the lr 1e-4, 2 x 256 candidate, SIGKILLed
    # at step 11 and resumed from checkpoint-10): NAME=STEP.
    parser.add_argument("--resumed-from", action="append", default=[], metavar="RUN_NAME=STEP")
    # The base student's evaluation with its records (eval_before.json, or the eval_cache_dir's
    # eval_before.cache.json), for run folders that do not hold their own.
    parser.add_argument("--base", default=None, metavar="EVAL_JSON")
    args = parser.parse_args()
    resumed = {name: int(step) for name, step in (item.split("=") for item in args.resumed_from)}
    rows = [candidate(run, resumed.get(os.path.basename(os.path.normpath(run))), args.base)
            for run in args.runs if os.path.isfile(os.path.join(run, "run_report.json"))]
    found = {"candidates": rows, "teacher": teacher(args.shared) if args.shared else None}
    if found["teacher"]:
        t = found["teacher"]
        print(f"teacher on {t['num_problems']} validation problems at {t['max_new_tokens']} tokens: accuracy "
              f"{t['accuracy']:.3f} [{t['interval'][0]:.3f}, {t['interval'][1]:.3f}], cut {t['cut']:.3f}, mean "
              f"length {t['mean_length']:.0f} tokens\n")
    print("| run | lr | batch x tokens | steps | s/step | tokens/s | clipped | accuracy before -> after [95 %] | "
          "gained / lost, McNemar p | teacher-forced divergence before -> after | cut after |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | ---: |")
    def cell(value, spec):
        return "—" if value is None else format(value, spec)

    for r in rows:
        print(f"| {r['run']} | {r['learning_rate']:g} | {r['batch']} x {r['max_new_tokens']} | {r['steps']} | "
              f"{cell(r['seconds_per_step'], '.0f')} | {cell(r['tokens_per_second'], '.1f')} | "
              f"{r['clipped_in_training']:.2f} | "
              f"{r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f} [{r['interval_after'][0]:.3f}, "
              f"{r['interval_after'][1]:.3f}] | {r['gained']} / {r['lost']}, p = {r['p_value_vs_before']:.2f} | "
              f"{r['tf_divergence_before']:.4f} -> {r['tf_divergence_after']:.4f} | {r['cut_after']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
