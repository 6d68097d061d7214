"""Per-rank memory of a 2-process FSDP2 run against a 1-process run, on models large enough to show the teacher.

    python tests/scripts/fsdp_memory.py OUT [gkd|distillation]   # runs both and prints the ratios (a benchmark)

Each run trains `RockOPDTrainer` (`gkd`, the default: dataset completions, `lmbda=0`) or `RockDistillationTrainer`
(`distillation`: greedy completions) for 2 steps with a ~57M-parameter teacher (hidden 1024, 6 layers) and a
~10M-parameter student (hidden 512, 4 layers), float32, on CPU. Reported per rank:

- the bytes of the tensors each rank holds after training: teacher parameters, student parameters and optimizer state
  (local shards under FSDP2): exact, independent of the allocator (gradients are freed after each step);
- the process's peak resident memory during `train()` (Linux `VmHWM`, reset just before `train()`): what the
  operating system saw, allocator slack and the Python runtime included. Both runs build their full models before
  `train()` (as a non-meta `from_pretrained` does on every rank); that build is outside the window.
"""

import json
import os
import subprocess
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(SCRIPTS))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if t is not None)


def run(output_dir: str, mode: str, kind: str = "gkd") -> None:
    import torch

    sys.path.insert(0, SCRIPTS)
    from fsdp_train import POLICY_KWARGS, TRAINERS, cpu_fsdp2, make_config, make_dataset

    from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer()
    fsdp = mode == "fsdp"
    args = make_config(
        kind, output_dir, 0.0, 8, per_device_train_batch_size=2 if fsdp else 4, max_steps=2,
        logging_steps=1, report_to="none", save_strategy="no", seed=0, disable_tqdm=True, use_cpu=True, bf16=False,
        fsdp=fsdp, fsdp_config={"version": 2} if fsdp else None, rock_policy="rock_online",
        rock_policy_kwargs=POLICY_KWARGS,
    )
    trainer = cpu_fsdp2(TRAINERS[kind][0])(
        model=build_tiny_causal_lm(tokenizer, hidden_size=512, num_hidden_layers=4, seed=0),
        teacher_model=build_tiny_causal_lm(tokenizer, hidden_size=1024, num_hidden_layers=6, seed=1),
        args=args, train_dataset=make_dataset(kind, 16, answer="is the sum of the two"), processing_class=tokenizer,
    )
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM, the peak resident size
    rss_start = _status_kib("VmRSS")
    trainer.train()
    peak = _status_kib("VmHWM")
    optimizer_state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    result = {
        "rank": trainer.accelerator.process_index,
        "processes": trainer.accelerator.num_processes,
        "teacher_params_mib": _bytes(trainer.teacher_model.parameters()) / 2**20,
        "student_params_mib": _bytes(trainer.model.parameters()) / 2**20,
        "optimizer_state_mib": _bytes(optimizer_state) / 2**20,
        "rss_at_train_start_mib": rss_start / 1024,
        "peak_rss_during_train_mib": peak / 1024,
    }
    with open(os.path.join(output_dir, f"memory_{mode}_rank{result['rank']}.json"), "w") as f:
        json.dump(result, f, indent=1)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


def main(output_dir: str, kind: str = "gkd") -> None:
    os.makedirs(output_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    me = os.path.abspath(__file__)
    subprocess.run([sys.executable, me, output_dir, "single", kind], env=env, check=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", me, output_dir, "fsdp",
                    kind], env=env, check=True)
    def load(name):
        with open(os.path.join(output_dir, name)) as f:
            return json.load(f)

    single = load("memory_single_rank0.json")
    ranks = [load(f"memory_fsdp_rank{r}.json") for r in (0, 1)]
    print(f"{'per rank (MiB)':<28}{'1 process':>11}{'FSDP2 rank 0':>14}{'FSDP2 rank 1':>14}{'ratio (max)':>13}")
    for key in single:
        if key.endswith("_mib"):
            worst = max(r[key] for r in ranks)
            print(f"{key:<28}{single[key]:>11.1f}{ranks[0][key]:>14.1f}{ranks[1][key]:>14.1f}"
                  f"{worst / single[key] if single[key] else float('nan'):>13.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] in ("single", "fsdp"):
        run(*sys.argv[1:])
    else:
        main(*sys.argv[1:])
