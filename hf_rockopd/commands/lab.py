"""`hf-rockopd analyze STEP`: the rock-token lab's steps, each a dataclass of options and a function.

```
hf-rockopd analyze collect --student S --teacher T --prompts gsm8k.jsonl --limit 500 --out tables/early
hf-rockopd analyze score tables/early --top_k 100 --out rock_set.json
hf-rockopd analyze stability tables/early --ks 25 50 100 150 200
hf-rockopd analyze controls tables/early --rock_set rock_set.json --out controls.json
hf-rockopd analyze compare tables/early tables/late --rock_set rock_set.json
hf-rockopd analyze gradients tables/early --rock_set rock_set.json
hf-rockopd analyze knockout --model S --problems gsm8k.jsonl --rock_set rock_set.json --top 20 --limit 200
hf-rockopd analyze report tables/early --rock_set rock_set.json --knockout knockout.csv --out report/
```
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .loading import LoadingArguments, check_references, load_model, load_problems, load_tokenizer
from .parsing import Command, check_at_least, check_range

__all__ = [
    "COMMANDS", "CollectArguments", "CompareArguments", "ControlsArguments", "GradientsArguments",
    "KnockoutArguments", "ReportArguments", "ScoreArguments", "SelectionArguments", "StabilityArguments",
]


def _lab():
    """The lab's functions (tables, selection, statistics, knockout): the one import of them here."""
    from .. import lab

    return lab


def _print_frame(frame, out: str | None) -> None:
    print(frame.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    if out:
        frame.to_csv(out, index=False)
        print(f"wrote {out}")


def _rock_ids(path: str, table) -> list[int]:
    from ..policies.rock_set import load_rock_set

    return load_rock_set(path, vocab_size=table.vocab_size)["token_ids"]


# ------------------------------------------------------------------------------------------------- options ----
@dataclass
class SelectionArguments:
    """Which token ids may be rocks (the paper's eligibility rules).

    Example:
    ```python
    >>> from hf_rockopd.commands.lab import SelectionArguments
    >>> SelectionArguments(min_count=-1)
    Traceback (most recent call last):
    ...
    ValueError: min_count must be an integer >= 0, got -1.
    ```
    """

    min_count: int = field(default=2, metadata={"help": "Ids seen fewer times are ineligible (paper: 2)."})
    exclude_top_frequent: int = field(default=5, metadata={"help": "Most frequent ids dropped (paper: 5)."})
    allow_special_tokens: bool = field(
        default=False,
        metadata={"help": "Let stop and control tokens (eos, pad, <|im_end|>, ...) be rocks; research only: freezing "
                  "the stop token unteaches stopping."},
    )

    def __post_init__(self):
        check_at_least(self, "min_count", "exclude_top_frequent", minimum=0)


@dataclass
class CollectArguments:
    """Options of `analyze collect`: roll out prompts with the student and score every generated token."""

    student: str = field(metadata={"help": "Student model directory or Hub id."})
    teacher: str = field(metadata={"help": "Teacher model directory or Hub id (same tokenizer)."})
    prompts: str = field(
        metadata={"help": "JSON lines with `messages`, `prompt` or `question`, or any dataset (Parquet, CSV, Hub id)."}
    )
    out: str = field(metadata={"help": "Token-table directory (resumable)."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer (default: the student's)."})
    prompt_field: str | None = field(default=None, metadata={"help": "The column holding the prompt."})
    system_prompt: str | None = field(
        default=None, metadata={"help": "System turn before every prompt (default: the chat template's)."}
    )
    limit: int | None = field(default=None, metadata={"help": "Use the first N prompts."})
    max_new_tokens: int = field(default=256, metadata={"help": "New tokens generated per prompt."})
    batch_size: int = field(default=8, metadata={"help": "Prompts generated at once."})
    sample: bool = field(default=False, metadata={"help": "Sample instead of greedy decoding."})
    seed: int = field(default=42, metadata={"help": "Seed of the sampling."})
    beta: float = field(default=1.0, metadata={"help": "Divergence: 1 reverse KL (paper), 0 forward KL."})
    temperature: float = field(default=1.0, metadata={"help": "Temperature of the distributions compared."})
    no_grad_cosine: bool = field(
        default=False, metadata={"help": "Skip the cosine with G_balanced (two extra forward passes per batch)."}
    )

    def __post_init__(self):
        check_at_least(self, "limit", "max_new_tokens", "batch_size")
        check_range(self, "beta", 0, 1)
        check_range(self, "temperature", 0, float("inf"), low_open=True, high_open=True)


@dataclass
class ScoreArguments:
    """Options of `analyze score`: Rock Score and selection; writes rock_set.json."""

    table: str = field(metadata={"help": "Token-table directory written by `analyze collect`."})
    top_k: int = field(default=100, metadata={"help": "Rock tokens kept (the K highest Rock Scores)."})
    coverage: float | None = field(
        default=None, metadata={"help": "Pick K by divergence share (0 < coverage <= 1) instead of --top_k."}
    )
    out: str = field(default="rock_set.json", metadata={"help": "Rock-set file written."})
    show: int = field(default=20, metadata={"help": "Rocks printed."})

    def __post_init__(self):
        check_at_least(self, "top_k")
        check_at_least(self, "show", minimum=0)
        check_range(self, "coverage", 0, 1, low_open=True)


@dataclass
class StabilityArguments:
    """Options of `analyze stability`: Jaccard sweep over K and sub-corpus size."""

    table: str = field(metadata={"help": "Token-table directory written by `analyze collect`."})
    ks: list[int] = field(default_factory=lambda: [25, 50, 100, 150, 200], metadata={"help": "Values of K swept."})
    sizes: list[int] | None = field(default=None, metadata={"help": "Sub-corpus sizes in prompts."})
    repeats: int = field(default=5, metadata={"help": "Random sub-corpora per size."})
    threshold: float = field(default=0.7, metadata={"help": "Mean Jaccard a recommended K reaches at every size."})
    seed: int = field(default=42, metadata={"help": "Seed of the sub-corpus draws."})
    out: str | None = field(default=None, metadata={"help": "CSV of the sweep."})

    def __post_init__(self):
        check_at_least(self, "ks", "sizes", "repeats")
        check_range(self, "threshold", 0, 1)


@dataclass
class ControlsArguments:
    """Options of `analyze controls`: a random id set matched to the rock set's frequencies."""

    table: str = field(metadata={"help": "Token-table directory written by `analyze collect`."})
    rock_set: str = field(metadata={"help": "rock_set.json to match."})
    bins: int = field(default=10, metadata={"help": "Frequency bins matched."})
    seed: int = field(default=0, metadata={"help": "Seed of the draw."})
    out: str = field(default="controls.json", metadata={"help": "Control-set file written."})

    def __post_init__(self):
        check_at_least(self, "bins")


@dataclass
class CompareArguments:
    """Options of `analyze compare`: early vs late tables: rocks, rare types, controls (Wilcoxon)."""

    early: str = field(metadata={"help": "Token table of the earlier checkpoint."})
    late: str = field(metadata={"help": "Token table of the later checkpoint."})
    rock_set: str = field(metadata={"help": "rock_set.json scored from EARLY."})
    seed: int = field(default=0, metadata={"help": "Seed of the matched random control."})
    out: str | None = field(default=None, metadata={"help": "CSV of the comparison."})


@dataclass
class GradientsArguments:
    """Options of `analyze gradients`: logit-gradient norms of rocks vs others (Mann-Whitney)."""

    table: str = field(metadata={"help": "Token-table directory written by `analyze collect`."})
    rock_set: str = field(metadata={"help": "rock_set.json scored from TABLE."})
    seed: int = field(default=0, metadata={"help": "Seed of the matched random control."})
    out: str | None = field(default=None, metadata={"help": "CSV of the comparison."})


@dataclass
class KnockoutArguments:
    """Options of `analyze knockout`: ban each rock at inference; bootstrap p-values, BH q-values."""

    model: str = field(metadata={"help": "The model to evaluate (directory or Hub id)."})
    problems: str = field(
        metadata={"help": "Hub id or local file (JSONL, JSON, Parquet, CSV) in TRL's formats, with reference answers."}
    )
    rock_set: str = field(metadata={"help": "rock_set.json whose first --top ids are banned."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer (default: the model's)."})
    top: int = field(default=20, metadata={"help": "Ban the first N ids of the rock set, one at a time."})
    system_prompt: str | None = field(
        default=None, metadata={"help": "System turn before every prompt (default: the chat template's)."}
    )
    limit: int | None = field(default=None, metadata={"help": "Evaluate the first N problems."})
    max_new_tokens: int = field(default=256, metadata={"help": "Greedy new tokens per problem."})
    batch_size: int = field(default=8, metadata={"help": "Problems generated at once."})
    resamples: int = field(default=10_000, metadata={"help": "Bootstrap resamples per banned id."})
    alpha: float = field(default=0.05, metadata={"help": "False-discovery rate of the BH verdicts."})
    seed: int = field(default=0, metadata={"help": "Seed of the bootstrap."})
    out: str | None = field(default=None, metadata={"help": "CSV of the verdicts."})
    verifier: str = field(
        default="math",
        metadata={"help": "How answers are checked (math-verify): math or gsm8k.", "choices": ["math", "gsm8k"]},
    )

    def __post_init__(self):
        check_at_least(self, "top", "limit", "max_new_tokens", "batch_size", "resamples")
        if self.verifier not in ("math", "gsm8k"):
            raise ValueError(
                f"verifier must be 'math' or 'gsm8k' (the knockout measures accuracy), got {self.verifier!r}."
            )
        check_range(self, "alpha", 0, 1, low_open=True, high_open=True)


@dataclass
class ReportArguments:
    """Options of `analyze report`: Markdown + HTML report with PNG figures."""

    table: str = field(metadata={"help": "Token-table directory written by `analyze collect`."})
    rock_set: str | None = field(
        default=None, metadata={"help": "rock_set.json scored from TABLE (its settings are reused)."}
    )
    top_k: int = field(default=100, metadata={"help": "Rock tokens kept when no --rock_set is given."})
    coverage: float | None = field(
        default=None, metadata={"help": "Pick K by divergence share (0 < coverage <= 1) instead of --top_k."}
    )
    late: str | None = field(default=None, metadata={"help": "A second token table (a later checkpoint) to compare."})
    knockout: str | None = field(default=None, metadata={"help": "CSV written by `analyze knockout --out`."})
    show: int = field(default=20, metadata={"help": "Rocks listed in the report."})
    seed: int = field(default=0, metadata={"help": "Seed of the matched random control."})
    title: str = field(default="Rock-token report", metadata={"help": "Title of the report."})
    out: str = field(default="report", metadata={"help": "Report directory."})

    def __post_init__(self):
        check_at_least(self, "top_k")
        check_at_least(self, "show", minimum=0)
        check_range(self, "coverage", 0, 1, low_open=True)


# ------------------------------------------------------------------------------------------------- handlers ----
def collect(args: CollectArguments, loading: LoadingArguments) -> int:
    """Run `analyze collect`."""
    lab = _lab()
    prompts = lab.load_prompts(
        args.prompts, limit=args.limit, field_name=args.prompt_field, system_prompt=args.system_prompt
    )
    tokenizer = load_tokenizer(args.tokenizer or args.student)
    student, teacher = load_model(args.student, loading), load_model(args.teacher, loading)
    lab.collect_token_table(
        student, teacher, tokenizer, prompts, args.out, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, do_sample=args.sample, seed=args.seed, beta=args.beta,
        temperature=args.temperature, gradient_cosine=not args.no_grad_cosine,
    )
    table = lab.load_token_table(args.out)
    print(f"collected {len(table.frame)} generated tokens from {len(prompts)} prompts into {args.out}")
    return 0


def score(args: ScoreArguments, selection: SelectionArguments) -> int:
    """Run `analyze score`."""
    lab = _lab()
    table = lab.load_token_table(args.table)
    result = lab.score_token_table(
        table, top_k=None if args.coverage is not None else args.top_k, min_count=selection.min_count,
        exclude_top_frequent=selection.exclude_top_frequent, coverage=args.coverage,
        allow_special_tokens=selection.allow_special_tokens,
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


def stability(args: StabilityArguments, selection: SelectionArguments) -> int:
    """Run `analyze stability`."""
    lab = _lab()
    frame, k = lab.stability_sweep(
        lab.load_token_table(args.table), ks=args.ks, subcorpus_sizes=args.sizes, repeats=args.repeats,
        min_count=selection.min_count, exclude_top_frequent=selection.exclude_top_frequent,
        threshold=args.threshold, seed=args.seed, allow_special_tokens=selection.allow_special_tokens,
    )
    _print_frame(frame, args.out)
    print(f"recommended K (mean Jaccard >= {args.threshold} at every sub-corpus size): {k}")
    return 0


def controls(args: ControlsArguments) -> int:
    """Run `analyze controls`."""
    from ..policies.rock_set import save_rock_set

    lab = _lab()
    table = lab.load_token_table(args.table)
    ids = lab.matched_controls(table, _rock_ids(args.rock_set, table), num_bins=args.bins, seed=args.seed)
    decoded, counts = table.decode(), table.counts()
    tokens = [{"token_id": i, "token": decoded.get(i, ""), "count": int(counts[i])} for i in ids]
    save_rock_set(
        args.out, tokens, vocab_size=table.vocab_size, tokenizer_name=table.meta.get("tokenizer"),
        source="hf_rockopd.lab.matched_controls", role="frequency_matched_control", matched_to=args.rock_set,
    )
    print(f"wrote {len(ids)} frequency-matched control ids to {args.out}")
    return 0


def compare(args: CompareArguments) -> int:
    """Run `analyze compare`."""
    lab = _lab()
    early, late = lab.load_token_table(args.early), lab.load_token_table(args.late)
    _print_frame(lab.compare_token_tables(early, late, _rock_ids(args.rock_set, early), seed=args.seed), args.out)
    return 0


def gradients(args: GradientsArguments) -> int:
    """Run `analyze gradients`."""
    lab = _lab()
    table = lab.load_token_table(args.table)
    _print_frame(lab.gradient_geometry(table, _rock_ids(args.rock_set, table), seed=args.seed), args.out)
    return 0


def knockout(args: KnockoutArguments, loading: LoadingArguments) -> int:
    """Run `analyze knockout`."""
    from ..models.introspection import vocab_size
    from ..policies.rock_set import load_rock_set

    problems = load_problems(args.problems, limit=args.limit, system_prompt=args.system_prompt)
    check_references(problems, args.verifier, args.problems)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    model = load_model(args.model, loading)
    ids = load_rock_set(args.rock_set, vocab_size=vocab_size(model))["token_ids"][: args.top]
    frame = _lab().knockout(
        model, tokenizer, problems, ids, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        n_resamples=args.resamples, alpha=args.alpha, seed=args.seed, show_progress=True, verifier=args.verifier,
    )
    _print_frame(frame, args.out)
    counts = frame["verdict"].value_counts()
    print(
        f"baseline accuracy {frame.attrs['baseline_accuracy']:.3f} on {len(problems)} problems; "
        + ", ".join(f"{v}: {int(counts.get(v, 0))}" for v in ("Pillar", "Neutral", "Stumbling"))
    )
    return 0


def report(args: ReportArguments, selection: SelectionArguments) -> int:
    """Run `analyze report`."""
    from ..lab import build_report
    from ..policies.rock_set import load_rock_set

    lab = _lab()
    table = lab.load_token_table(args.table)
    if args.rock_set:
        # Rescore with the rock set's own settings, so the report's numbers are the ones `score` printed.
        payload = load_rock_set(args.rock_set, vocab_size=table.vocab_size)
        chosen = payload.get("selection") or {}
        coverage = chosen.get("coverage")
        result = lab.score_token_table(
            table,
            top_k=None if coverage is not None else int(chosen.get("top_k", len(payload["token_ids"]))),
            coverage=coverage,
            min_count=int(chosen.get("min_count", selection.min_count)),
            exclude_top_frequent=int(chosen.get("exclude_top_frequent", selection.exclude_top_frequent)),
            # A rock set scored before stop tokens were excluded records none: rescore it as it was made.
            exclude_ids=[int(i) for i in chosen.get("excluded_ids", [])],
        )
        if result.rock_ids != payload["token_ids"]:
            raise ValueError(
                f"{args.rock_set} was not scored from {args.table}: rescoring the table with its settings gives other "
                "ids. Give the table it was scored from, or drop --rock_set to score here."
            )
    else:
        result = lab.score_token_table(
            table, top_k=None if args.coverage is not None else args.top_k, coverage=args.coverage,
            min_count=selection.min_count, exclude_top_frequent=selection.exclude_top_frequent,
            allow_special_tokens=selection.allow_special_tokens,
        )
    built = build_report(table, args.out, score=result, late_table=args.late, knockout=args.knockout,
                         top_n=args.show, seed=args.seed, title=args.title)
    print(f"wrote {built.markdown_path}, {built.html_path} and {len(built.figures)} figures")
    return 0


COMMANDS = (
    Command("analyze collect", "roll out prompts with the student and score every token",
            (CollectArguments, LoadingArguments), collect),
    Command("analyze score", "Rock Score and selection; writes rock_set.json", (ScoreArguments, SelectionArguments),
            score, positionals=("table",)),
    Command("analyze stability", "Jaccard sweep over K and sub-corpus size", (StabilityArguments, SelectionArguments),
            stability, positionals=("table",)),
    Command("analyze controls", "a random id set matched to the rock set's frequencies", (ControlsArguments,),
            controls, positionals=("table",)),
    Command("analyze compare", "early vs late tables: rocks, rare types, controls (Wilcoxon)", (CompareArguments,),
            compare, positionals=("early", "late")),
    Command("analyze gradients", "logit-gradient norms of rocks vs others (Mann-Whitney)", (GradientsArguments,),
            gradients, positionals=("table",)),
    Command("analyze knockout", "ban each rock at inference; bootstrap p-values, BH q-values",
            (KnockoutArguments, LoadingArguments), knockout),
    Command("analyze report", "Markdown + HTML report with PNG figures", (ReportArguments, SelectionArguments),
            report, positionals=("table",)),
)
