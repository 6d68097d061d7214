"""What changed in the student's text: the answers before and after training, read side by side.

    python examples/reports/real_budget/answers.py --before RUN/eval_before.json \
        --after uniform=RUN_U/eval_after.json rock_online=RUN_R/eval_after.json \
        [--teacher SHARED/teacher_reference.json --tokenizer Qwen/Qwen2.5-Coder-1.5B-Instruct] \
        [--examples 3] [--json OUT]

For the base student, each trained student and (with `--teacher`) the teacher's reference answers on the same
problems, it prints how often the text uses each of a few style markers (the teacher's bold step headings and bullet
points, LaTeX display and inline math, `\\boxed`, numbered steps), the mean length, and the cut and loop counts; then,
per trained student, how many answers are word for word the same, the problems gained and lost, and the ends of a
few of those answers before and after. An accuracy that rises while the text degrades shows up here.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence

# Markers of a solution's style, each a regex searched in the whole answer.
STYLE_MARKERS = {
    "bold headings (**...**)": r"\*\*[^*\n]+\*\*",
    "bullet points (- ...)": r"(?m)^\s*- ",
    "numbered steps (1. ...)": r"(?m)^\s*\d+\.\s",
    "display math (\\[ ... \\])": r"\\\[",
    "inline math (\\( ... \\))": r"\\\(",
    "\\boxed{...}": r"\\boxed\{",
    "code block (```)": r"```",
}


def read_records(path: str) -> list[dict]:
    """The per-problem records of an `eval_before.json` / `eval_after.json` (a cached evaluation has them too)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data["records"]


def teacher_texts(path: str, tokenizer_name: str) -> list[str]:
    """The teacher's reference answers, decoded (the reference stores token ids)."""
    from hf_rockopd.models import resolve_tokenizer

    with open(path, encoding="utf-8") as f:
        reference = json.load(f)
    tokenizer = resolve_tokenizer(tokenizer_name)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in reference["completion_ids"]]


def style(texts: Sequence[str]) -> dict[str, float]:
    """The share of `texts` that use each of `STYLE_MARKERS`, and their mean length in characters and lines."""
    n = max(1, len(texts))
    shares = {name: sum(bool(re.search(pattern, t)) for t in texts) / n for name, pattern in STYLE_MARKERS.items()}
    shares["mean characters"] = sum(map(len, texts)) / n
    shares["mean lines"] = sum(t.count("\n") + 1 for t in texts) / n
    return shares


def summary(records: Sequence[dict]) -> dict[str, float]:
    """Accuracy, cut and loop counts and mean tokens of one evaluation."""
    return {
        "correct": sum(bool(r["correct"]) for r in records),
        "cut": sum(bool(r.get("cut")) for r in records),
        "loops": sum(bool(r.get("loop")) for r in records),
        "mean tokens": sum(r.get("num_tokens", 0) for r in records) / max(1, len(records)),
    }


def changes(before: Sequence[dict], after: Sequence[dict]) -> dict[str, list[int]]:
    """Indices of the problems gained, lost, and answered word for word as before."""
    if len(before) != len(after):
        raise ValueError(f"The evaluations have {len(before)} and {len(after)} problems: not the same problems.")
    return {
        "gained": [i for i, (b, a) in enumerate(zip(before, after)) if a["correct"] and not b["correct"]],
        "lost": [i for i, (b, a) in enumerate(zip(before, after)) if b["correct"] and not a["correct"]],
        "identical": [i for i, (b, a) in enumerate(zip(before, after)) if b["completion"] == a["completion"]],
    }


def _tail(text: str, chars: int) -> str:
    text = text.strip()
    return ("..." + text[-chars:]) if len(text) > chars else text


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="eval_before.json (the base student)")
    parser.add_argument("--after", nargs="+", required=True, metavar="NAME=PATH", help="eval_after.json per run")
    parser.add_argument("--teacher", help="the teacher's teacher_reference.json on the same problems")
    parser.add_argument("--tokenizer", help="the tokenizer that decodes --teacher (Hub id or path)")
    parser.add_argument("--examples", type=int, default=2, help="answers shown per run for gained and for lost")
    parser.add_argument("--chars", type=int, default=400, help="characters shown of each answer's end")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.teacher and not args.tokenizer:
        parser.error("--teacher needs --tokenizer (the reference stores token ids)")
    afters = {}
    for item in args.after:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"--after takes NAME=PATH, got {item!r}")
        afters[name] = read_records(path)
    before = read_records(args.before)

    texts = {"base student": [r["completion"] for r in before]}
    texts.update({f"{name}, after": [r["completion"] for r in records] for name, records in afters.items()})
    if args.teacher:
        texts["teacher"] = teacher_texts(args.teacher, args.tokenizer)
    styles = {name: style(t) for name, t in texts.items()}
    out = {"problems": len(before), "style": styles, "base student": summary(before), "runs": {}}

    names = list(styles)
    print(f"{'share of answers':<28}" + "".join(f"{name:>22}" for name in names))
    for marker in styles[names[0]]:
        cells = [styles[name][marker] for name in names]
        fmt = "{:>22.1f}" if marker.startswith("mean") else "{:>22.2f}"
        print(f"{marker:<28}" + "".join(fmt.format(c) for c in cells))
    print()
    for name, records in afters.items():
        found = changes(before, records)
        out["runs"][name] = {**summary(records), **{k: len(v) for k, v in found.items()},
                             "gained_indices": found["gained"], "lost_indices": found["lost"]}
        s, b = out["runs"][name], out["base student"]
        print(f"== {name}: {b['correct']} -> {s['correct']} correct of {len(before)} ({s['gained']} gained, "
              f"{s['lost']} lost); {s['identical']} answers word for word the same; cut {b['cut']} -> {s['cut']}, "
              f"loops {b['loops']} -> {s['loops']}, mean tokens {b['mean tokens']:.0f} -> {s['mean tokens']:.0f}")
        for kind in ("gained", "lost"):
            for i in found[kind][: args.examples]:
                print(f"\n-- problem {i} ({kind}; gold {records[i]['gold'].split('####')[-1].strip()}): before "
                      f"answered {before[i]['prediction']!r}, after {records[i]['prediction']!r}")
                print("before: " + _tail(before[i]["completion"], args.chars))
                print("after:  " + _tail(records[i]["completion"], args.chars))
        print()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
