"""The model card's limitations, read off the run report's numbers: what the evaluation showed, bad news included.

Every statement quotes the measured values (`eval.before` and `eval.after` of `run_report.json`, the training
settings, the teacher's source), so a card cannot read better than its run: accuracy at or near zero, answers cut at
the token limit, loops, less varied text, a divergence on the teacher's own text that rose, a small evaluation, a
short run, a quantized teacher. Thresholds are the module constants below.

Example:
```python
>>> from hf_rockopd.publishing.limitations import limitations
>>> after = {"accuracy": 0.0, "num_problems": 16, "accuracy_low": 0.0, "accuracy_high": 0.194, "clipped_ratio": 1.0,
...          "loop_rate": 0.75, "repeated_ngram_fraction": 0.6, "settings": {"max_new_tokens": 192}}
>>> lines = limitations({"eval": {"before": None, "after": after}, "student": {"base_model": "b"}})
>>> print(lines[0])
**Accuracy at or near zero.** It solved 0 of 16 held-out GSM8K problems (0.0 %; 95 % Wilson interval 0.0-19.4 %).
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..models.sources import describe_model_source
from .card_setup import public_name


__all__ = [
    "CLIPPED_LIMIT",
    "LOOP_LIMIT",
    "NEAR_ZERO_ACCURACY",
    "REPEAT_RISE",
    "SHORT_RUN_STEPS",
    "SIGNIFICANCE",
    "SMALL_EVAL",
    "limitations",
]

NEAR_ZERO_ACCURACY = 0.10  # at or below: "at or near zero" (1 of 16 is 6 %: near zero on GSM8K)
CLIPPED_LIMIT = 0.10  # a larger share of answers cut at the token limit is reported
LOOP_LIMIT = 0.10  # a larger share of looping answers (or of repeated 4-grams) is reported
SMALL_EVAL = 100  # fewer held-out problems than this: the interval is wide, say so
SHORT_RUN_STEPS = 500  # fewer optimizer steps: a demonstration run
# Step-by-step math answers repeat their own expressions: the base Qwen2.5-Coder-0.5B student repeats 23 % of its
# 4-grams with no loop at all. With a base evaluation, a high repeated share is reported only when it rose this much.
REPEAT_RISE = 0.05
SIGNIFICANCE = 0.05  # a verdict's paired p-value at or above this: the gain over the base may be chance


def _pct(value: float) -> str:
    return f"{100 * value:.1f} %"


def _number(stage: Mapping[str, Any] | None, key: str) -> float | None:
    value = (stage or {}).get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _was(before: Mapping[str, Any] | None, key: str, fmt=_pct) -> str:
    value = _number(before, key)
    return f" (before distillation: {fmt(value)})" if value is not None else ""


def _accuracy(after: Mapping[str, Any], before: Mapping[str, Any] | None) -> list[str]:
    accuracy, n = _number(after, "accuracy"), int(after.get("num_problems") or 0)
    if accuracy is None or n == 0:
        return []
    low, high = _number(after, "accuracy_low"), _number(after, "accuracy_high")
    interval = ""
    if low is not None and high is not None:
        interval = f"; 95 % Wilson interval {100 * low:.1f}-{100 * high:.1f} %"
    solved = f"It solved {round(accuracy * n)} of {n} held-out GSM8K problems ({_pct(accuracy)}{interval})."
    teacher = _number(after, "teacher_accuracy")
    if teacher is not None:
        solved += f" Its teacher solved {_pct(teacher)} of the same problems."
    lines = []
    if accuracy <= NEAR_ZERO_ACCURACY:
        lines.append(f"**Accuracy at or near zero.** {solved}")
    elif n < SMALL_EVAL:
        lines.append(f"**A small evaluation.** {solved} With {n} problems, differences inside the interval are noise.")
    previous = _number(before, "accuracy")
    if previous is not None and accuracy < previous:
        lines.append(f"**Accuracy fell during distillation**, from {_pct(previous)} to {_pct(accuracy)}.")
    return lines


def _behaviour(after: Mapping[str, Any], before: Mapping[str, Any] | None) -> list[str]:
    lines = []
    clipped = _number(after, "clipped_ratio")
    if clipped is not None and clipped >= CLIPPED_LIMIT:
        limit = (after.get("settings") or {}).get("max_new_tokens")
        at = f"the {limit}-token limit" if limit else "the token limit"
        lines.append(
            f"**Answers cut at the limit.** {_pct(clipped)} of its answers ran to {at} without finishing"
            f"{_was(before, 'clipped_ratio')}; a cut answer has no final number to grade."
        )
    loops, repeated = _number(after, "loop_rate"), _number(after, "repeated_ngram_fraction")
    repeated_before = _number(before, "repeated_ngram_fraction")
    repeats_more = (repeated or 0) >= LOOP_LIMIT and (
        repeated_before is None or repeated > repeated_before + REPEAT_RISE
    )
    if (loops or 0) >= LOOP_LIMIT or repeats_more:
        parts = []
        if loops is not None:
            parts.append(f"{_pct(loops)} of its answers contain a loop{_was(before, 'loop_rate')}")
        if repeated is not None:
            parts.append(
                f"on average {_pct(repeated)} of an answer's 4-grams repeat an earlier one"
                f"{_was(before, 'repeated_ngram_fraction')}"
            )
        lines.append(f"**Loops.** {'; '.join(parts)}.")
    distinct, distinct_before = _number(after, "distinct_2"), _number(before, "distinct_2")
    if distinct is not None and distinct_before and distinct < 0.9 * distinct_before:
        lines.append(f"**Less varied text.** Distinct-2 fell from {distinct_before:.3f} to {distinct:.3f}.")
    return lines


def _divergence(after: Mapping[str, Any], before: Mapping[str, Any] | None) -> list[str]:
    forced, forced_before = _number(after, "teacher_forced_divergence"), _number(before, "teacher_forced_divergence")
    own, own_before = _number(after, "mean_divergence"), _number(before, "mean_divergence")
    lines = []
    if forced is not None and forced_before is not None and forced > forced_before:
        line = (
            f"**Further from the teacher on the teacher's own text.** The divergence on the teacher's completions "
            f"rose from {forced_before:.4f} to {forced:.4f} per token."
        )
        if own is not None and own_before is not None and own < own_before:
            line += (
                f" The on-policy divergence fell ({own_before:.4f} to {own:.4f}), but it is measured on the student's "
                "own completions, which loops make easy to predict: read it together with the teacher-forced one."
            )
        lines.append(line)
    elif own is not None and own_before is not None and own > own_before:
        lines.append(f"**Divergence rose.** The on-policy divergence rose from {own_before:.4f} to {own:.4f}.")
    return lines


def _significance(verdict: Mapping[str, Any] | None) -> list[str]:
    """The held-out verdict's paired test (`hf-rockopd verdict`): a higher accuracy is not a better model until the
    paired p-value says the gain is unlikely to be chance."""
    if not verdict or verdict.get("p_value_vs_before") is None:
        return []
    p, before, after = verdict["p_value_vs_before"], verdict["accuracy_before"], verdict["accuracy_after"]
    if p < SIGNIFICANCE or after <= before:
        return []
    changes = verdict.get("vs_before") or {}
    churn = ""
    if changes.get("only_first") is not None and changes.get("only_second") is not None:
        churn = (f"it solves {changes['only_first']} problems its base did not and misses {changes['only_second']} "
                 "it solved, ")
    return [
        f"**Not significantly better than its base.** On {verdict['num_eval_problems']} held-out problems its accuracy "
        f"went from {_pct(before)} to {_pct(after)}: {churn}paired exact McNemar p = {p:.2g} (at or above "
        f"{SIGNIFICANCE}), so a gain of this size is within what chance gives."
    ]


def _run(report: Mapping[str, Any]) -> list[str]:
    lines = []
    training, dataset = report.get("training") or {}, report.get("dataset") or {}
    steps, batch = _steps_trained(training), training.get("per_device_train_batch_size")
    if isinstance(steps, int) and 0 < steps < SHORT_RUN_STEPS:
        seen = f" of {batch} prompts each" if batch else ""
        prompts = f", from {dataset['num_train']} training prompts" if dataset.get("num_train") else ""
        lines.append(
            f"**A short run.** {steps} optimizer steps{seen}{prompts}: a demonstration of the method, not a tuned "
            "model."
        )
    teacher = report.get("teacher") or {}
    if str(teacher.get("source") or "").startswith("gguf"):
        words = teacher.get("weights") or describe_model_source(str(teacher.get("name")), teacher.get("source"))
        lines.append(
            f"**A quantized teacher.** The teacher's weights are {words}: the student learned that copy's "
            f"distribution, not the full-precision {public_name(teacher.get('name'))}."
        )
    return lines


def _steps_trained(training: Mapping[str, Any]) -> int | None:
    """The steps the model has: `global_step` when recorded (a card written at a checkpoint has fewer than
    `max_steps`), else `max_steps`."""
    done = training.get("global_step")
    return done if isinstance(done, int) and done > 0 else training.get("max_steps")


def _not_evaluated(report: Mapping[str, Any]) -> str:
    """Why the card has no held-out evaluation: training still under way (the trainer writes a card at each
    checkpoint), a `distill` run with `--skip_eval`, or a trainer used on its own."""
    training = report.get("training") or {}
    done, planned = training.get("global_step"), training.get("max_steps")
    if isinstance(done, int) and isinstance(planned, int) and 0 <= done < planned:
        return (f"**Not evaluated yet.** This card was written at step {done} of {planned}, during training: the run's "
                "held-out evaluation, if it has one, comes at its end.")
    if report.get("distill_args") is not None:
        return ("**Not evaluated.** The run skipped the evaluation (`skip_eval`): nothing here measures what the "
                "student can do.")
    return ("**Not evaluated.** The trainer wrote this card and no held-out evaluation is recorded: nothing here "
            "measures what the student can do (`hf-rockopd distill` evaluates before and after training).")


def limitations(report: Mapping[str, Any]) -> list[str]:
    """The card's limitations (Markdown sentences, one per bullet), computed from the run report `report`.

    Example:
    ```python
    >>> from hf_rockopd.publishing.limitations import limitations
    >>> print(limitations({"eval": None, "student": {"base_model": "b"}, "distill_args": {}})[0])
    **Not evaluated.** The run skipped the evaluation (`skip_eval`): nothing here measures what the student can do.
    ```
    """
    evaluation = report.get("eval") or {}
    before, after = evaluation.get("before"), evaluation.get("after")
    lines = []
    if not after:
        lines.append(_not_evaluated(report))
    else:
        lines += _significance(report.get("verdict"))
        lines += _accuracy(after, before) + _behaviour(after, before) + _divergence(after, before)
    lines += _run(report)
    base = (report.get("student") or {}).get("base_model")
    # A card written before any evaluation (at a checkpoint, or with skip_eval) cannot say what it was evaluated on.
    scope = ("Evaluated on GSM8K only (greedy decoding, English grade-school math); not evaluated for safety, bias or "
             "other tasks." if after else "Not evaluated on any task, nor for safety or bias.")
    lines.append(
        f"**Scope.** {scope} It inherits the limitations of its base model{f', {public_name(base)}' if base else ''}."
    )
    return lines
