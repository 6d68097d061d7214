"""Train RockOPDTrainer (or, with `distillation` as second argument, RockDistillationTrainer) with `rock_online` for a
few steps on tiny models; run under `accelerate launch`.

Each rank records every `TokenBatch` its policy sees, its policy state and rock set after each step, and whether it
wrote `rock_tokens.json`, to `<output_dir>/rank<k>.pt`. `tests/test_distributed_trainer.py` replays the recorded
batches of all ranks through one single-process policy and compares.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/train_rock_online.py OUTPUT_DIR [gkd|distillation]
"""

import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset

from hf_rockopd import RockDistillationConfig, RockDistillationTrainer, RockOPDConfig, RockOPDTrainer
from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer
from hf_rockopd.policies import RockOnlinePolicy, TokenBatch

# Refresh every step after one warm-up step, with loose thresholds so tiny models produce a non-empty rock set.
POLICY_KWARGS = dict(top_k=8, min_count=1, exclude_top_frequent=2, warmup_steps=1, refresh_every=1, window=3,
                     persistence=1, stagnation_tol=10.0)
STEPS = 4


class RecordingPolicy(RockOnlinePolicy):
    """rock_online that keeps a copy of every batch it learns from."""

    name = "rock_online"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen: list[dict] = []
        self.after_step: list[dict] = []

    def update(self, batch: TokenBatch, weights: torch.Tensor) -> None:
        fields = ("token_ids", "mask", "divergence", "scored", "student_entropy", "teacher_entropy", "logit_grad_norm")
        self.seen.append({"step": batch.step, **{f: getattr(batch, f).detach().cpu().clone() for f in fields}})
        super().update(batch, weights)
        self.after_step.append({"step": batch.step, "rock_ids": self.rock_ids()})


def recording(base: type) -> type:
    class RecordingTrainer(base):
        def write_rock_tokens(self, directory: str) -> str:
            self.rock_token_writes.append(directory)
            return super().write_rock_tokens(directory)

    return RecordingTrainer


def main(output_dir: str, kind: str = "gkd") -> None:
    tokenizer = build_tiny_tokenizer()
    student = build_tiny_causal_lm(tokenizer, seed=0)
    teacher = build_tiny_causal_lm(tokenizer, seed=1, num_hidden_layers=3)
    question = [[{"role": "user", "content": f"What is {i} + {i + 1}?"}] for i in range(16)]
    if kind == "gkd":
        dataset = Dataset.from_list(
            [{"messages": [*q, {"role": "assistant", "content": f"{2 * i + 1}"}]} for i, q in enumerate(question)]
        )
        config, trainer_class, length = RockOPDConfig, recording(RockOPDTrainer), {"max_new_tokens": 10}
    else:
        dataset = Dataset.from_list([{"prompt": q} for q in question])
        config, trainer_class = RockDistillationConfig, recording(RockDistillationTrainer)
        length = {"max_completion_length": 10}
    args = config(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        max_steps=STEPS,
        **length,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        # On a CPU-only machine the Trainer joins the gloo process group only with use_cpu.
        use_cpu=not torch.cuda.is_available(),
        rock_policy="rock_online",
        rock_policy_kwargs=POLICY_KWARGS,
    )
    policy = RecordingPolicy(**POLICY_KWARGS)
    trainer = trainer_class(
        model=student, teacher_model=teacher, args=args, train_dataset=dataset, processing_class=tokenizer,
        rock_policy=policy,
    )
    trainer.rock_token_writes = []
    trainer.train()
    rank = trainer.accelerator.process_index
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    torch.save(
        {
            "rank": rank,
            "world_size": trainer.accelerator.num_processes,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "seen": policy.seen,
            "after_step": policy.after_step,
            "state": policy.state_dict(),
            "rock_ids": policy.rock_ids(),
            "losses": losses,
            "rock_token_writes": trainer.rock_token_writes,
            "vocab_size": trainer._vocab_size,
        },
        os.path.join(output_dir, f"rank{rank}.pt"),
    )
    # Tear the gloo process group down before the interpreter exits: left to finalization, its worker threads can be
    # destroyed while running and abort the process (`terminate called without an active exception`, SIGABRT, rc 1
    # after training had finished), which failed CI once. PyTorch asks for `destroy_process_group()` at the end of
    # main: https://github.com/pytorch/pytorch/issues/190489; `end_training` does it for accelerate's state.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:])
