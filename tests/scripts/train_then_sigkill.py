"""Train RockOPDTrainer with `rock_online` on tiny models; optionally SIGKILL itself or resume a checkpoint.

    python tests/scripts/train_then_sigkill.py OUTPUT_DIR full            # 6 steps, checkpoints every 2
    python tests/scripts/train_then_sigkill.py OUTPUT_DIR kill            # the same, SIGKILLed at the end of step 3
    python tests/scripts/train_then_sigkill.py OUTPUT_DIR resume CKPT     # resume CKPT, finish the 6 steps

A finished run writes `OUTPUT_DIR/final.pt`: policy state, rock set and student weights.
"""

import os
import signal
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_rockopd import RockOPDConfig, RockOPDTrainer
from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer

KILL_AT_STEP = 3
POLICY_KWARGS = dict(top_k=6, min_count=1, exclude_top_frequent=2, warmup_steps=1, refresh_every=1, window=3,
                     persistence=1, stagnation_tol=10.0)


class SigkillAfterStep(TrainerCallback):
    """Dies the hard way (no cleanup, no save) once a step past the last checkpoint has changed the state."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == KILL_AT_STEP:
            os.kill(os.getpid(), signal.SIGKILL)


def main(output_dir: str, mode: str, checkpoint: str | None = None) -> None:
    tokenizer = build_tiny_tokenizer()
    dataset = Dataset.from_list(
        [
            {"messages": [{"role": "user", "content": f"What is {i} + {i + 1}?"},
                          {"role": "assistant", "content": f"{2 * i + 1}"}]}
            for i in range(24)
        ]
    )
    args = RockOPDConfig(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        max_steps=6,
        max_new_tokens=10,
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
    trainer = RockOPDTrainer(
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
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
