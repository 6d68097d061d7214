"""Where a distilled student moved toward its teacher: the teacher-forced divergence on the teacher's own answers,
token by token, before and after distillation, grouped by the kind of token (the rock-token paper's categories).

    python examples/reports/real_budget/token_shift.py --reference SHARED/teacher_reference.json \
        --cache SHARED/teacher_reference.top64.<id>.parquet --student Qwen/Qwen2.5-Coder-0.5B-Instruct \
        --after uniform=runs/qwen-long/uniform [--after rock_online=runs/qwen-long/rock_online] [--limit 100] \
        [--json token_shift.json]

The divergence is the one every evaluation reports (reverse KL against the teacher's cached top-64 plus a tail bin,
`hf_rockopd.evaluation.rollout.score_completions`). Per category of the teacher's token (`hf_rockopd.lab.
token_category`: whitespace, punctuation/markup, digits, discourse words, content) it prints the tokens' share, their
mean divergence before and after, the share of the total drop they account for, and the "forks": positions where the
student's top-1 differed from the teacher's before, how many of them it now agrees on (fixed), and how many agreeing
positions it now gets wrong (broken). A student's greedy answer goes wrong at a fork, not on average.
"""

from __future__ import annotations

import argparse
import json

import torch

from hf_rockopd.evaluation.rollout import pad_token_id, score_completions
from hf_rockopd.evaluation.teacher_reference import TeacherReference
from hf_rockopd.lab import ROCK_CATEGORIES, token_category
from hf_rockopd.models import resolve_causal_lm, resolve_tokenizer
from hf_rockopd.models.adapters import load_merged_adapter
from hf_rockopd.teachers import CachedTeacher, TeacherCache


def scores(model, cache: CachedTeacher, reference: TeacherReference, tokenizer, limit: int) -> dict[str, torch.Tensor]:
    """All completion tokens' divergence and top-1 agreement, in reference order, concatenated."""
    prompts, completions = reference.prompt_ids[:limit], reference.completion_ids[:limit]
    rows = score_completions(model, cache, prompts, completions, pad_token_id=pad_token_id(tokenizer), batch_size=8,
                             show_progress=True)
    return {"divergence": torch.cat([r["divergence"] for r in rows]).double(),
            "agree": torch.cat([r["agree"] for r in rows])}


def table(categories: list[str], before: dict, after: dict) -> list[dict]:
    """One row per category (and `all`): share, mean divergence before/after, share of the drop, forks."""
    drop = float((before["divergence"] - after["divergence"]).sum())
    rows = []
    for name in (*ROCK_CATEGORIES, "all"):
        mask = torch.tensor([name in ("all", c) for c in categories])
        if not mask.any():
            continue
        b, a = before["divergence"][mask], after["divergence"][mask]
        forks = ~before["agree"][mask]
        rows.append({
            "category": name, "tokens": int(mask.sum()), "share": float(mask.float().mean()),
            "divergence_before": float(b.mean()), "divergence_after": float(a.mean()),
            "share_of_drop": float((b - a).sum()) / drop if drop else None,
            "forks_before": int(forks.sum()), "fixed": int((forks & after["agree"][mask]).sum()),
            "broken": int((~forks & ~after["agree"][mask]).sum()),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", required=True, help="teacher_reference.json of the evaluation cache")
    parser.add_argument("--cache", required=True, help="its top-k Parquet cache (teacher_reference.top64.*.parquet)")
    parser.add_argument("--student", required=True, help="the base student (Hub id or folder)")
    parser.add_argument("--after", action="append", required=True, metavar="NAME=ADAPTER_DIR")
    parser.add_argument("--limit", type=int, default=None, help="the first N reference answers (default: all)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    after = dict(item.split("=", 1) for item in args.after)  # parsed before any model loads

    reference = TeacherReference.load(args.reference)
    limit = args.limit or len(reference.completion_ids)
    cache = CachedTeacher(TeacherCache.load(args.cache))
    tokenizer = resolve_tokenizer(args.student)
    ids = [t for c in reference.completion_ids[:limit] for t in c]
    categories = [token_category(tokenizer.decode([t])) for t in ids]

    base = resolve_causal_lm(args.student, with_tokenizer=False).model
    before = scores(base, cache, reference, tokenizer, limit)
    del base
    found = {"answers": limit, "tokens": len(ids), "runs": {}}
    for name, folder in after.items():
        model = load_merged_adapter(folder, with_tokenizer=False).model
        found["runs"][name] = table(categories, before, scores(model, cache, reference, tokenizer, limit))
        del model
        print(f"\n{name}: the teacher's first {limit} answers ({len(ids)} tokens)\n")
        print("| tokens | share | divergence before -> after | share of the drop | forks before | fixed | broken |")
        print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
        for r in found["runs"][name]:
            drop = "—" if r["share_of_drop"] is None else f"{100 * r['share_of_drop']:.0f} %"
            print(f"| {r['category']} | {100 * r['share']:.0f} % | {r['divergence_before']:.4f} -> "
                  f"{r['divergence_after']:.4f} | {drop} | {r['forks_before']} | {r['fixed']} | {r['broken']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
