"""Train a rock-token trainer with `rock_online` on tiny models under FSDP2 (two gloo processes) or on one process.

    torchrun --nproc_per_node 2 tests/scripts/fsdp_train.py OUT fsdp [--kind gkd|distillation] [--lmbda L]
                                  [--steps N] [--save-every K] [--kill-at S] [--resume CKPT] [--lora]
    python tests/scripts/fsdp_train.py OUT single ...   # one process, the two ranks' batches as one global batch

`--kind gkd` (the default) trains `RockOPDTrainer` on `messages`, `--kind distillation` `RockDistillationTrainer` on
`prompt`s. `--lmbda 0` makes both runs see the same completions: the dataset's for `gkd`; greedy decoding for
`distillation`, which is always on-policy (sampling would draw other tokens on 2 ranks than on 1). `--lmbda 1`
samples on-policy for both.

The FSDP2 run goes through the Trainer's own FSDP path: `fsdp=True, fsdp_config={"version": 2}`, accelerate's FSDP2
preparation of the student (`fully_shard` per decoder layer, embedding, final norm + head, root), its FSDP checkpoint
saving and loading, and the trainer's sharded teacher. One thing is patched, here only: accelerate 1.16 turns FSDP
on for GPU-like devices only and silently sets a CPU run up as DDP (`MULTI_CPU`), so [`cpu_fsdp2`] switches the
accelerator state to FSDP with the plugin the Trainer built from `fsdp_config`, before anything is prepared.

Each rank writes `OUT/rank<k>.pt`: the loss history, the rock set after each step, the policy state, the full student
weights (gathered from the shards), what each teacher parameter is on that rank, and where it wrote `rock_tokens.json`.
"""

import argparse
import functools
import os
import signal

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_rockopd import RockDistillationConfig, RockDistillationTrainer, RockOPDConfig, RockOPDTrainer
from hf_rockopd.models import build_tiny_causal_lm, build_tiny_tokenizer

# Refresh every step after one warm-up step, with loose thresholds so tiny models produce a non-empty rock set.
POLICY_KWARGS = dict(top_k=8, min_count=1, exclude_top_frequent=2, warmup_steps=1, refresh_every=1, window=3,
                     persistence=1, stagnation_tol=10.0)
PER_RANK_BATCH = 2
WORLD = 2
TRAINERS = {"gkd": (RockOPDTrainer, RockOPDConfig), "distillation": (RockDistillationTrainer, RockDistillationConfig)}


@functools.cache
def cpu_fsdp2(base: type) -> type:
    """`base` (a rock-token trainer) whose accelerator runs FSDP2 on CPU (test-only: see the module docstring)."""

    class CpuFsdp2Trainer(base):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            from accelerate.state import PartialState
            from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

            state = self.accelerator.state
            if self.args.fsdp and state.distributed_type == DistributedType.MULTI_CPU:
                # Both shared states: a later `PartialState()` (the Trainer makes some) must not turn it back.
                state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
                state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                self.is_fsdp_enabled = True

    CpuFsdp2Trainer.__name__ = CpuFsdp2Trainer.__qualname__ = f"CpuFsdp2{base.__name__}"
    return CpuFsdp2Trainer


def make_dataset(kind: str, n: int = 32, answer: str = "is the sum") -> Dataset:
    """Questions `What is i + (i+1)?`: as chats with the answer for `gkd`, as prompts for `distillation`."""
    rows = []
    for i in range(n):
        question = [{"role": "user", "content": f"What is {i} + {i + 1}?"}]
        if kind == "gkd":
            rows.append({"messages": [*question, {"role": "assistant", "content": f"{2 * i + 1} {answer}"}]})
        else:
            rows.append({"prompt": question})
    return Dataset.from_list(rows)


def make_config(kind: str, output_dir: str, lmbda: float, completion_tokens: int, **settings):
    """The kind's config with the same settings; `lmbda` as the module docstring says."""
    config_class = TRAINERS[kind][1]
    if kind == "gkd":
        return config_class(output_dir=output_dir, lmbda=lmbda, max_new_tokens=completion_tokens, **settings)
    greedy = {"generation_kwargs": {"do_sample": False}} if lmbda == 0 else {}
    return config_class(output_dir=output_dir, max_completion_length=completion_tokens, **greedy, **settings)


class Record(TrainerCallback):
    def __init__(self):
        self.after_step = []

    def on_step_end(self, args, state, control, **kwargs):
        policy = self.trainer.rock_policy
        self.after_step.append({"step": state.global_step, "rock_ids": policy.rock_ids()})
        if self.kill_at is not None and state.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # the hard way: no cleanup, no save


def record_head_paths():
    """Record, per projection, how each head reached the loss: which tensor type the student's head weight was (a
    shard or the unsharded parameter) and whether the loss took its hand-written head gradient (`_plain_linear`)."""
    from hf_rockopd.engine import sharding
    from hf_rockopd.losses import fused

    seen = {"head_weight": [], "hand_written": []}
    bare_head, plain_linear = sharding._bare_head, fused._plain_linear

    def recording_bare_head(head, dtype):
        seen["head_weight"].append((type(head.weight).__name__, head.weight.requires_grad))
        return bare_head(head, dtype)

    def recording_plain_linear(head, params):
        result = plain_linear(head, params)
        if params:
            seen["hand_written"].append(result)
        return result

    sharding._bare_head, fused._plain_linear = recording_bare_head, recording_plain_linear
    return seen


def check_sharded_head_gradient():
    """The gathered-head path for a head whose weight is a shard when the loss runs (not the case for accelerate's
    student, whose head stays unsharded after forward): its gradient must reach the shard's `.grad` as the average
    over ranks of each rank's full gradient, which is what FSDP does for every other parameter. Returns the largest
    error."""
    from torch.distributed.fsdp import fully_shard

    from hf_rockopd.engine.sharding import _bare_head

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 5, bias=True)
    reference = torch.nn.Linear(8, 5, bias=True)
    reference.load_state_dict(head.state_dict())
    fully_shard(head, reshard_after_forward=True)
    rank = torch.distributed.get_rank()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    bare = _bare_head(head, None)
    (bare(x) ** 2).sum().backward()
    (reference(x) ** 2).sum().backward()
    errors = []
    for name in ("weight", "bias"):
        full = getattr(reference, name).grad.clone()
        torch.distributed.all_reduce(full)
        errors.append((getattr(head, name).grad.full_tensor() - full / torch.distributed.get_world_size()).abs().max())
    return float(max(errors))


def full_weights(model):
    """Every parameter in full on every rank (`full_tensor` all-gathers a shard, ZeRO-3 gathers its partitions; all
    ranks must call it)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        if hasattr(param, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param]):
                out[name] = param.detach().cpu().clone()
            continue
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = value.detach().cpu().clone()
    return out


def teacher_shards(teacher):
    """What each teacher parameter is on this rank: an FSDP2 shard (`dtensor`), a ZeRO-3 partition (`zero3`: its
    local partition in `local`, the whole in `full`) or a whole tensor."""
    from torch.distributed.tensor import DTensor

    def local(p):
        if hasattr(p, "ds_tensor"):
            return p.ds_tensor.numel()
        return (p.to_local() if isinstance(p, DTensor) else p).numel()

    return {
        name: {"dtensor": isinstance(p, DTensor), "zero3": hasattr(p, "ds_tensor"), "local": local(p),
               "full": getattr(p, "ds_numel", p.numel()), "shape": tuple(getattr(p, "ds_shape", p.shape)),
               "requires_grad": p.requires_grad}
        for name, p in teacher.named_parameters()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("mode", choices=["fsdp", "single", "deepspeed"])
    parser.add_argument("--kind", choices=sorted(TRAINERS), default="gkd")
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--lmbda", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--optim", default="adamw_torch")
    cli = parser.parse_args()

    torch.manual_seed(0)
    head_paths = record_head_paths()
    tokenizer = build_tiny_tokenizer()
    dataset = make_dataset(cli.kind)
    fsdp = cli.mode == "fsdp"
    sharded = cli.mode != "single"
    deepspeed = None
    if cli.mode == "deepspeed":
        # Run with DS_ACCELERATOR=cpu: DeepSpeed's CPU accelerator then talks over gloo (no oneCCL here).
        deepspeed = {"zero_optimization": {"stage": cli.zero}, "bf16": {"enabled": False}, "fp16": {"enabled": False},
                     "train_micro_batch_size_per_gpu": "auto",
                     "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}
    args = make_config(
        cli.kind,
        cli.output_dir,
        cli.lmbda,
        8,
        per_device_train_batch_size=PER_RANK_BATCH if sharded else PER_RANK_BATCH * WORLD,
        max_steps=cli.steps,
        learning_rate=1e-2,
        optim=cli.optim,
        logging_steps=1,
        report_to="none",
        save_strategy="steps" if cli.save_every else "no",
        save_steps=cli.save_every or 500,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,  # float32 throughout (TRL's default would be bf16 mixed precision, on CPU too)
        fsdp=fsdp,
        fsdp_config={"version": 2} if fsdp else None,
        deepspeed=deepspeed,
        rock_policy="rock_online",
        rock_policy_kwargs=POLICY_KWARGS,
    )
    peft_config = None
    if cli.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    record = Record()
    record.kill_at = cli.kill_at
    trainer = cpu_fsdp2(TRAINERS[cli.kind][0])(
        model=build_tiny_causal_lm(tokenizer, seed=0),
        teacher_model=build_tiny_causal_lm(tokenizer, seed=1, num_hidden_layers=3),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[record],
    )
    record.trainer = trainer
    writes = []
    write = trainer.write_rock_tokens
    trainer.write_rock_tokens = lambda directory: writes.append(directory) or write(directory)
    shards_before = teacher_shards(trainer.teacher_model)
    trainer.train(resume_from_checkpoint=cli.resume)
    rank = trainer.accelerator.process_index
    policy = trainer.rock_policy
    head_paths = {key: list(value) for key, value in head_paths.items()}  # the training's, not the check's below
    result = {
        "rank": rank,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "is_fsdp2": bool(trainer.accelerator.is_fsdp2),
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "after_step": record.after_step,
        "state": policy.state_dict(),
        "rock_ids": policy.rock_ids(),
        "student": full_weights(trainer.model),
        "teacher_shards": shards_before,
        "teacher_shards_after": teacher_shards(trainer.teacher_model),
        "student_zero3": all(hasattr(p, "ds_tensor") for p in trainer.model.parameters()),
        "rock_token_writes": writes,
        "global_step": trainer.state.global_step,
        "head_paths": head_paths,
        "sharded_head_grad_error": check_sharded_head_gradient() if fsdp else None,
    }
    torch.save(result, os.path.join(cli.output_dir, f"rank{rank}.pt"))
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
