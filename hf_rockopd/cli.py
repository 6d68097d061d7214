"""`hf-rockopd`: the command line of the rock-token lab.

Every subcommand reads and writes plain files, so each step can be rerun and compared:

```
hf-rockopd analyze collect --student S --teacher T --prompts gsm8k.jsonl --limit 500 --out tables/early
hf-rockopd analyze score tables/early --top-k 100 --out rock_set.json
hf-rockopd analyze stability tables/early --ks 25 50 100 150 200
hf-rockopd analyze controls tables/early --rock-set rock_set.json --out controls.json
hf-rockopd analyze compare tables/early tables/late --rock-set rock_set.json
hf-rockopd analyze gradients tables/early --rock-set rock_set.json
hf-rockopd analyze knockout --model S --problems gsm8k.jsonl --rock-set rock_set.json --top 20 --limit 200
hf-rockopd eval --model S --teacher T --problems gsm8k.jsonl --limit 32 --tail --rock-set rock_tokens.json --out eval.json
hf-rockopd analyze report tables/early --rock-set rock_set.json --knockout knockout.csv --out report/
```
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import analysis
from .modeling import vocab_size
from .rock_set import load_rock_set, save_rock_set


def _print_frame(frame, out: str | None) -> None:
    print(frame.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    if out:
        frame.to_csv(out, index=False)
        print(f"wrote {out}")


def _load_model(name: str, args: argparse.Namespace):
    """A model by path or Hub id, found offline where possible (`hf_rockopd.models.resolve_causal_lm`)."""
    import torch

    from .models import resolve_causal_lm

    return resolve_causal_lm(name, dtype=getattr(torch, args.dtype), with_tokenizer=False).model.to(args.device)


def _load_tokenizer(name: str):
    from transformers import AutoTokenizer

    from .models import SMOLLM2_ID, resolve_causal_lm

    try:
        return AutoTokenizer.from_pretrained(name)
    except OSError:
        if name != SMOLLM2_ID:
            raise
        # Offline, SmolLM2's tokenizer comes with its GGUF (or the converted copy of it).
        return resolve_causal_lm(name).tokenizer


def _collect(args: argparse.Namespace) -> int:
    prompts = analysis.load_prompts(args.prompts, limit=args.limit, field_name=args.prompt_field)
    tokenizer = _load_tokenizer(args.tokenizer or args.student)
    student, teacher = _load_model(args.student, args), _load_model(args.teacher, args)
    analysis.collect_token_table(
        student,
        teacher,
        tokenizer,
        prompts,
        args.out,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        do_sample=args.sample,
        seed=args.seed,
        beta=args.beta,
        temperature=args.temperature,
        gradient_cosine=not args.no_grad_cosine,
    )
    table = analysis.load_token_table(args.out)
    print(f"collected {len(table.frame)} generated tokens from {len(prompts)} prompts into {args.out}")
    return 0


def _score(args: argparse.Namespace) -> int:
    table = analysis.load_token_table(args.table)
    result = analysis.score_token_table(
        table,
        top_k=None if args.coverage is not None else args.top_k,
        min_count=args.min_count,
        exclude_top_frequent=args.exclude_top_frequent,
        coverage=args.coverage,
    )
    result.save(args.out)
    rocks = result.scores[result.scores["is_rock"]].head(args.show)
    _print_frame(rocks[["rank", "token_id", "token", "count", "mean_divergence", "rock_score"]], None)
    print(
        f"rock tokens: {len(result.rock_ids)} types = {result.rock_token_share:.1%} of {int(table.counts().sum())} "
        f"generated tokens, carrying {result.divergence_coverage:.1%} of the divergence "
        f"({result.settings['eligible_types']} eligible of {result.settings['observed_types']} observed types)"
    )
    print(f"wrote {args.out}")
    return 0


def _stability(args: argparse.Namespace) -> int:
    table = analysis.load_token_table(args.table)
    frame, k = analysis.stability_sweep(
        table,
        ks=args.ks,
        subcorpus_sizes=args.sizes,
        repeats=args.repeats,
        min_count=args.min_count,
        exclude_top_frequent=args.exclude_top_frequent,
        threshold=args.threshold,
        seed=args.seed,
    )
    _print_frame(frame, args.out)
    print(f"recommended K (mean Jaccard >= {args.threshold} at every sub-corpus size): {k}")
    return 0


def _rock_ids(args: argparse.Namespace, table: analysis.TokenTable) -> list[int]:
    return load_rock_set(args.rock_set, vocab_size=table.vocab_size)["token_ids"]


def _controls(args: argparse.Namespace) -> int:
    table = analysis.load_token_table(args.table)
    ids = analysis.matched_controls(table, _rock_ids(args, table), num_bins=args.bins, seed=args.seed)
    decoded, counts = table.decode(), table.counts()
    tokens = [{"token_id": i, "token": decoded.get(i, ""), "count": int(counts[i])} for i in ids]
    save_rock_set(
        args.out, tokens, vocab_size=table.vocab_size, tokenizer_name=table.meta.get("tokenizer"),
        source="hf_rockopd.analysis.matched_controls", role="frequency_matched_control", matched_to=args.rock_set,
    )
    print(f"wrote {len(ids)} frequency-matched control ids to {args.out}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    early, late = analysis.load_token_table(args.early), analysis.load_token_table(args.late)
    frame = analysis.compare_token_tables(early, late, _rock_ids(args, early), seed=args.seed)
    _print_frame(frame, args.out)
    return 0


def _gradients(args: argparse.Namespace) -> int:
    table = analysis.load_token_table(args.table)
    frame = analysis.gradient_geometry(table, _rock_ids(args, table), seed=args.seed)
    _print_frame(frame, args.out)
    return 0


def _knockout(args: argparse.Namespace) -> int:
    from .evaluation import load_gsm8k_problems

    problems = load_gsm8k_problems(args.problems, limit=args.limit)
    tokenizer = _load_tokenizer(args.tokenizer or args.model)
    model = _load_model(args.model, args)
    ids = load_rock_set(args.rock_set, vocab_size=vocab_size(model))["token_ids"][: args.top]
    frame = analysis.knockout(
        model, tokenizer, problems, ids, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        n_resamples=args.resamples, alpha=args.alpha, seed=args.seed,
    )
    _print_frame(frame, args.out)
    counts = frame["verdict"].value_counts()
    print(
        f"baseline accuracy {frame.attrs['baseline_accuracy']:.3f} on {len(problems)} problems; "
        + ", ".join(f"{v}: {int(counts.get(v, 0))}" for v in ("Pillar", "Neutral", "Stumbling"))
    )
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report import build_report

    table = analysis.load_token_table(args.table)
    if args.rock_set:
        # Rescore with the rock set's own settings, so the report's numbers are the ones `score` printed.
        payload = load_rock_set(args.rock_set, vocab_size=table.vocab_size)
        chosen = payload.get("selection") or {}
        coverage = chosen.get("coverage")
        result = analysis.score_token_table(
            table,
            top_k=None if coverage is not None else int(chosen.get("top_k", len(payload["token_ids"]))),
            coverage=coverage,
            min_count=int(chosen.get("min_count", args.min_count)),
            exclude_top_frequent=int(chosen.get("exclude_top_frequent", args.exclude_top_frequent)),
        )
        if result.rock_ids != payload["token_ids"]:
            raise ValueError(
                f"{args.rock_set} was not scored from {args.table}: rescoring the table with its settings gives other "
                "ids. Give the table it was scored from, or drop --rock-set to score here."
            )
    else:
        result = analysis.score_token_table(
            table, top_k=None if args.coverage is not None else args.top_k, coverage=args.coverage,
            min_count=args.min_count, exclude_top_frequent=args.exclude_top_frequent,
        )
    report = build_report(table, args.out, score=result, late_table=args.late, knockout=args.knockout,
                          top_n=args.show, seed=args.seed, title=args.title)
    print(f"wrote {report.markdown_path}, {report.html_path} and {len(report.figures)} figures")
    return 0


def _card(args: argparse.Namespace) -> int:
    from .model_card import write_model_card

    path = write_model_card(args.run_dir, out=args.out, model_id=args.model_id)
    print(f"wrote {path}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from .evaluation import evaluate_gsm8k, load_gsm8k_problems

    problems = load_gsm8k_problems(
        args.problems, limit=args.limit, tail=args.tail, split=args.split,
        question_field=args.question_field, answer_field=args.answer_field,
    )
    tokenizer = _load_tokenizer(args.tokenizer or args.model)
    model = _load_model(args.model, args)
    teacher = _load_model(args.teacher, args) if args.teacher else None
    result = evaluate_gsm8k(
        model, tokenizer, problems, teacher=teacher, rock_ids=args.rock_set, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, beta=args.beta, temperature=args.temperature,
    )
    result.settings.update(model=args.model, teacher_model=args.teacher, problems=str(args.problems),
                           rock_set=args.rock_set)
    print(result.table())
    if args.out:
        result.save(args.out, include_records=args.records)
        print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `hf-rockopd` argument parser."""
    parser = argparse.ArgumentParser(prog="hf-rockopd", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    analyze = commands.add_parser("analyze", help="the rock-token lab").add_subparsers(dest="step", required=True)

    def selection(p: argparse.ArgumentParser) -> None:
        p.add_argument("--min-count", type=int, default=2, help="ids seen fewer times are ineligible (paper: 2)")
        p.add_argument("--exclude-top-frequent", type=int, default=5, help="most frequent ids dropped (paper: 5)")

    p = analyze.add_parser("collect", help="roll out prompts with the student and score every token")
    p.add_argument("--student", required=True, help="student model directory or Hub id")
    p.add_argument("--teacher", required=True, help="teacher model directory or Hub id (same tokenizer)")
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: the student's)")
    p.add_argument("--prompts", required=True, help="JSON lines with `messages`, `prompt` or `question`")
    p.add_argument("--prompt-field", default=None, help="the column holding the prompt")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument("--out", required=True, help="token-table directory (resumable)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--beta", type=float, default=1.0, help="divergence: 1 reverse KL (paper), 0 forward KL")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--no-grad-cosine", action="store_true",
                   help="skip the cosine with G_balanced (two extra forward passes per batch)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_collect)

    p = analyze.add_parser("score", help="Rock Score and selection; writes rock_set.json")
    p.add_argument("table")
    p.add_argument("--top-k", type=int, default=100)
    p.add_argument("--coverage", type=float, default=None, help="pick K by divergence share instead of --top-k")
    selection(p)
    p.add_argument("--out", default="rock_set.json")
    p.add_argument("--show", type=int, default=20, help="rocks to print")
    p.set_defaults(func=_score)

    p = analyze.add_parser("stability", help="Jaccard sweep over K and sub-corpus size")
    p.add_argument("table")
    p.add_argument("--ks", type=int, nargs="+", default=[25, 50, 100, 150, 200])
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="sub-corpus sizes in prompts")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threshold", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default=None, help="CSV of the sweep")
    selection(p)
    p.set_defaults(func=_stability)

    p = analyze.add_parser("controls", help="a random id set matched to the rock set's frequencies")
    p.add_argument("table")
    p.add_argument("--rock-set", required=True)
    p.add_argument("--bins", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="controls.json")
    p.set_defaults(func=_controls)

    def rock_set_analysis(p: argparse.ArgumentParser, func) -> None:
        p.add_argument("--rock-set", required=True)
        p.add_argument("--seed", type=int, default=0, help="seed of the matched random control")
        p.add_argument("--out", default=None, help="CSV of the comparison")
        p.set_defaults(func=func)

    p = analyze.add_parser("compare", help="early vs late tables: rocks, rare types, controls (Wilcoxon)")
    p.add_argument("early")
    p.add_argument("late")
    rock_set_analysis(p, _compare)

    p = analyze.add_parser("gradients", help="logit-gradient norms of rocks vs others (Mann-Whitney)")
    p.add_argument("table")
    rock_set_analysis(p, _gradients)

    p = analyze.add_parser("knockout", help="ban each rock at inference; bootstrap p-values, BH q-values")
    p.add_argument("--model", required=True, help="the model to evaluate (directory or Hub id)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument(
        "--problems", required=True, help="JSON lines with `question` and `answer` (GSM8K, gold after ####), or openai/gsm8k"
    )
    p.add_argument("--rock-set", required=True)
    p.add_argument("--top", type=int, default=20, help="ban the first N ids of the rock set, one at a time")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--resamples", type=int, default=10_000)
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="CSV of the verdicts")
    p.set_defaults(func=_knockout)

    p = analyze.add_parser("report", help="Markdown + HTML report with PNG figures")
    p.add_argument("table")
    p.add_argument("--rock-set", default=None, help="rock_set.json scored from TABLE (its settings are reused)")
    p.add_argument("--top-k", type=int, default=100)
    p.add_argument("--coverage", type=float, default=None, help="pick K by divergence share instead of --top-k")
    selection(p)
    p.add_argument("--late", default=None, help="a second token table (e.g. a later checkpoint) to compare with")
    p.add_argument("--knockout", default=None, help="CSV written by `analyze knockout --out`")
    p.add_argument("--show", type=int, default=20, help="rocks listed in the report")
    p.add_argument("--seed", type=int, default=0, help="seed of the matched random control")
    p.add_argument("--title", default="Rock-token report")
    p.add_argument("--out", default="report", help="report directory")
    p.set_defaults(func=_report)

    p = commands.add_parser("card", help="render the model card of a saved run (to check it before upload)")
    p.add_argument("run_dir", help="output directory of `hf-rockopd distill` (run_report.json, rock_tokens.json)")
    p.add_argument("--out", default=None, help="card path (default RUN_DIR/README.md); the curves PNG goes next to it")
    p.add_argument("--model-id", default=None, help="Hub id shown in the loading snippet (e.g. me/smollm2-rockopd)")
    p.set_defaults(func=_card)
    p = commands.add_parser(
        "distill",
        add_help=False,  # `hf-rockopd distill --help` shows the TrlParser help of every training option
        help="rock-token OPD end to end: evaluate, train, evaluate, save, model card (--help for all options)",
    )
    p.add_argument("options", nargs=argparse.REMAINDER, help="DistillArguments and RockOPDConfig flags, or --config")
    p.set_defaults(func=_distill)

    p = commands.add_parser("eval", help="GSM8K accuracy, held-out divergence to the teacher, top-1 agreement")
    p.add_argument("--model", required=True, help="the student (directory or Hub id)")
    p.add_argument("--teacher", default=None, help="the teacher (same tokenizer); without it, accuracy only")
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: the model's)")
    p.add_argument("--problems", required=True, help="JSON lines with `question` and `answer`, or openai/gsm8k")
    p.add_argument("--split", default="train", help="split when --problems is openai/gsm8k")
    p.add_argument("--question-field", default="question")
    p.add_argument("--answer-field", default="answer", help="GSM8K solution ending in '#### <number>'")
    p.add_argument("--limit", type=int, default=None, help="evaluate N problems")
    p.add_argument("--tail", action="store_true", help="take the last N problems (held out from training)")
    p.add_argument("--rock-set", default=None, help="rock_tokens.json / rock_set.json for the non-rock divergence")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--beta", type=float, default=1.0, help="the training divergence: 1 reverse KL, 0 forward KL")
    p.add_argument("--temperature", type=float, default=1.0, help="the training loss temperature")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="JSON of the result (EvalResult.to_dict)")
    p.add_argument("--records", action="store_true", help="also write per-problem records (answers, texts) to --out")
    p.set_defaults(func=_eval)
    return parser


def _distill(args: argparse.Namespace) -> int:
    from .distill import main as distill_main

    return distill_main(args.options)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["distill"]:
        # argparse's REMAINDER does not take a leading `--flag`; TrlParser parses these itself.
        return argparse.Namespace(command="distill", options=argv[1:], func=_distill)
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hf-rockopd`. Bad input exits with status 2 and one line saying what is wrong.

    Example:
    ```python
    from hf_rockopd.cli import main
    main(["analyze", "score", "tables/early", "--top-k", "100", "--out", "rock_set.json"])
    ```
    """
    args = _parse(argv)
    name = " ".join(part for part in ("hf-rockopd", args.command, getattr(args, "step", None)) if part)
    try:
        return args.func(args)
    except (ValueError, OSError) as err:  # OSError: missing files and models (ModelNotFoundError)
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
