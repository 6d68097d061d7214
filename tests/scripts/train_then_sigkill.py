"""Train RockOPDTrainer (`--trainer distillation`: RockDistillationTrainer) with `rock_online` on tiny models;
optionally SIGKILL itself or resume a checkpoint.

    python tests/scripts/train_then_sigkill.py OUTPUT_DIR full            # 6 steps, checkpoints every 2
    python tests/scripts/train_then_sigkill.py OUTPUT_DIR kill            # the same, SIGKILLed at the end of step 3
    python tests/scripts/train_then_sigkill.py OUTPUT_DIR resume CKPT     # resume CKPT, finish the 6 steps

Every form takes `--trainer gkd|distillation` (default gkd) and `--max_steps N` (default 6) at the end. A finished
run writes `OUTPUT_DIR/final.pt`: policy state, rock set and student weights.
"""

import os
import signal
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_rockopd import RockDistillationConfig, RockDistillationTrainer, RockOPDConfig, RockOPDTrainer
from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer

KILL_AT_STEP = 3
POLICY_KWARGS = dict(top_k=6, min_count=1, exclude_top_frequent=2, warmup_steps=1, refresh_every=1, window=3,
                     persistence=1, stagnation_tol=10.0)


class SigkillAfterStep(TrainerCallback):
    """Dies the hard way (no cleanup, no save) once a step past the last checkpoint has changed the state."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == KILL_AT_STEP:
            os.kill(os.getpid(), signal.SIGKILL)


def main(output_dir: str, mode: str, checkpoint: str | None = None, kind: str = "gkd", max_steps: int = 6) -> None:
    tokenizer = build_tiny_tokenizer()
    # 32 prompts, 8 steps an epoch: the 6-step run ends inside an epoch, as a real max_steps run does (a checkpoint at
    # an epoch's end is resumed without the extra step that tests/test_sigkill_resume.py guards against).
    question = [[{"role": "user", "content": f"What is {i} + {i + 1}?"}] for i in range(32)]
    if kind == "gkd":
        dataset = Dataset.from_list(
            [{"messages": [*q, {"role": "assistant", "content": f"{2 * i + 1}"}]} for i, q in enumerate(question)]
        )
        config, trainer_class, length = RockOPDConfig, RockOPDTrainer, {"max_new_tokens": 10}
    else:
        dataset = Dataset.from_list([{"prompt": q} for q in question])
        config, trainer_class = RockDistillationConfig, RockDistillationTrainer
        length = {"max_completion_length": 10}
    args = config(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        max_steps=max_steps,
        **length,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="steps",
        save_steps=2,
        seed=0,
        disable_tqdm=True,
        rock_policy="rock_online",
        rock_policy_kwargs=POLICY_KWARGS,
    )
    trainer = trainer_class(
        model=build_tiny_causal_lm(tokenizer, seed=0),
        teacher_model=build_tiny_causal_lm(tokenizer, seed=1, num_hidden_layers=3),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[SigkillAfterStep()] if mode == "kill" else None,
    )
    trainer.train(resume_from_checkpoint=checkpoint)
    torch.save(
        {
            "policy_state": trainer.rock_policy.state_dict(),
            "rock_ids": trainer.rock_policy.rock_ids(),
            "student": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "global_step": trainer.state.global_step,
        },
        os.path.join(output_dir, "final.pt"),
    )


if __name__ == "__main__":
    argv, options = sys.argv[1:], {"--trainer": "gkd", "--max_steps": "6"}
    for flag in options:
        if flag in argv:
            at = argv.index(flag)
            options[flag] = argv[at + 1]
            del argv[at : at + 2]
    main(*argv, kind=options["--trainer"], max_steps=int(options["--max_steps"]))
