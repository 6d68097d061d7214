"""`hf-rockopd teacher-cache`: score fixed sequences with the teacher once, so later runs need no teacher for them.

Two ways to say which sequences:
- `--distill_config FILE.yaml`: the main job's held-out problems, exactly as `hf-rockopd distill` splits them from
  that config; the teacher's reference completions are generated here (the teacher is loaded once) and written where
  `distill` reads them (`<output_dir>/teacher_reference.json`), then cached. A `distill` run with the teacher served
  (`--teacher_server_url`) then needs the teacher's memory nowhere but in the server.
- `--reference teacher_reference.json`: the completions of an existing reference (from `hf-rockopd eval` or an
  earlier run), for `hf-rockopd eval --teacher_cache`.

The teacher is a local model (`--teacher`, packed for CPU inference) or a server (`--teacher_server_url`, which
cannot generate: only with `--reference`, or with `--distill_config` when the reference exists already).

```
hf-rockopd teacher-cache --distill_config examples/configs/distill_qwen.yaml --top_k 64
hf-rockopd teacher-cache --reference run/teacher_reference.json --teacher Qwen/Qwen2.5-Coder-1.5B-Instruct --top_k 64 \
    --out run/teacher_cache.parquet
```
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .parsing import Command, check_at_least


__all__ = ["COMMANDS", "TEACHER_CACHE_NAME", "TeacherCacheArguments", "teacher_cache"]

TEACHER_CACHE_NAME = "teacher_cache.parquet"


@dataclass
class TeacherCacheArguments:
    """Options of `teacher-cache`.

    Parameters:
        > Which sequences

        distill_config (`str`, *optional*): a `hf-rockopd distill` YAML config: its held-out problems' teacher
            reference (made here if missing) is cached, into its `output_dir` by default.
        reference (`str`, *optional*): a `teacher_reference.json` whose completions are cached.

        > Which teacher

        teacher (`str`, *optional*): Hub id or local path (default with `--distill_config`: the config's teacher).
        teacher_server_url (`str`, *optional*): score with a served teacher instead (vLLM or `serve-teacher`).
        top_k (`int`): log-probabilities kept per position (the trainers' `teacher_top_k`).

        > Output

        out (`str`, *optional*): the Parquet file (default with `--distill_config`: `<output_dir>/teacher_cache.parquet`).
        batch_size (`int`, *optional*, defaults to `8`): sequences scored at once.

    Example:
    ```python
    >>> from hf_rockopd.commands.teacher_cache import TeacherCacheArguments
    >>> TeacherCacheArguments(top_k=16)
    Traceback (most recent call last):
    ...
    ValueError: Give exactly one of --distill_config (a distill YAML) or --reference (a reference JSON).
    ```
    """

    top_k: int = field(metadata={"help": "Log-probabilities kept per position (the trainers' teacher_top_k)."})
    distill_config: str | None = field(
        default=None, metadata={"help": "A `hf-rockopd distill` YAML config: cache its held-out problems' reference."}
    )
    reference: str | None = field(default=None, metadata={"help": "A teacher_reference.json to cache."})
    teacher: str | None = field(
        default=None, metadata={"help": "Hub id or local path of the teacher (default: the distill config's)."}
    )
    teacher_server_url: str | None = field(default=None, metadata={"help": "Score with a served teacher instead."})
    out: str | None = field(default=None, metadata={"help": "The cache file (Parquet)."})
    batch_size: int = field(default=8, metadata={"help": "Sequences scored at once."})

    def __post_init__(self):
        check_at_least(self, "top_k", "batch_size")
        if (self.distill_config is None) == (self.reference is None):
            raise ValueError("Give exactly one of --distill_config (a distill YAML) or --reference (a reference JSON).")
        for name in ("distill_config", "reference"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"--{name} {path!r} does not exist.")
        if self.teacher is not None and self.teacher_server_url is not None:
            raise ValueError("Give --teacher (a local model) or --teacher_server_url (a server), not both.")
        if self.reference is not None:
            if self.teacher is None and self.teacher_server_url is None:
                raise ValueError("--reference needs --teacher or --teacher_server_url: who scores the completions.")
            if self.out is None:
                raise ValueError("--reference needs --out: where to write the cache (a .parquet file).")


def teacher_cache(args: TeacherCacheArguments) -> int:
    """Run `teacher-cache`: the sequences, their teacher (local or served), the cache file."""
    from ..evaluation.teacher_reference import TeacherReference, model_fingerprint
    from ..teachers import CacheSettings, ModelTopKTeacher, ServedTeacher, TeacherCache, TeacherClient

    script = train_args = reference = None
    if args.distill_config is not None:
        from ..distill import load_distill_data
        from ..distill.evaluation import distill_teacher_reference, evaluation_dir
        from ..evaluation.teacher_reference import TEACHER_REFERENCE_NAME

        script, train_args = _distill_settings(args.distill_config)
        data = load_distill_data(script, seed=train_args.seed)  # the held-out problems distill will draw
        if not data.problems:
            raise ValueError(f"{args.distill_config!r} holds out no problems (num_eval_problems=0): nothing to cache.")
        reference_path = os.path.join(evaluation_dir(script, train_args), TEACHER_REFERENCE_NAME)
        if args.teacher_server_url is not None and not os.path.isfile(reference_path):
            raise ValueError(
                f"A served teacher cannot generate the reference completions, and {reference_path!r} does not exist: "
                "run this once with the teacher loaded (--teacher, or the config's teacher by default)."
            )
        out = args.out or os.path.join(train_args.output_dir, TEACHER_CACHE_NAME)
        if _already_cached(out, reference_path, script.teacher, args.top_k):
            print(f"{out} already holds the top-{args.top_k} of every completion of {reference_path}; nothing to do.")
            return 0
    else:
        reference = TeacherReference.load(args.reference)
        out = args.out

    fingerprint = None
    if args.teacher_server_url is not None:
        client = TeacherClient(args.teacher_server_url)
        client.health()
        name, source = client.model, ServedTeacher(client, args.top_k)
        if reference is None:
            reference = TeacherReference.load(reference_path)
        vocab = None  # the server's vocabulary size is not in vLLM's API; the cached ids are checked instead
    else:
        from ..models import pack_for_inference, resolve_causal_lm

        name = args.teacher or script.teacher
        resolved = resolve_causal_lm(name)
        pack_for_inference(resolved.model, skip=())
        if reference is None:
            os.makedirs(evaluation_dir(script, train_args), exist_ok=True)
            reference = distill_teacher_reference(resolved.model, resolved.tokenizer, data.problems, script, train_args)
        source, fingerprint = ModelTopKTeacher(resolved.model, args.top_k), model_fingerprint(resolved.model)
        vocab = resolved.model.config.vocab_size
    sequences = [list(p) + list(c) for p, c in zip(reference.prompt_ids, reference.completion_ids)]
    settings = CacheSettings(teacher=name, top_k=args.top_k, vocab_size=vocab, teacher_fingerprint=fingerprint)
    cache = TeacherCache.build(source, sequences, settings, out, batch_size=args.batch_size, show_progress=True)
    size = os.path.getsize(out)
    print(f"cached top-{args.top_k} of {name} for {len(cache)} sequences ({sum(map(len, sequences))} tokens): "
          f"{out} ({size / 1e6:.1f} MB)")
    return 0


def _distill_settings(path: str):
    """The `DistillArguments` and `RockOPDConfig` of a distill YAML, without its teacher-outside fields: the held-out
    problems do not depend on where the teacher lives, and its `teacher_cache` is what this command makes."""
    import tempfile

    import yaml

    from .distill import parse_arguments

    with open(path, encoding="utf-8") as f:
        values = yaml.safe_load(f) or {}
    for key in ("teacher_server_url", "teacher_top_k", "teacher_cache"):
        values.pop(key, None)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(values, f)
    try:
        script, train_args, _ = parse_arguments(["--config", f.name])
    finally:
        os.unlink(f.name)
    return script, train_args


def _already_cached(out: str, reference_path: str, teacher: str, top_k: int) -> bool:
    """Whether `out` holds this teacher's top-k of every completion of the reference at `reference_path` (a rerun of
    `make distill-served` then loads no teacher)."""
    from ..evaluation.teacher_reference import TeacherReference
    from ..teachers import TeacherCache

    if not (os.path.isfile(out) and os.path.isfile(reference_path)):
        return False
    reference = TeacherReference.load(reference_path)
    try:
        cache = TeacherCache.load(out, top_k=top_k)
    except ValueError:
        return False
    return reference.teacher == teacher and all(
        cache.lookup(list(p) + list(c)) is not None for p, c in zip(reference.prompt_ids, reference.completion_ids)
    )


COMMANDS = (
    Command("teacher-cache", "score fixed sequences with the teacher once (Parquet): eval and training read them back",
            (TeacherCacheArguments,), teacher_cache),
)
