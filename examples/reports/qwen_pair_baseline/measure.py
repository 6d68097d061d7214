"""Baseline of the competent offline pair on the distill job's 16 held-out GSM8K problems.

Qwen2.5-Coder-0.5B-Instruct (student) and Qwen2.5-Coder-1.5B-Instruct (teacher), greedy, 320 new tokens, with the
teacher's completions taken from the teacher reference the distill job cached (`teacher_reference.json`, made by
`hf-rockopd distill --config examples/configs/distill_qwen.yaml`). Writes `student_eval.json` (with per-problem
records) and prints the results table. Needs `make install-qwen`.

    python examples/reports/qwen_pair_baseline/measure.py REFERENCE_JSON OUT_DIR
"""

import sys
import time

import torch

from hf_rockopd.data import split_dataset
from hf_rockopd.evaluation import evaluate_gsm8k, format_results_table
from hf_rockopd.models import resolve_causal_lm
from hf_rockopd.evaluation.teacher_reference import TeacherReference

reference_path, out_dir = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
# The distill job's split (examples/configs/distill_qwen.yaml: 128 training prompts, 16 held out, seed 42).
problems = split_dataset("openai/gsm8k", 128, 16, seed=42).problems  # the distill job's held-out problems
started = time.perf_counter()
teacher = resolve_causal_lm("Qwen/Qwen2.5-Coder-1.5B-Instruct")
student = resolve_causal_lm("Qwen/Qwen2.5-Coder-0.5B-Instruct")
reference = TeacherReference.load(reference_path)
# The distill job evaluates with the teacher's tokenizer (same vocabulary; the reference is fingerprinted with it).
result = evaluate_gsm8k(student.model, teacher.tokenizer, problems, teacher=teacher.model, teacher_reference=reference,
                        max_new_tokens=320, batch_size=8)
result.settings["wall_seconds_with_loading"] = round(time.perf_counter() - started, 1)
result.save(f"{out_dir}/student_eval.json", include_records=True)
print(format_results_table({"student (0.5B)": result}))
