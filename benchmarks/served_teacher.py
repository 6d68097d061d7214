"""The trainer's memory and step time with the teacher served (`hf-rockopd serve-teacher` in another process) against
the teacher in the trainer's memory, on the main job's training settings (`examples/configs/distill_qwen.yaml`: LoRA
r16 on every linear layer, 2 prompts x 192 sampled tokens per step, reverse KL, rock_online).

Each mode trains in a fresh worker process whose peak RSS (`VmHWM`, model loading included) is read at its end; the
served mode starts the server first and reads its peak RSS too. The server and the trainer share this machine's cores,
so the served step time includes the teacher's forward on the same CPU (on a GPU machine the teacher lives elsewhere).

```
python -m benchmarks.served_teacher --gsm8k ../shared/data/gsm8k/train.jsonl --top_k 16 --steps 3
```
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


from .loss_path import cpu_description


ROOT = Path(__file__).resolve().parents[1]


def _peak_rss(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One training run in this process (`--worker inprocess|served|inprocess_topk`); returns its figures."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback

    from hf_rockopd import RockOPDConfig, RockOPDTrainer
    from hf_rockopd.data.chat import question_messages, read_jsonl
    from hf_rockopd.models import resolve_causal_lm

    student = resolve_causal_lm(args.student)
    rows = [row for _, row in read_jsonl(args.gsm8k, limit=2 * args.steps)]
    dataset = Dataset.from_list(
        [{"messages": [*question_messages(r["question"]), {"role": "assistant", "content": r["answer"]}]} for r in rows]
    )
    teacher = None
    if args.worker != "served":
        teacher = resolve_causal_lm(args.teacher, with_tokenizer=False).model
    config = RockOPDConfig(
        output_dir=tempfile.mkdtemp(),
        max_steps=args.steps,
        per_device_train_batch_size=2,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        max_new_tokens=args.max_new_tokens,
        logging_steps=1,
        gradient_checkpointing=False,
        save_strategy="no",
        report_to="none",
        seed=42,
        disable_tqdm=True,
        rock_policy="rock_online",
        rock_policy_kwargs={"warmup_steps": 2, "refresh_every": 2, "persistence": 2, "top_k": 50},
        teacher_server_url=args.url if args.worker == "served" else None,
        teacher_top_k=args.top_k if args.worker != "inprocess" else None,
        teacher_request_timeout=600,
    )
    step_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            step_times.append(time.perf_counter() - self.start)

    trainer = RockOPDTrainer(
        model=student.model,
        teacher_model=teacher,
        args=config,
        train_dataset=dataset,
        processing_class=student.tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=[Timer()],
    )
    trainer.train()
    teacher_bytes = sum(p.numel() * p.element_size() for p in teacher.parameters()) if teacher is not None else 0
    return {
        "mode": args.worker,
        "peak_rss_bytes": _peak_rss(),
        "teacher_weight_bytes": teacher_bytes,
        "step_seconds": step_times,
        "losses": [row["loss"] for row in trainer.state.log_history if "loss" in row],
    }


def _run_worker(mode: str, args: argparse.Namespace, url: str | None = None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.served_teacher", "--worker", mode, "--gsm8k", args.gsm8k,
           "--teacher", args.teacher, "--student", args.student, "--steps", str(args.steps),
           "--top_k", str(args.top_k), "--max_new_tokens", str(args.max_new_tokens), "--url", url or ""]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise RuntimeError(f"{mode} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gsm8k", required=True)
    parser.add_argument("--teacher", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    parser.add_argument("--student", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top_k", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=192)
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--modes", nargs="+", default=["inprocess", "served"])
    parser.add_argument("--out", default="benchmarks/results/served_teacher.json")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return {}

    results: dict[str, Any] = {}
    for mode in args.modes:
        if mode != "served":
            results[mode] = _run_worker(mode, args)
            continue
        url = f"http://127.0.0.1:{args.port}"
        server = subprocess.Popen(
            [sys.executable, "-m", "hf_rockopd.cli", "serve-teacher", "--model", args.teacher, "--port", str(args.port),
             "--max_top_k", str(args.top_k)],  # fmt: skip
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            import requests

            for _ in range(600):
                try:
                    if requests.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    time.sleep(1)
            results[mode] = _run_worker(mode, args, url)
            results[mode]["server_peak_rss_bytes"] = _peak_rss(server.pid)
        finally:
            server.kill()
            server.wait()
    summary = {
        "machine": f"{cpu_description()}, {os.cpu_count()} cores",
        "command": "python -m benchmarks.served_teacher " + " ".join(argv or sys.argv[1:]),
        "top_k": args.top_k,
        "results": results,
    }
    if "inprocess" in results and "served" in results:
        local, served = results["inprocess"], results["served"]
        student_only = local["peak_rss_bytes"] - local["teacher_weight_bytes"]
        summary["served_rss_over_inprocess"] = served["peak_rss_bytes"] / local["peak_rss_bytes"]
        summary["served_rss_over_student_only"] = served["peak_rss_bytes"] / student_only
        summary["served_step_over_inprocess"] = (sum(served["step_seconds"]) / sum(local["step_seconds"]))
    for mode, figures in results.items():
        print(f"{mode}: peak RSS {figures['peak_rss_bytes'] / 1e9:.2f} GB, steps "
              f"{', '.join(f'{s:.0f}' for s in figures['step_seconds'])} s, losses {figures['losses']}")  # fmt: skip
    for key in ("served_rss_over_inprocess", "served_rss_over_student_only", "served_step_over_inprocess"):
        if key in summary:
            print(f"{key}: {summary[key]:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
