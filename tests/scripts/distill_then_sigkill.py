"""Run `hf-rockopd distill` on tiny saved models (LoRA student, rock_online, checkpoints every 2 of 6 steps, a slice
evaluated at each checkpoint), optionally SIGKILLing itself somewhere in the middle.

    python tests/scripts/distill_then_sigkill.py WORK_DIR OUTPUT_DIR none        # the whole run
    python tests/scripts/distill_then_sigkill.py WORK_DIR OUTPUT_DIR train       # killed right after checkpoint-2 is
                                                                                 # saved, before its evaluation
    python tests/scripts/distill_then_sigkill.py WORK_DIR OUTPUT_DIR last_checkpoint  # killed right after the last
                                                                                 # checkpoint (6) is saved
    python tests/scripts/distill_then_sigkill.py WORK_DIR OUTPUT_DIR eval_after  # killed after the first generation
                                                                                 # batch of the final evaluation

WORK_DIR holds the tiny teacher and data (made by the test); the evaluation cache is WORK_DIR/shared, so several
runs share the teacher's reference and the base student's evaluation. The same command with `none` resumes a killed
run: that is what a user types again. Options after KILL are passed on to `hf-rockopd distill`, after (and so over)
the script's own.
"""

import os
import signal
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from transformers import TrainerCallback  # noqa: E402

from hf_rockopd.cli import main as cli_main  # noqa: E402
from hf_rockopd.distill import run as distill_run  # noqa: E402
from hf_rockopd.evaluation import journal as journal_module  # noqa: E402


class SigkillOnSave(TrainerCallback):
    """Dies the hard way right after the trainer saved checkpoint-`step` (before the checkpoint's evaluation runs)."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(work_dir: str, output_dir: str, kill: str, *extra: str) -> int:
    if kill in ("train", "last_checkpoint"):
        build = distill_run.build_trainer

        def build_and_arm(*args, **kwargs):
            trainer = build(*args, **kwargs)
            trainer.add_callback(SigkillOnSave(2 if kill == "train" else 6))
            return trainer

        distill_run.build_trainer = build_and_arm
    elif kill == "eval_after":
        record = journal_module.GenerationJournal.record

        def record_then_die(self, *args, **kwargs):
            record(self, *args, **kwargs)
            if os.path.basename(self.path).startswith("eval_after"):
                os.kill(os.getpid(), signal.SIGKILL)

        journal_module.GenerationJournal.record = record_then_die
    # 16 prompts, 8 steps an epoch: the 6 steps end inside an epoch, as the real-budget run's 200 do (its resume from
    # the last checkpoint trained a 201st step; resuming at an epoch's end never did).
    return cli_main([
        "distill", "--teacher", os.path.join(work_dir, "teacher"), "--student_num_layers", "2",
        "--dataset", os.path.join(work_dir, "problems.jsonl"), "--num_train_prompts", "16",
        "--num_eval_problems", "4", "--num_validation_problems", "2", "--eval_max_new_tokens", "6",
        "--eval_batch_size", "2", "--eval_cache_dir", os.path.join(work_dir, "shared"),
        "--checkpoint_eval_problems", "2", "--max_steps", "6", "--per_device_train_batch_size", "2",
        "--max_new_tokens", "6", "--learning_rate", "1e-2", "--save_strategy", "steps", "--save_steps", "2",
        "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--seed", "0", "--output_dir", output_dir,
        "--rock_policy", "rock_online", "--rock_policy_kwargs",
        '{"warmup_steps": 1, "refresh_every": 1, "persistence": 1, "top_k": 5, "min_count": 1}',
        *extra,  # options after KILL override these (argparse keeps an option's last value)
    ])


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
