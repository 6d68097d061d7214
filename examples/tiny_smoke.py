"""Smoke run of rock-token OPD on tiny random models, offline, in well under a minute on 2 CPU cores.

It exercises the whole path (on-policy generation, online rock detection, freezing, checkpointing, rock_tokens.json)
on a tiny Llama pair. The numbers mean nothing about distillation quality; `hf-rockopd distill` runs the real
SmolLM2 default.

    python examples/tiny_smoke.py [--output-dir outputs/tiny_smoke] [--steps 6]
"""

import argparse
import json
import os


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset

from hf_rockopd import RockOPDConfig, RockOPDTrainer
from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer, prune_decoder_layers


GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k", "train.jsonl")


def prompts(n: int) -> Dataset:
    if os.path.isfile(GSM8K):
        with open(GSM8K) as f:
            rows = [json.loads(line) for _, line in zip(range(n), f)]
    else:
        rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(n)]
    return Dataset.from_list(
        [
            {"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]}
            for r in rows
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="outputs/tiny_smoke")
    parser.add_argument("--steps", type=int, default=6)
    cli = parser.parse_args()

    tokenizer = build_tiny_tokenizer()
    teacher = build_tiny_causal_lm(tokenizer, hidden_size=64, num_hidden_layers=4, seed=1)
    student = prune_decoder_layers(teacher, keep=[0, 3])
    args = RockOPDConfig(
        output_dir=cli.output_dir,
        max_steps=cli.steps,
        per_device_train_batch_size=4,
        max_new_tokens=32,
        learning_rate=5e-3,
        logging_steps=1,
        save_steps=cli.steps // 2,
        report_to="none",
        rock_policy="rock_online",
        rock_policy_kwargs={"warmup_steps": 2, "refresh_every": 1, "persistence": 2, "top_k": 10},
    )
    trainer = RockOPDTrainer(
        model=student, teacher_model=teacher, args=args, train_dataset=prompts(64), processing_class=tokenizer
    )
    trainer.train()
    print("\nstep  loss      frozen  rocks")
    for log in trainer.state.log_history:
        if "loss" in log:
            print(f"{log['step']:>4}  {log['loss']:.5f}  {log['rock/frozen_fraction']:.3f}   {int(log['rock/set_size'])}")
    rocks = trainer.rock_policy.rock_table()
    print(f"\n{len(rocks)} rock tokens: " + ", ".join(repr(tokenizer.decode([r["token_id"]])) for r in rocks))
    print(f"rock_tokens.json and checkpoints are in {os.path.abspath(cli.output_dir)}")


if __name__ == "__main__":
    main()
