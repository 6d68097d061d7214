"""The settings candidates of the real-budget run, judged on the validation slice: one row per finished candidate run.

    python examples/reports/real_budget/validation.py RUN_DIR [RUN_DIR ...] [--shared SHARED_DIR] [--json OUT]

Each RUN_DIR is a `hf-rockopd distill --eval_on validation` run (see README.md here); SHARED_DIR is their common
`eval_cache_dir`, whose teacher reference gives the teacher's accuracy and cut rate on the same problems. Prints a
Markdown table: settings, training throughput (completion tokens per second of training), the validation accuracy
with its Wilson interval and the teacher-forced divergence after training, and the cut rate.
"""

import argparse
import json
import os

from hf_rockopd.evaluation.quality import accuracy_interval


def candidate(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "run_report.json")) as f:
        report = json.load(f)
    training, history = report["training"], report["log_history"]
    steps = [row for row in history if "loss" in row and "completions/mean_length" in row]
    tokens = sum(row["completions/mean_length"] for row in steps) * training["per_device_train_batch_size"]
    before, after = report["eval"]["before"], report["eval"]["after"]
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
        "tokens_per_second": tokens / training["train_seconds"] if training["train_seconds"] else None,
        "clipped_in_training": sum(row["completions/clipped_ratio"] for row in steps) / max(1, len(steps)),
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "interval_after": [after["accuracy_low"], after["accuracy_high"]],
        "tf_divergence_before": before["teacher_forced_divergence"],
        "tf_divergence_after": after["teacher_forced_divergence"],
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
    args = parser.parse_args()
    rows = [candidate(run) for run in args.runs if os.path.isfile(os.path.join(run, "run_report.json"))]
    found = {"candidates": rows, "teacher": teacher(args.shared) if args.shared else None}
    if found["teacher"]:
        t = found["teacher"]
        print(f"teacher on {t['num_problems']} validation problems at {t['max_new_tokens']} tokens: accuracy "
              f"{t['accuracy']:.3f} [{t['interval'][0]:.3f}, {t['interval'][1]:.3f}], cut {t['cut']:.3f}, mean "
              f"length {t['mean_length']:.0f} tokens\n")
    print("| run | lr | batch x tokens | steps | tokens/s | clipped | accuracy before -> after [95 %] | "
          "teacher-forced divergence before -> after | cut after |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |")
    for r in rows:
        print(f"| {r['run']} | {r['learning_rate']:g} | {r['batch']} x {r['max_new_tokens']} | {r['steps']} | "
              f"{r['tokens_per_second']:.1f} | {r['clipped_in_training']:.2f} | {r['accuracy_before']:.3f} -> "
              f"{r['accuracy_after']:.3f} [{r['interval_after'][0]:.3f}, {r['interval_after'][1]:.3f}] | "
              f"{r['tf_divergence_before']:.4f} -> {r['tf_divergence_after']:.4f} | {r['cut_after']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
