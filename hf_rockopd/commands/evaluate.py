"""`hf-rockopd eval` on any dataset: accuracy (math-verify, `--verifier`; with its interval and the teacher's as the
ceiling), text quality (finished answers, loops, repetition), the teacher-forced divergence on the teacher's own
completions and the on-policy one."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..evaluation.answers import VERIFIERS, check_verifier
from .loading import LoadingArguments, check_references, load_model, load_problems, load_tokenizer
from .parsing import Command, check_at_least, check_range

__all__ = ["COMMANDS", "EvalArguments", "evaluate"]


@dataclass
class EvalArguments:
    """Options of `eval`.

    Example:
    ```python
    >>> from hf_rockopd.commands.evaluate import EvalArguments
    >>> EvalArguments(model="runs/smollm2-rockopd", problems="gsm8k.jsonl", batch_size=0)
    Traceback (most recent call last):
    ...
    ValueError: batch_size must be an integer >= 1, got 0.
    ```
    """

    model: str = field(metadata={"help": "The student (directory or Hub id)."})
    problems: str = field(
        metadata={"help": "Hub id or local file/folder (JSONL, JSON, Parquet, CSV) in TRL's formats: messages, prompt "
                  "or question/answer (a local copy of a Hub id is used first)."}
    )
    teacher: str | None = field(
        default=None, metadata={"help": "The teacher (same tokenizer); without it, accuracy only."}
    )
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer (default: the model's)."})
    dataset_config: str | None = field(default=None, metadata={"help": "Hub configuration (default: the dataset's)."})
    split: str = field(default="train", metadata={"help": "Split of --problems (e.g. test for MATH-500)."})
    prompt_column: str | None = field(default=None, metadata={"help": "Column holding the prompt (default: guessed)."})
    answer_column: str | None = field(
        default=None, metadata={"help": "Column holding the reference answer (default: guessed)."}
    )
    limit: int | None = field(default=None, metadata={"help": "Evaluate N problems."})
    tail: bool = field(default=False, metadata={"help": "Take the last N problems (held out from training)."})
    system_prompt: str | None = field(
        default=None, metadata={"help": "System turn before every prompt (default: the chat template's)."}
    )
    teacher_reference: str | None = field(
        default=None,
        metadata={"help": "JSON cache of the teacher's completions: reused when made with the same teacher, "
                  "tokenizer, problems and max_new_tokens, else generated again and written there."},
    )
    teacher_cache: str | None = field(
        default=None,
        metadata={"help": "Offline teacher cache of --teacher_reference's completions (hf-rockopd teacher-cache): "
                  "the teacher-forced divergence (top-k, tail bin) without the teacher in memory."},
    )
    rock_set: str | None = field(
        default=None, metadata={"help": "rock_tokens.json / rock_set.json for the non-rock divergence."}
    )
    max_new_tokens: int = field(default=256, metadata={"help": "Greedy new tokens per problem."})
    batch_size: int = field(default=8, metadata={"help": "Problems generated at once."})
    beta: float = field(default=1.0, metadata={"help": "The training divergence: 1 reverse KL, 0 forward KL."})
    temperature: float = field(default=1.0, metadata={"help": "The training loss temperature."})
    out: str | None = field(default=None, metadata={"help": "JSON of the result (EvalResult.to_dict)."})
    records: bool = field(
        default=False, metadata={"help": "Also write per-problem records (answers, texts) to --out."}
    )
    verifier: str = field(
        default="math",
        metadata={"help": "How answers are checked (math-verify): math (final answers, \\boxed{}), gsm8k ('#### n' "
                  "references), none (no accuracy).", "choices": list(VERIFIERS)},
    )
    last_number: bool = field(
        default=False,
        metadata={"help": "Credit the last number of a finished answer without a final-answer marker (never a cut "
                  "one)."},
    )

    def __post_init__(self):
        check_verifier(self.verifier)
        check_at_least(self, "limit", "max_new_tokens", "batch_size")
        check_range(self, "beta", 0, 1)
        check_range(self, "temperature", 0, float("inf"), low_open=True, high_open=True)
        if self.teacher_cache is not None:
            if self.teacher_reference is None or not os.path.isfile(self.teacher_reference):
                raise ValueError(
                    "--teacher_cache needs --teacher_reference, the existing reference whose completions it caches "
                    f"(got {self.teacher_reference!r})."
                )
            from ..teachers import TeacherCache

            TeacherCache.read_settings(self.teacher_cache)  # a missing or foreign file fails before any model loads


def evaluate(args: EvalArguments, loading: LoadingArguments) -> int:
    """Run `eval`: print the results table, and write it to `--out`."""
    from ..evaluation.evaluate import evaluate_gsm8k
    from ..evaluation.teacher_reference import load_or_build_teacher_reference

    problems = load_problems(
        args.problems, limit=args.limit, tail=args.tail, config=args.dataset_config, split=args.split,
        prompt_column=args.prompt_column, answer_column=args.answer_column, system_prompt=args.system_prompt,
    )
    check_references(problems, args.verifier, str(args.problems))  # before any model loads
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    model = load_model(args.model, loading)
    teacher = load_model(args.teacher, loading) if args.teacher else None
    reference = args.teacher_reference
    if teacher is not None:
        # Made once per problem set and teacher; another checkpoint's evaluation reuses the file.
        reference = load_or_build_teacher_reference(
            args.teacher_reference, teacher, tokenizer, problems, teacher_name=args.teacher,
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, show_progress=True,
        )
    forced = None
    if args.teacher_cache is not None:
        from ..teachers import CachedTeacher, TeacherCache

        cache = TeacherCache.load(args.teacher_cache, temperature=args.temperature, teacher=args.teacher)
        forced = CachedTeacher(cache)
    result = evaluate_gsm8k(
        model, tokenizer, problems, teacher=teacher, teacher_reference=reference, forced_teacher=forced,
        rock_ids=args.rock_set,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, beta=args.beta, temperature=args.temperature,
        verifier=args.verifier, last_number=args.last_number,
    )
    result.settings.update(model=args.model, teacher_model=args.teacher, problems=str(args.problems),
                           rock_set=args.rock_set, teacher_reference_file=args.teacher_reference,
                           teacher_cache=args.teacher_cache)
    print(result.table())
    if args.out:
        result.save(args.out, include_records=args.records)
        print(f"wrote {args.out}")
    return 0


COMMANDS = (
    Command("eval", "accuracy (math-verify), answer quality, teacher-forced and on-policy divergence to the teacher",
            (EvalArguments, LoadingArguments), evaluate,
            # The GSM8K-only names of these options, before any dataset was accepted.
            renamed={"--question_field": "--prompt_column", "--answer_field": "--answer_column",
                     "--question-field": "--prompt_column", "--answer-field": "--answer_column"}),
)
