"""Compare `hf-rockopd distill` runs before and after training: every quality measure, and the answers themselves.

    python examples/reports/smollm2_loops/compare.py RUN_DIR [RUN_DIR ...] > table.md

Reads each run's `run_report.json` and `eval_before.json` / `eval_after.json` (written by `hf-rockopd distill`) and
prints a Markdown table per run and, for the first problems, the start of the answer before and after.
"""

import json
import os
import sys

ROWS = [
    ("accuracy", "accuracy", "{:.3f}"),
    ("finished before the limit", "finished_rate", "{:.3f}"),
    ("completions with a loop", "loop_rate", "{:.3f}"),
    ("repeated 4-gram fraction", "repeated_ngram_fraction", "{:.3f}"),
    ("distinct-2", "distinct_2", "{:.3f}"),
    ("teacher-forced divergence", "teacher_forced_divergence", "{:.4f}"),
    ("on-policy divergence", "mean_divergence", "{:.4f}"),
]


def load(run: str, name: str) -> dict:
    with open(os.path.join(run, name), encoding="utf-8") as f:
        return json.load(f)


def main(runs: list[str], samples: int = 2, chars: int = 300) -> None:
    for run in runs:
        report = load(run, "run_report.json")
        t = report["training"]
        print(f"### {os.path.basename(run.rstrip('/'))}\n")
        print(f"`{report['command']}`\n")
        print(f"lr {t['learning_rate']}, lmbda {t['lmbda']}, beta {t['beta']}, {t['max_new_tokens']} new tokens, "
              f"{t['max_steps']} steps; student {report['student']['num_layers']} layers; "
              f"train {t['train_seconds']} s, total {t['total_seconds']} s\n")
        print("| measure | before | after |\n| --- | ---: | ---: |")
        before, after = report["eval"]["before"], report["eval"]["after"]
        for label, key, fmt in ROWS:
            print(f"| {label} | {fmt.format(before[key])} | {fmt.format(after[key])} |")
        print()
        records = {phase: load(run, f"eval_{phase}.json")["records"] for phase in ("before", "after")}
        for i in range(samples):
            for phase in ("before", "after"):
                r = records[phase][i]
                text = " ".join(r["completion"].split())[:chars]
                print(f"- problem {i}, {phase} (loop: {r['loop']}, finished: {r['finished']}): “{text}…”")
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
