"""Rock-token-aware on-policy distillation on GSM8K, as a TRL-style script.

Every option is a field of `DistillArguments` (models, data, evaluation), of `RockOPDConfig` (training, token policy,
loss) or of `StudentModelConfig` (TRL's `ModelConfig`: LoRA and 4-bit), given on the command line or in a YAML file,
as in TRL's scripts:

    # the embedded default: SmolLM2-135M-Instruct -> 24-layer copy, offline, about 15 minutes on 2 CPU cores
    python examples/distill_gsm8k.py --config examples/configs/distill_smollm2.yaml

    # a larger pair on one GPU, QLoRA student
    python examples/distill_gsm8k.py --teacher Qwen/Qwen3-8B --student Qwen/Qwen3-1.7B --load_in_4bit \
        --dataset openai/gsm8k --max_steps 500 --bf16 --output_dir runs/qwen3-rockopd

`hf-rockopd distill` is the same command.
"""

import os
import sys


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from hf_rockopd.commands.distill import parse_arguments
from hf_rockopd.distill import run_distillation


def main() -> int:
    script, training_args, model_args = parse_arguments(sys.argv[1:])
    result = run_distillation(script, training_args, model_args, command=" ".join(["python", *sys.argv]))
    before, after = result.report["eval"]["before"], result.report["eval"]["after"]
    if before and after:
        print(f"held-out divergence {before['mean_divergence']:.4f} -> {after['mean_divergence']:.4f}, "
              f"accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}")
    print(f"student, run report and model card in {result.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
