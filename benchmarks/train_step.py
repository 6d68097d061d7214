"""Training-step benchmark: `RockOPDTrainer` against TRL's `GKDTrainer`, and `RockDistillationTrainer` against TRL's
`DistillationTrainer`, at identical settings, phase by phase.

Every trainer gets the same student and teacher (fresh copies), the same GSM8K prompts, seed, batch size,
`max_new_tokens` (`max_completion_length`), `beta` and `lmbda=1` (always on-policy), HF generation, and runs
`--steps` optimizer steps in a fresh process each. Phases are timed from outside TRL, without editing it:

- generation: a wrapper around `generate_on_policy_outputs` (the GKD pair) or `_generate_single_turn` (the
  Distillation pair);
- loss (forward of both models and the divergence): a wrapper around `compute_loss`;
- backward: a wrapper around `accelerator.backward`;
- optimizer: between the `on_pre_optimizer_step` and `on_optimizer_step` callbacks;
- total step: between `on_step_begin` and `on_step_end`; peak memory: RSS high-water mark over the step minus the
  RSS at its start (`benchmarks.memory`).

The first step is a warm-up and is not reported; medians over the others are.

`rockopd_half` and `rockdistillation_half` are our trainers with half of each batch's completion positions frozen
(`benchmarks.half_frozen.HalfFrozenPolicy`: weight 0, known before projection, so those rows are never projected),
timed against the same TRL anchor as the uniform rows. The targets: loss+backward <= 1.0x the anchor's with uniform
weights and <= 0.6x with half frozen, and a total step at most 5 % slower. Every ratio is printed at the end of the run
and written to the JSON file.

Run: `python -m benchmarks.train_step --pair tiny` (or `--pair smollm2`, the real SmolLM2-135M-Instruct teacher and a
pruned student); `--trainers distillation rockdistillation rockdistillation_half` runs one pair only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

__all__ = ["PAIRS", "run_trainer"]

GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k", "train.jsonl")
PAIRS = ("tiny", "smollm2")
TRAINERS = ("gkd", "rockopd", "rockopd_half", "distillation", "rockdistillation", "rockdistillation_half")
# Ours over its TRL anchor; each pair of the results file's ratios, under this key.
BASES = {
    "rockopd": "gkd",
    "rockopd_half": "gkd",
    "rockdistillation": "distillation",
    "rockdistillation_half": "distillation",
}
RATIO_KEYS = {
    "rockopd": "ratios",
    "rockopd_half": "ratios_half",
    "rockdistillation": "ratios_distillation",
    "rockdistillation_half": "ratios_distillation_half",
}


def _prompts(n: int):
    from datasets import Dataset

    if not os.path.isfile(GSM8K):
        raise FileNotFoundError(f"GSM8K training split not found at {os.path.abspath(GSM8K)}; the benchmark needs it.")
    with open(GSM8K) as f:
        rows = [json.loads(line) for _, line in zip(range(n), f)]
    return Dataset.from_list(
        [
            {"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]}
            for r in rows
        ]
    )


def _models(pair: str):
    from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer, prune_decoder_layers

    if pair == "tiny":
        tokenizer = build_tiny_tokenizer()
        teacher = build_tiny_causal_lm(tokenizer, hidden_size=64, num_hidden_layers=4, seed=1)
        return teacher, prune_decoder_layers(teacher, keep=[0, 3]), tokenizer
    if pair == "smollm2":
        from hf_rockopd.models import load_gguf_causal_lm, smollm2_gguf_path

        teacher, tokenizer = load_gguf_causal_lm(smollm2_gguf_path())
        # The lab's student: the teacher without layer 20 (29 of 30 layers).
        keep = [i for i in range(teacher.config.num_hidden_layers) if i != 20]
        return teacher, prune_decoder_layers(teacher, keep=keep), tokenizer
    raise ValueError(f"Unknown pair {pair!r}; choose from {PAIRS}.")


class _PhaseTimer:
    """Wraps the trainer's phases and collects per-step timings and peak memory."""

    def __init__(self, trainer, cuda: bool = False) -> None:
        from transformers import TrainerCallback

        from benchmarks.memory import peak_since_reset, reset_peak

        self.steps: list[dict] = []
        self._current: dict = {}
        timer = self
        # On CUDA the kernels of a phase are queued, not run, when its Python call returns: wait for them so each is
        # timed whole. Memory is the caching allocator's peak over the step above what was allocated at its start.
        device = "cuda" if cuda else "cpu"
        sync = torch.cuda.synchronize if cuda else (lambda: None)

        def timed(name, fn):
            def wrapper(*args, **kwargs):
                sync()
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                sync()
                timer._current[name] = timer._current.get(name, 0.0) + time.perf_counter() - start
                if name == "generation_s":
                    # GKD: (ids, mask, labels); Distillation: one list of completion ids per prompt.
                    tokens = int((out[2][:, 1:] != -100).sum()) if isinstance(out, tuple) else sum(map(len, out))
                    timer._current["completion_tokens"] = timer._current.get("completion_tokens", 0) + tokens
                return out

            return wrapper

        if hasattr(trainer, "generate_on_policy_outputs"):
            trainer.generate_on_policy_outputs = timed("generation_s", trainer.generate_on_policy_outputs)
        else:
            trainer._generate_single_turn = timed("generation_s", trainer._generate_single_turn)
        trainer.compute_loss = timed("loss_forward_s", trainer.compute_loss)
        trainer.accelerator.backward = timed("backward_s", trainer.accelerator.backward)

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer._current = {"baseline": reset_peak(device), "start": time.perf_counter()}

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                sync()
                timer._current["opt_start"] = time.perf_counter()

            def on_optimizer_step(self, args, state, control, **kwargs):
                sync()
                timer._current["optimizer_s"] = time.perf_counter() - timer._current.pop("opt_start")

            def on_step_end(self, args, state, control, **kwargs):
                cur = timer._current
                sync()
                cur["total_s"] = time.perf_counter() - cur.pop("start")
                top = peak_since_reset(device)
                cur["peak_bytes"] = top - cur["baseline"]
                if cuda:
                    cur["peak_allocated_bytes"] = top  # everything on the device: both models, optimizer state
                del cur["baseline"]
                cur["loss_backward_s"] = cur.get("loss_forward_s", 0.0) + cur.get("backward_s", 0.0)
                cur["completion_tokens_per_s"] = cur.get("completion_tokens", 0) / cur["total_s"]
                timer.steps.append(cur)

        trainer.add_callback(Callback())


def run_trainer(trainer_name: str, pair: str, steps: int, batch: int, max_new_tokens: int, seed: int) -> dict:
    """Train `steps` steps with `trainer_name` (one of `TRAINERS`) in this process; per-step phase timings."""
    teacher, student, tokenizer = _models(pair)
    return train_steps(
        trainer_name, student, teacher, tokenizer, _prompts(batch * steps), steps, batch, max_new_tokens, seed,
        output_dir=os.path.join("outputs", "bench_train_step", f"{pair}_{trainer_name}"),
    )  # fmt: skip


def train_steps(
    trainer_name: str,
    student,
    teacher,
    tokenizer,
    data,
    steps: int,
    batch: int,
    max_new_tokens: int,
    seed: int,
    output_dir: str,
    cuda: bool = False,
    beta: float = 1.0,
) -> dict:
    """Train `student` (a model or a PEFT model) `steps` steps under `teacher` with `trainer_name` (one of
    `TRAINERS`) at the benchmark's settings (`beta`: the divergence's, 1 = reverse KL); per-step phase timings, and
    whether any trainable weight changed (a LoRA adapter cut off from its gradient would leave them all equal and time
    a step that learns nothing)."""
    import transformers

    common = dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch,
        max_new_tokens=max_new_tokens,
        learning_rate=1e-5,
        beta=beta,
        lmbda=1.0,
        temperature=1.0,
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not cuda,
        bf16=cuda,
    )
    transformers.set_seed(seed)
    # The `_half` rows: the same trainer with half of the completion positions frozen (the policy object overrides
    # the config's `rock_policy`).
    policy = None
    if trainer_name.endswith("_half"):
        from benchmarks.half_frozen import HalfFrozenPolicy

        policy = HalfFrozenPolicy()
    if trainer_name in ("rockopd", "rockopd_half"):
        from hf_rockopd import RockOPDConfig, RockOPDTrainer

        trainer = RockOPDTrainer(
            model=student, teacher_model=teacher, args=RockOPDConfig(**common, rock_policy="uniform"),
            train_dataset=data, processing_class=tokenizer, rock_policy=policy,
        )
    elif trainer_name == "gkd":
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        from hf_rockopd.trainers.data import OnPolicyChatMLCollator

        # The same prompt tokenization as ours (GKDTrainer's default collator needs a chat template the tiny
        # tokenizer lacks); the prompts and the generation are then identical.
        gkd_args = GKDConfig(**common)
        collator = OnPolicyChatMLCollator(tokenizer=tokenizer, max_length=gkd_args.max_length)
        trainer = GKDTrainer(
            model=student, teacher_model=teacher, args=gkd_args,
            train_dataset=data, processing_class=tokenizer, data_collator=collator,
        )
    elif trainer_name in ("distillation", "rockdistillation", "rockdistillation_half"):
        from trl import DistillationConfig, DistillationTrainer

        from hf_rockopd import RockDistillationConfig, RockDistillationTrainer
        from hf_rockopd.distill.trainer_choice import prompts_only

        settings = {k: v for k, v in common.items() if k not in ("lmbda", "max_new_tokens")}
        settings["max_completion_length"] = max_new_tokens
        if trainer_name == "distillation":
            trainer_class, config = DistillationTrainer, DistillationConfig(**settings)
        else:
            trainer_class, config = RockDistillationTrainer, RockDistillationConfig(**settings, rock_policy="uniform")
        ours = {} if trainer_name == "distillation" else {"rock_policy": policy}
        trainer = trainer_class(
            model=student, teacher_model=teacher, args=config, train_dataset=prompts_only(data),
            processing_class=tokenizer, **ours,
        )  # fmt: skip
    else:
        raise ValueError(f"trainer_name must be one of {', '.join(TRAINERS)}, got {trainer_name!r}.")
    trainable = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    if not trainable:
        raise RuntimeError(f"The {trainer_name} student has no trainable parameter.")
    before = {n: p.detach().float().clone() for n, p in trainable[:: max(1, len(trainable) // 8)]}
    timer = _PhaseTimer(trainer, cuda=cuda)
    trainer.train()
    after = dict(trainer.model.named_parameters())
    changed = sum(not torch.equal(before[n], after[n].detach().float()) for n in before)
    # Our trainers log the share of completion positions with weight 0: 0 for uniform, one half for the `_half` rows.
    frozen = [e["rock/frozen_fraction"] for e in trainer.state.log_history if "rock/frozen_fraction" in e]
    return {"steps": timer.steps, "trainable_params": sum(p.numel() for _, p in trainable),
            "sampled_tensors_changed": f"{changed}/{len(before)}",
            "frozen_fraction": statistics.mean(frozen) if frozen else None}  # fmt: skip


def _summarize(steps: list[dict]) -> dict:
    measured = steps[1:] if len(steps) > 1 else steps
    keys = ("generation_s", "loss_forward_s", "backward_s", "loss_backward_s", "optimizer_s", "total_s",
            "peak_bytes", "completion_tokens", "completion_tokens_per_s")  # fmt: skip
    return {k: statistics.median(s.get(k, 0.0) for s in measured) for k in keys}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=PAIRS, default="tiny")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per trainer (the first is a warm-up)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    parser.add_argument("--out", default=None, help="JSON file (default benchmarks/results/train_step_<pair>.json)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the first step is a warm-up), got {args.steps}.")
    if args.worker:
        out = run_trainer(args.worker, args.pair, args.steps, args.batch, args.max_new_tokens, args.seed)
        print(json.dumps(out))
        return 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = {}
    for name in args.trainers:
        cmd = [sys.executable, "-m", "benchmarks.train_step", "--worker", name, "--pair", args.pair,
               "--steps", str(args.steps), "--batch", str(args.batch), "--max-new-tokens", str(args.max_new_tokens),
               "--seed", str(args.seed)]  # fmt: skip
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} run failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
        worker = json.loads(proc.stdout.strip().splitlines()[-1])
        steps = worker["steps"]
        results[name] = {"steps": steps, "median": _summarize(steps), "frozen_fraction": worker.get("frozen_fraction")}
        print(name, json.dumps(results[name]["median"]), flush=True)
    # Each of ours over its TRL anchor (see RATIO_KEYS): `ratios` is RockOPDTrainer / GKDTrainer as before,
    # `ratios_distillation` RockDistillationTrainer / DistillationTrainer, `*_half` the same with half frozen.
    for ours_name, key in RATIO_KEYS.items():
        base = BASES[ours_name]
        if ours_name in results and base in results:
            ours, theirs = results[ours_name]["median"], results[base]["median"]
            results[key] = {k: ours[k] / theirs[k] for k in ours if theirs[k]}
    from benchmarks.loss_path import cpu_description

    results["meta"] = {
        "pair": args.pair, "steps": args.steps, "batch": args.batch, "max_new_tokens": args.max_new_tokens,
        "seed": args.seed, "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_description(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python", "-m", "benchmarks.train_step", *(argv if argv is not None else sys.argv[1:])]),
    }  # fmt: skip
    out = args.out or os.path.join(root, "benchmarks", "results", f"train_step_{args.pair}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    for ours_name, key in RATIO_KEYS.items():
        if key in results:
            ratios = results[key]
            nan = float("nan")
            print(f"{key} ({ours_name} / {BASES[ours_name]}): loss+backward "
                  f"{ratios.get('loss_backward_s', nan):.3f}x, total step {ratios.get('total_s', nan):.3f}x; all:",
                  json.dumps(ratios))  # fmt: skip
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
