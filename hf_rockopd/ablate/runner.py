"""`hf-rockopd ablate`: the paper's policy ablation for any teacher-student pair, as one resumable command.

```
hf-rockopd ablate --teacher Qwen/Qwen2.5-Coder-1.5B-Instruct --student Qwen/Qwen2.5-Coder-0.5B-Instruct \
    --dataset gsm8k/train.jsonl --policies uniform rock_freeze random_matched rock_online soft --seeds 0 1 2 \
    --protocol warm_start --warm_start_steps 20 --max_steps 20 --num_eval_problems 32 --output_dir runs/ablate
```

Rerun the same command after an interruption: finished runs are skipped, the warm start is loaded (or its training
resumed from its last checkpoint), and the summary is rewritten from every finished run. Adding seeds or policies
to a rerun extends the ablation; changing the budget is refused.

Layout of `--output_dir` (every file is written to a temporary name and renamed, so a killed run leaves none half
written):

```
ablation.json                    the settings; a rerun with other budget settings is refused
warm_start/model/                the uniform-OPD checkpoint every run continues from (protocol warm_start)
warm_start/warm_start.json       written last: the warm start is done
rocks/table/                     the lab's token table on the start weights (collect)
rocks/rock_set.json              the rocks selected on it (score); rock_freeze, soft and random_matched use them
rocks/reference_counts.json      token frequencies of that table, to which random_matched matches its control
teacher_reference.json           the teacher's completions of the held-out problems (teacher-forced divergence)
start_eval.json                  the held-out evaluation of the start weights (reference, not compared)
runs/<policy>/seed_<seed>/result.json   written last: the run is done and skipped on rerun
summary.json, summary.md, summary.png   `hf_rockopd.ablate.summary`
```

Every run starts from a fresh copy of the start weights held in memory, trains `--max_steps` steps with the trainer's
`seed` and `data_seed` set to the run's seed (so every policy sees the same prompts in the same order per seed), is
evaluated on the held-out problems, and keeps only its result: no run saves model weights.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import time
from dataclasses import replace
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging
from trl import get_peft_config

# The rest of the package, gathered here so that a reorganization changes these lines only.
from ..evaluation.answers import reference_answer
from ..data import split_dataset
from ..models.student_config import StudentModelConfig, student_model_config
from ..evaluation.evaluate import evaluate_gsm8k
from ..lab import collect_token_table, load_token_table, score_token_table
from ..models.introspection import eos_token_ids
from ..models import middle_block_layers, pack_for_inference, packing_applies, prune_decoder_layers, resolve_causal_lm
from ..evaluation.quality import numeric_token_ids
from ..policies.rock_set import load_rock_set
from ..evaluation.teacher_reference import load_or_build_teacher_reference
from ..trainers import RockOPDConfig
from .arguments import (
    AblateArguments,
    check_training_budget,
    training_fingerprint,
)
from .compute import train_copy
from .measures import problem_quality, run_quality

logger = logging.get_logger(__name__)

__all__ = ["RESULT_NAME", "run_ablation", "run_directory"]

RESULT_NAME = "result.json"
RESULT_FORMAT = "hf_rockopd.ablate.run"
SETTINGS_NAME = "ablation.json"


def run_directory(output_dir: str, policy: str, seed: int) -> str:
    """Where the run `(policy, seed)` of an ablation keeps its result."""
    return os.path.join(output_dir, "runs", policy, f"seed_{seed}")


def _write_json(path: str, data: Any) -> None:
    """Write to a temporary name, then rename: a reader (or a rerun) never sees half a file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=_json_default)
    os.replace(tmp, path)


def _json_default(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else str(value)


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------- models ----
def _load_models(ablate: AblateArguments):
    """Teacher and student as `hf-rockopd distill` loads them (in full precision; LoRA adapters are added per run)."""
    teacher = resolve_causal_lm(ablate.teacher)
    if ablate.student is None:
        base, default_layers = teacher.model, min(24, teacher.model.config.num_hidden_layers)
    else:
        resolved = resolve_causal_lm(ablate.student)
        if resolved.tokenizer.get_vocab() != teacher.tokenizer.get_vocab():
            raise ValueError(
                f"The student {ablate.student!r} and the teacher {ablate.teacher!r} have different tokenizers; "
                "token-level distillation needs one shared vocabulary."
            )
        base, default_layers = resolved.model, resolved.model.config.num_hidden_layers
    total = base.config.num_hidden_layers
    keep = middle_block_layers(total, ablate.student_num_layers or default_layers)
    if ablate.student is None and len(keep) == total:
        raise ValueError(
            f"The student would be an unpruned copy of the teacher; set student_num_layers below {total} or --student."
        )
    student = prune_decoder_layers(base, keep) if len(keep) < total else base
    return teacher.model, student, teacher.tokenizer


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


# -------------------------------------------------------------------------------------------- warm start ----
def _warm_start(student, teacher, tokenizer, prompts, ablate: AblateArguments, args: RockOPDConfig, root: str,
                peft_config=None):
    """Uniform OPD for `warm_start_steps` from the student, saved once; a rerun loads it (or resumes its training).

    With LoRA the warm start's adapters are merged into the weights it saves, and every run trains fresh adapters on
    that merged model: the runs continue from the same weights, as in the paper's protocol."""
    directory = os.path.join(root, "warm_start")
    model_dir, done = os.path.join(directory, "model"), os.path.join(directory, "warm_start.json")
    if os.path.isfile(done):
        logger.warning(f"Warm start found in {model_dir}; loading it.")
        return _load_start(model_dir, student), _read_json(done)
    trainer_dir = os.path.join(directory, "trainer")
    save_steps = ablate.warm_start_save_steps
    warm_args = replace(
        args, output_dir=trainer_dir, max_steps=ablate.warm_start_steps, rock_policy="uniform", rock_policy_kwargs={},
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, save_total_limit=1,
        logging_steps=1, push_to_hub=False,
    )
    resume = get_last_checkpoint(trainer_dir) if os.path.isdir(trainer_dir) else None
    logger.warning(f"Warm start: {ablate.warm_start_steps} steps of uniform OPD" + (f", resuming {resume}" if resume else ""))
    started = time.perf_counter()
    trainer, meter = train_copy(student, teacher, tokenizer, prompts, warm_args, resume=resume, peft_config=peft_config)
    model = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    tmp = f"{model_dir}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp, model_dir)
    info = {
        "steps": ablate.warm_start_steps,
        "seed": args.seed,
        "resumed_from": resume,
        "train_seconds": round(time.perf_counter() - started, 2),
        "compute": meter.to_dict(),
        "log_history": trainer.state.log_history,
    }
    _write_json(done, info)
    shutil.rmtree(trainer_dir, ignore_errors=True)  # optimizer checkpoints are only needed until the model is saved
    del trainer, model
    gc.collect()
    # The runs start from the saved copy, never from the trained object: TRL's trainer replaced that object's
    # `forward` with a closure over the object itself, so a deep copy of it would generate (and be evaluated) with the
    # warm start's weights whatever the copy learns. Reloading also makes a first invocation and a resumed one start
    # from the very same weights.
    return _load_start(model_dir, student), info


def _load_start(model_dir: str, student: torch.nn.Module) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=student.dtype)


# ------------------------------------------------------------------------------------------------- rocks ----
def _find_rocks(start, teacher, tokenizer, prompts, ablate: AblateArguments, args: RockOPDConfig, root: str):
    """The lab's `collect` + `score` on the start weights: `rocks/rock_set.json` and `rocks/reference_counts.json`."""
    directory = os.path.join(root, "rocks")
    rock_path, counts_path = _rock_paths(root)
    if os.path.isfile(rock_path) and os.path.isfile(counts_path):
        return rock_path, counts_path
    table_dir = os.path.join(directory, "table")
    chats = [[row[0]] for row in prompts["messages"][: ablate.rock_num_prompts]]  # the user turn of each prompt
    collect_token_table(
        start.to(_device_of(teacher)), teacher, tokenizer, chats, table_dir,
        max_new_tokens=ablate.rock_max_new_tokens or args.max_new_tokens, batch_size=ablate.eval_batch_size,
        do_sample=True, seed=args.seed, beta=args.beta, temperature=args.temperature, show_progress=False,
        gradient_cosine=False,
    )
    table = load_token_table(table_dir)
    counts = table.counts()
    if ablate.rock_set is None:
        options = {"min_count": ablate.rock_min_count, "exclude_top_frequent": ablate.rock_exclude_top_frequent}
        try:
            scored = score_token_table(table, top_k=ablate.rock_top_k, **options)
        except ValueError:
            # Fewer eligible types than rock_top_k (short rollouts, small vocabularies): take every eligible one.
            eligible = score_token_table(table, top_k=1, **options).settings["eligible_types"]
            logger.warning(f"Only {eligible} eligible token types for rock_top_k={ablate.rock_top_k}; taking all.")
            scored = score_token_table(table, top_k=eligible, **options)
        tmp = f"{rock_path}.tmp.json"
        scored.save(tmp)
        os.replace(tmp, rock_path)
    else:
        shutil.copyfile(ablate.rock_set, rock_path)
    _write_json(counts_path, {"counts": {str(i): int(counts[i]) for i in counts.nonzero()[0]}})
    return rock_path, counts_path


def _rock_paths(root: str) -> tuple[str, str]:
    return os.path.join(root, "rocks", "rock_set.json"), os.path.join(root, "rocks", "reference_counts.json")


# -------------------------------------------------------------------------------------------- the policies ----
def policy_settings(
    policy: str, ablate: AblateArguments, args: RockOPDConfig, seed: int, rocks: tuple[str, str] | None
) -> dict[str, Any]:
    """The trainer's `rock_policy`, `rock_policy_kwargs` and `rock_normalization` for one ablation policy and seed.

    Built-in options first, then `policy_kwargs[policy]` over them. `rock_online` finds rocks within the run, so its
    warm-up and refresh are scaled to the budget (a quarter and an eighth of `max_steps`) unless given.

    Example:
    ```python
    >>> from hf_rockopd import RockOPDConfig
    >>> from hf_rockopd.ablate.arguments import AblateArguments
    >>> from hf_rockopd.ablate.runner import policy_settings
    >>> args = RockOPDConfig(output_dir="out", max_steps=8, report_to="none")
    >>> policy_settings("soft", AblateArguments(), args, 0, ("rocks.json", "counts.json"))
    {'rock_policy': 'rock_freeze', 'rock_policy_kwargs': {'token_ids': 'rocks.json', 'weight': 0.3}, 'rock_normalization': 'tokens'}
    ```
    """
    rock_set, counts = rocks or (None, None)
    normalization = args.rock_normalization
    if policy in ("rock_freeze", "soft"):
        name, kwargs = "rock_freeze", {"token_ids": rock_set, "weight": ablate.soft_weight if policy == "soft" else 0.0}
        normalization = "tokens" if policy == "soft" else normalization
    elif policy == "random_matched":
        name, kwargs = policy, {"rock_set": rock_set, "reference_counts": counts, "seed": seed}
    elif policy == "rock_online":
        steps = args.max_steps
        name, kwargs = policy, {
            "warmup_steps": max(1, steps // 4), "refresh_every": max(1, steps // 8), "persistence": 2,
            "top_k": ablate.rock_top_k, "min_count": ablate.rock_min_count,
            "exclude_top_frequent": ablate.rock_exclude_top_frequent,
        }
    else:
        name, kwargs = policy, {}
    kwargs.update(ablate.parsed_policy_kwargs().get(policy, {}))
    return {"rock_policy": name, "rock_policy_kwargs": kwargs, "rock_normalization": normalization}


# ----------------------------------------------------------------------------------------------- evaluation ----
def _evaluate(model, teacher, tokenizer, problems, reference, ablate, args: RockOPDConfig, rock_set) -> dict:
    """Held-out evaluation with per-problem outcomes: correct, on-policy and teacher-forced divergence, loop and
    finished flags. `reference` is the teacher's completions of the problems, made once for every run."""
    started = time.perf_counter()
    model = model.to(_device_of(teacher))
    result = evaluate_gsm8k(
        model, tokenizer, problems, teacher=teacher, teacher_reference=reference, rock_ids=rock_set,
        max_new_tokens=ablate.eval_max_new_tokens, batch_size=ablate.eval_batch_size, beta=args.beta,
        temperature=args.loss_temperature, show_progress=False, verifier=ablate.verifier,
    )
    stop_ids, numeric = eos_token_ids(tokenizer, model), numeric_token_ids(tokenizer)
    lengths = [r["num_tokens"] for r in result.records]
    completions = [ids.tolist() for ids in torch.split(result.token_ids, lengths)] if lengths else []
    outcomes = []
    for index, (record, ids) in enumerate(zip(result.records, completions)):
        outcomes.append({
            "index": index,
            "correct": bool(record["correct"]),
            "on_policy_divergence": record.get("mean_divergence"),
            "teacher_forced_divergence": _teacher_forced(record),
            **problem_quality(ids, stop_ids, ablate.eval_max_new_tokens, numeric),
            "num_tokens": record["num_tokens"],
            "prediction": record["prediction"],
            "completion": record["completion"],
        })
    metrics = {
        **run_quality(completions, stop_ids, ablate.eval_max_new_tokens, [o["correct"] for o in outcomes], numeric),
        "on_policy_divergence": result.mean_divergence,
        "on_policy_divergence_non_rock": result.mean_divergence_non_rock,
        "teacher_forced_divergence": _teacher_forced(result),
        "top1_agreement": result.top1_agreement,
        "clipped_ratio": result.clipped_ratio,
        "eval_seconds": round(time.perf_counter() - started, 3),
    }
    return {"metrics": metrics, "problems": outcomes}


def _teacher_forced(source: Any) -> float | None:
    """The teacher-forced divergence on the teacher's own completions, as the evaluation returns it: `EvalResult`'s
    at run level, its records' per problem (None where the evaluation had no teacher reference)."""
    value = source.get("teacher_forced_divergence") if isinstance(source, dict) else getattr(
        source, "teacher_forced_divergence", None
    )
    return None if value is None else float(value)


# ----------------------------------------------------------------------------------------------- the runs ----
def _check_settings(root: str, ablate: AblateArguments, args: RockOPDConfig, command: str, peft_config) -> None:
    """Record the settings; refuse a directory whose finished runs were made with other budget settings."""
    path = os.path.join(root, SETTINGS_NAME)
    settings = {"ablate": ablate.fingerprint(), "training": {**training_fingerprint(args), "lora": _lora(peft_config)}}
    if os.path.isfile(path):
        saved = _read_json(path)
        changed = [
            f"{group}.{key}: {saved.get(group, {}).get(key)!r} -> {value!r}"
            for group in ("ablate", "training")
            for key, value in json.loads(json.dumps(settings[group], default=str)).items()
            if saved.get(group, {}).get(key) != value
        ]
        if changed:
            raise ValueError(
                f"{root} holds an ablation made with other settings ({'; '.join(changed)}). Its finished runs would "
                "be skipped and compared with new ones: use another --output_dir, or the same settings to resume."
            )
        policies = list(dict.fromkeys([*saved.get("policies", []), *ablate.policies]))
        seeds = list(dict.fromkeys([*saved.get("seeds", []), *ablate.seeds]))
    else:
        policies, seeds = ablate.policies, ablate.seeds
    _write_json(path, {**settings, "policies": policies, "seeds": seeds, "command": command})


def _run_one(policy, seed, start, teacher, tokenizer, train, problems, reference, ablate, args, rocks,
             peft_config=None) -> dict:
    started = time.perf_counter()
    directory = run_directory(args.output_dir, policy, seed)
    settings = policy_settings(policy, ablate, args, seed, rocks)
    run_args = replace(
        args, output_dir=directory, seed=seed, data_seed=seed, save_strategy="no", logging_steps=1, push_to_hub=False,
        **settings,
    )
    trainer, meter = train_copy(start, teacher, tokenizer, train, run_args, peft_config=peft_config)
    train_seconds = time.perf_counter() - started
    model = trainer.accelerator.unwrap_model(trainer.model)
    evaluation = _evaluate(model, teacher, tokenizer, problems, reference, ablate, args, rocks[0] if rocks else None)
    result = {
        "format": RESULT_FORMAT,
        "policy": policy,
        "seed": seed,
        "protocol": ablate.protocol,
        "trainer_policy": settings,
        "lora": _lora(peft_config),  # train_copy hands the trainer a copy, so this is still the given config
        "rock_ids": trainer.rock_policy.rock_ids() or [],
        "metrics": {
            **evaluation["metrics"],
            **meter.to_dict(),
            "train_seconds": round(train_seconds, 3),
            "total_seconds": round(time.perf_counter() - started, 3),
        },
        "problems": evaluation["problems"],
        "log_history": trainer.state.log_history,
    }
    _write_json(os.path.join(directory, RESULT_NAME), result)  # last: the run is done
    del trainer, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _lora(peft_config) -> dict[str, Any] | None:
    """The LoRA settings of every run (None: full fine-tuning), as `ablation.json` and each result record them."""
    if peft_config is None:
        return None
    targets = peft_config.target_modules
    return {"r": peft_config.r, "alpha": peft_config.lora_alpha, "dropout": peft_config.lora_dropout,
            "target_modules": targets if isinstance(targets, str) else sorted(targets)}


def run_ablation(
    ablate: AblateArguments,
    args: RockOPDConfig,
    command: str | None = None,
    model_args: StudentModelConfig | None = None,
) -> dict[str, Any]:
    """Run every (policy, seed) not finished yet, then write the summary; returns `{"trained": [...], "summary"}`.

    `model_args` (TRL's `ModelConfig` fields) gives each run fresh LoRA adapters (`use_peft`); every run trains the
    full student otherwise. 4-bit and 8-bit students are refused: each run starts from a copy of full-precision
    weights.

    Example:
    ```python
    from hf_rockopd import RockOPDConfig
    from hf_rockopd.ablate.arguments import AblateArguments
    from hf_rockopd.ablate.runner import run_ablation

    ablate = AblateArguments(teacher="Qwen/Qwen2.5-Coder-1.5B-Instruct", student="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                             dataset="gsm8k.jsonl", policies=["uniform", "rock_freeze"], seeds=[0, 1])
    out = run_ablation(ablate, RockOPDConfig(output_dir="runs/ablate", max_steps=20, report_to="none"))
    ```
    """
    from .summary import write_summary

    root = args.output_dir
    command = command or "run_ablation(...)"
    # Every input is checked before a model is loaded or a directory made: a typo costs seconds, not a teacher load.
    check_training_budget(args)
    model_args = student_model_config(model_args)
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise ValueError(
            "ablate trains full-precision students (full fine-tuning, or LoRA with --use_peft); load_in_4bit / "
            "load_in_8bit are options of hf-rockopd distill only. Drop them, and add --use_peft to train adapters."
        )
    peft_config = get_peft_config(model_args)
    if ablate.rock_set is not None:
        load_rock_set(ablate.rock_set)
    data = split_dataset(
        ablate.dataset, ablate.num_train_prompts, ablate.num_eval_problems, seed=ablate.split_seed,
        config=ablate.dataset_config, split=ablate.dataset_split, prompt_column=ablate.prompt_column,
        answer_column=ablate.answer_column, system_prompt=ablate.system_prompt, eval_dataset=ablate.eval_dataset,
        eval_config=ablate.eval_dataset_config, eval_split=ablate.eval_dataset_split,
    )
    train, problems = data.train, data.problems
    for index, (_, reference) in enumerate(problems):  # an unreadable reference fails before the teacher loads
        try:
            reference_answer("" if reference is None else reference, ablate.verifier)
        except ValueError as err:
            raise ValueError(f"Held-out problem {index} of {data.eval_location!r}: {err} (--answer_column names "
                             "the reference column)") from None
    # Every policy's options are checked now, with the paths its rock set will have (the options check types and
    # ranges, not files), so a bad --policy_kwargs value fails before the teacher loads.
    rocks_to_be = _rock_paths(root) if ablate.needs_rocks() else None
    for policy in ablate.policies:
        replace(args, **policy_settings(policy, ablate, args, 0, rocks_to_be))
    # Seed by seed; the policy order rotates with the seed, so no policy is always the first run of a process (which
    # pays for warm-up) or always the one running beside the same background load.
    order = [
        (policy, seed) for k, seed in enumerate(ablate.seeds)
        for policy in ablate.policies[k % len(ablate.policies):] + ablate.policies[: k % len(ablate.policies)]
    ]
    pending = [(p, s) for p, s in order if not os.path.isfile(os.path.join(run_directory(root, p, s), RESULT_NAME))]
    os.makedirs(root, exist_ok=True)
    _check_settings(root, ablate, args, command, peft_config)
    trained = []
    if pending:
        teacher, student, tokenizer = _load_models(ablate)
        if packing_applies(args):
            pack_for_inference(teacher)  # forward only: oneDNN-packed linears on CPU (benchmarks/decode.py)
        start = student
        if ablate.protocol == "warm_start":
            start, _ = _warm_start(student, teacher, tokenizer, train, ablate, args, root, peft_config)
        del student  # the runs copy `start`: a second full copy of the student would only take memory
        gc.collect()
        rocks = _find_rocks(start, teacher, tokenizer, train, ablate, args, root) if ablate.needs_rocks() else None
        # The teacher's completions of the held-out problems, generated once and cached: every run is scored on them.
        reference = load_or_build_teacher_reference(
            os.path.join(root, "teacher_reference.json"), teacher, tokenizer, problems, teacher_name=ablate.teacher,
            max_new_tokens=ablate.eval_max_new_tokens, batch_size=ablate.eval_batch_size,
        )
        start_eval = os.path.join(root, "start_eval.json")
        if not os.path.isfile(start_eval):
            start_result = _evaluate(start, teacher, tokenizer, problems, reference, ablate, args, rocks and rocks[0])
            _write_json(start_eval, start_result)
        runs_started = time.perf_counter()
        for index, (policy, seed) in enumerate(pending):
            eta = _eta(runs_started, index, len(pending))
            logger.warning(f"Run {index + 1}/{len(pending)}: policy {policy}, seed {seed}{eta}.")
            _run_one(
                policy, seed, start, teacher, tokenizer, train, problems, reference, ablate, args, rocks, peft_config
            )
            trained.append((policy, seed))
    summary = write_summary(root)
    return {"trained": trained, "summary": summary}


def _eta(started: float, done: int, total: int) -> str:
    """`; about 12 min left` from the mean time of the runs done so far (nothing before the first ends)."""
    if done == 0:
        return ""
    left = (time.perf_counter() - started) / done * (total - done)
    return f"; {done} done, about {left / 60:.0f} min left" if left >= 60 else f"; {done} done, about {left:.0f} s left"
