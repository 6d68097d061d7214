"""GPU benchmarks in one command, for a session lent an accelerator: the loss path at Qwen3 shapes, and the training
step of a Qwen3-1.7B-shaped student under a Qwen3-8B-shaped teacher (random weights, bf16), with the student in full,
LoRA and 4-bit (QLoRA) variants, `RockOPDTrainer` against TRL's `GKDTrainer`.

    python -m benchmarks.gpu --out benchmarks/results/gpu.json            # on a CUDA machine
    python -m benchmarks.gpu --smoke --out /tmp/gpu_smoke.json            # tiny shapes, any device (a test runs it)

Loss path: each case is first run in float32 (TF32 off) and checked like the CPU benchmark: ours against GKD's and
TRL's DistillationTrainer's loss and gradients within 1e-5 relative, a float64 referee deciding where an anchor is off.
Then the same shapes in bf16 (the dtype a GPU run trains in) are timed (CUDA-synchronized wall clock, median of
`--repeats`, implementations interleaved) and their peak memory is read from the caching allocator
(`max_memory_allocated` above what was allocated before the call). On CUDA, TRL's DistillationTrainer path is its
Triton kernel (`trl.kernels.chunked_divergence`).

Training step: the phases of `benchmarks.train_step` (generation, loss forward, backward, optimizer, total, peak
memory, completion tokens/s), both trainers in one process sharing one teacher, each with a fresh student loaded from
the same saved weights; the first step is a warm-up. The prompts are GSM8K questions where `../shared` is beside the
checkout and synthetic word problems of GSM8K length elsewhere (a random-weight model cannot tell them apart).

Results are written after every case and every training run, so a run cut short keeps what it measured; a failure is
recorded with its traceback and the rest goes on. The exit status is non-zero if anything failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict

import torch

from benchmarks.loss_path import (
    GIB,
    AgreementError,
    LossCase,
    _detached,
    _over_tolerance,
    check_agreement,
    make_inputs,
    ratios,
    reference_float64,
    relative_differences,
    run_once,
)
from benchmarks.memory import peak_since_reset, reset_peak


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

__all__ = ["QWEN3_1_7B", "QWEN3_8B", "STUDENT_VARIANTS", "gpu_loss_case", "loss_grid", "qwen3_config"]

# Qwen3-1.7B and Qwen3-8B as their config.json files give them (the shapes; the weights here are random).
QWEN3_1_7B = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
)  # fmt: skip
QWEN3_8B = dict(
    QWEN3_1_7B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    tie_word_embeddings=False,
)  # fmt: skip
# --smoke: the same model family at toy sizes (every linear input a multiple of bitsandbytes' CPU 4-bit block, 64).
_SMOKE_STUDENT = dict(
    QWEN3_1_7B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024,
)  # fmt: skip
_SMOKE_TEACHER = dict(_SMOKE_STUDENT, hidden_size=128, num_hidden_layers=3, tie_word_embeddings=False)
STUDENT_VARIANTS = ("full", "lora", "qlora")
TRAINERS = ("gkd", "rockopd")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------- loss path ----
def loss_grid(smoke: bool) -> list[LossCase]:
    """The GPU loss-path cases: the Qwen3-1.7B head under a Qwen3-8B-wide teacher (H 2048 / 4096, V 151,936) at
    completion lengths 256-2048, every beta and 0 / 0.2 / 0.5 frozen, one larger chunk, and the SmolLM2 head.

    Example:
    ```python
    >>> from benchmarks.gpu import loss_grid
    >>> len(loss_grid(smoke=True)), loss_grid(smoke=False)[0].teacher_hidden
    (4, 4096)
    ```
    """
    if smoke:
        return [
            LossCase(16, 256, 2, 8, beta, frozen, chunk_size=5, teacher_hidden=24)
            for beta, frozen in ((0.0, 0.0), (0.5, 0.0), (1.0, 0.0), (1.0, 0.5))
        ]
    qwen = dict(hidden=2048, vocab=151936, batch=4, teacher_hidden=4096)
    cases = [LossCase(**qwen, length=length, beta=beta, frozen=0.0) for length in (256, 1024, 2048)
             for beta in (0.0, 0.5, 1.0)]  # fmt: skip
    cases += [LossCase(**qwen, length=length, beta=1.0, frozen=0.5) for length in (256, 1024, 2048)]
    cases += [LossCase(**qwen, length=1024, beta=1.0, frozen=0.2)]
    cases += [LossCase(**qwen, length=2048, beta=1.0, frozen=0.0, chunk_size=2048)]
    cases += [LossCase(576, 49152, 4, 1024, 1.0, frozen) for frozen in (0.0, 0.5)]
    return cases


def gpu_loss_case(case: LossCase, device: torch.device, repeats: int = 5) -> dict:
    """Check `case` in float32 against both anchors (float64 referee where needed), then time and measure it in bf16.

    Raises [`AgreementError`] if ours is off the float64 reference by more than the tolerance, and whatever our own
    loss path raises; an anchor's failure is recorded in the case's `status` and `reason`.

    Example:
    ```python
    >>> import torch
    >>> from benchmarks.gpu import gpu_loss_case
    >>> from benchmarks.loss_path import LossCase
    >>> rec = gpu_loss_case(LossCase(8, 32, 1, 4, 1.0, 0.0), torch.device("cpu"), repeats=1)
    >>> sorted(rec["median_s"]), rec["agreement"]["gkd"]["loss_rel"] < 1e-5
    (['distillation', 'gkd', 'rockopd'], True)
    ```
    """
    # `rockopd_eager`: ours without `torch.compile` of the chunk's closed forms (only CUDA compiles them).
    impls = ["rockopd"] + (["rockopd_eager"] if device.type == "cuda" else []) + ["gkd", "distillation"]
    impls += ["rockopd_uniform"] if case.frozen > 0 else []
    checked = [impl for impl in impls if impl in ("rockopd_eager", "gkd", "distillation")]
    record: dict = {"case": asdict(case), "status": {}, "reason": {}, "peak_bytes": {}}

    def attempt(impl: str, inputs: dict):
        # An anchor that fails (a Triton kernel that does not build, an OOM) is recorded and dropped; ours raises.
        try:
            return run_once(impl, inputs, case)
        except Exception as err:
            if impl == "rockopd":
                raise
            record["status"][impl], record["reason"][impl] = "error", f"{type(err).__name__}: {err}"[:300]
            _free(device)
            return None

    # 1. Agreement, float32, TF32 off: the same 1e-5 check as the CPU benchmark.
    inputs = make_inputs(case, device=device, dtype=torch.float32)
    ours = _detached(run_once("rockopd", inputs, case))
    record["agreement"] = {}
    for impl in checked:
        result = attempt(impl, inputs)
        if result is not None:
            record["agreement"][impl] = relative_differences(result, ours)
        del result
    record["referee"] = {}
    if any(_over_tolerance(d) for d in record["agreement"].values()):
        exact = reference_float64(inputs, case)
        record["referee"]["rockopd"] = relative_differences(ours, exact)
        for impl in record["agreement"]:
            record["referee"][impl] = relative_differences(run_once(impl, inputs, case), exact)
        check_agreement(ours, exact, "rockopd", against="the float64 reference")
        del exact
    record["loss_fp32"] = float(ours["loss"])
    del inputs, ours
    _free(device)
    # 2. bf16: each implementation's distance to float64 on the same bf16 inputs (its own rounding, nothing else),
    # which is also the warm-up (Triton compiles here); then peak memory, then interleaved timed repeats.
    inputs = make_inputs(case, device=device, dtype=torch.bfloat16)
    exact = reference_float64(inputs, case)
    record["bf16_vs_float64"] = {}
    for impl in impls:
        if record["status"].get(impl) == "error":
            continue
        result = attempt(impl, inputs)
        if result is not None:
            record["status"][impl] = "ok"
            if impl != "rockopd_uniform":  # another loss (every weight 1), not comparable
                record["bf16_vs_float64"][impl] = relative_differences(result, exact)
        del result
    del exact
    _free(device)
    runnable = [impl for impl in impls if record["status"].get(impl) == "ok"]
    for impl in runnable:
        inputs["h_s"].grad = inputs["head_s"].weight.grad = None
        _free(device)
        base = reset_peak(device)
        run_once(impl, inputs, case)
        record["peak_bytes"][impl] = peak_since_reset(device) - base
    times: dict[str, list[float]] = {impl: [] for impl in runnable}
    for r in range(repeats):
        for impl in runnable[r % len(runnable) :] + runnable[: r % len(runnable)]:
            _sync(device)
            start = time.perf_counter()
            run_once(impl, inputs, case)
            _sync(device)
            times[impl].append(time.perf_counter() - start)
    record["times"] = times
    record["median_s"] = {impl: statistics.median(t) for impl, t in times.items()}
    record["ratios"] = ratios(record)
    if record["median_s"].get("rockopd_eager"):
        record["ratios"]["compiled_vs_eager_time"] = record["median_s"]["rockopd"] / record["median_s"]["rockopd_eager"]
    if "rockopd_eager" in record["agreement"] and _over_tolerance(record["agreement"]["rockopd_eager"]):
        raise AgreementError(f"compiled and eager loss paths disagree: {record['agreement']['rockopd_eager']}")
    del inputs
    _free(device)
    return record


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------- training step ----
def qwen3_config(shape: dict, tokenizer):
    """A `Qwen3Config` of `shape` whose special tokens are `tokenizer`'s (the byte-level tiny one: a random-weight
    model needs no real vocabulary, and ids beyond the tokenizer's decode to nothing)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        **shape, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )


def _random_model(config, device: torch.device, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def _load_student(path: str, variant: str, device: torch.device):
    """The saved student as `variant`: full weights, a LoRA adapter on every linear layer, or that adapter on the
    4-bit NF4 base (QLoRA, bf16 compute)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs: dict = {"dtype": torch.bfloat16, "device_map": {"": str(device)}}
    if variant == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=True,
        )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if variant == "full":
        return model
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def _step_prompts(n: int):
    from benchmarks.train_step import GSM8K, _prompts

    if os.path.isfile(GSM8K):
        return _prompts(n), "GSM8K train"
    from datasets import Dataset

    names, items = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid"), ("apples", "stickers", "marbles", "books")
    rows = []
    for i in range(n):
        a, b, c = 12 + 7 * i, 3 + i % 5, 2 + i % 4
        who, what = names[i % len(names)], items[i % len(items)]
        question = (
            f"{who} has {a} {what}. {who} buys {b} packs with {c} {what} in each pack, then gives away a third of "
            f"all the {what} to friends at school and keeps the rest in a box. How many {what} does {who} keep?"
        )
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": ""}]})
    return Dataset.from_list(rows), "synthetic GSM8K-length word problems (GSM8K not beside the checkout)"


def run_training_steps(
    device: torch.device,
    smoke: bool,
    steps: int,
    batch: int,
    max_new_tokens: int,
    seed: int,
    on_result,
    variants: tuple[str, ...] = STUDENT_VARIANTS,
    trainers: tuple[str, ...] = TRAINERS,
    betas: tuple[float, ...] = (1.0,),
    deadline: float | None = None,
) -> list[dict]:
    """The student `variants` under each of `trainers` (names of `benchmarks.train_step.TRAINERS`) at each of `betas`;
    `on_result(record)` after each run. A run not started by `deadline` (a `time.perf_counter()` value) is recorded as
    `skipped`, not run."""
    from benchmarks.train_step import _summarize, train_steps
    from hf_rockopd.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    student_shape, teacher_shape = (_SMOKE_STUDENT, _SMOKE_TEACHER) if smoke else (QWEN3_1_7B, QWEN3_8B)
    t0 = time.perf_counter()
    teacher = _random_model(qwen3_config(teacher_shape, tokenizer), device, seed + 1)
    teacher.requires_grad_(False)
    build_s = time.perf_counter() - t0
    data, prompt_source = _step_prompts(batch * steps)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        student_path = os.path.join(tmp, "student")
        _random_model(qwen3_config(student_shape, tokenizer), device, seed).save_pretrained(student_path)
        _free(device)
        for variant, beta, name in ((v, b, t) for v in variants for b in betas for t in trainers):
            record = {"variant": variant, "trainer": name, "beta": beta, "prompts": prompt_source,
                      "teacher_build_s": build_s}  # fmt: skip
            if deadline is not None and time.perf_counter() > deadline:
                record["skipped"] = "the time budget ran out before this run"
                records.append(record)
                on_result(record)
                continue
            try:
                student = _load_student(student_path, variant, device)
                out = train_steps(
                    name, student, teacher, tokenizer, data, steps, batch, max_new_tokens, seed,
                    output_dir=os.path.join(tmp, f"{variant}_{name}_{beta}"), cuda=device.type == "cuda",
                    beta=beta,
                )  # fmt: skip
                record.update(out, median=_summarize(out["steps"]))
                measured = out["steps"][1:] or out["steps"]
                if device.type == "cuda":
                    record["median"]["peak_allocated_bytes"] = statistics.median(
                        s["peak_allocated_bytes"] for s in measured
                    )
            except Exception:  # noqa: BLE001 - recorded, and the exit status says so
                record["error"] = traceback.format_exc()[-3000:]
                print(record["error"], file=sys.stderr, flush=True)
            student = None
            _free(device)
            records.append(record)
            on_result(record)
    return records


def step_ratios(records: list[dict]) -> dict:
    """Ours over GKD's, per student variant, for every timed phase and the peak memory.

    Example:
    ```python
    >>> from benchmarks.gpu import step_ratios
    >>> step_ratios([{"variant": "lora", "trainer": t, "median": {"total_s": s}} for t, s in (("gkd", 4.0), ("rockopd", 1.0))])
    {'lora': {'total_s': 0.25}}
    ```
    """
    by = {(r["variant"], r["trainer"]): r["median"] for r in records if "median" in r}
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in records):
        ours, gkd = by.get((variant, "rockopd")), by.get((variant, "gkd"))
        if ours and gkd:
            out[variant] = {k: ours[k] / gkd[k] for k in ours if k in gkd and gkd[k]}
    return out


# ---------------------------------------------------------------------------------------------------------- main ----
def _compile_default() -> bool:
    from hf_rockopd.losses.closed_form import _compile_requested

    return _compile_requested()

def _environment(device: torch.device) -> dict:
    import importlib.metadata as md

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=props.total_memory / GIB, multiprocessors=props.multi_processor_count)
    for pkg in ("transformers", "trl", "peft", "accelerate", "bitsandbytes", "triton"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = None
    env["cpu_count"] = os.cpu_count()
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/gpu.json", help="JSON file of the raw results")
    parser.add_argument("--part", choices=("all", "loss", "step"), default="all")
    parser.add_argument("--smoke", action="store_true", help="toy shapes on any device: checks the script itself")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per training run (the first a warm-up)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default=",".join(STUDENT_VARIANTS), help="student variants, comma-separated")
    args = parser.parse_args(argv)
    variants = tuple(v for v in args.variants.split(",") if v)
    if not variants or set(variants) - set(STUDENT_VARIANTS):
        parser.error(f"--variants takes a comma-separated subset of {STUDENT_VARIANTS}, got {args.variants!r}.")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.smoke:
        parser.error(f"the full GPU benchmark needs a CUDA device, got {device}; pass --smoke to check the script.")
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the first step is a warm-up), got {args.steps}.")
    # TF32 would put the float32 agreement check at ~1e-3; the timed runs are bf16 and unaffected.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result: dict = {
        "meta": {
            "benchmark": "gpu", "smoke": args.smoke, "repeats": args.repeats, "steps": args.steps,
            "batch": args.batch, "max_new_tokens": args.max_new_tokens, "seed": args.seed, "variants": variants,
            "compile_loss_on_cuda": _compile_default(),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(["python", "-m", "benchmarks.gpu", *(argv if argv is not None else sys.argv[1:])]),
            **_environment(device),
        },
        "loss_path": [], "train_step": [], "failures": [],
    }  # fmt: skip

    def write() -> None:
        result["train_step_ratios"] = step_ratios(result["train_step"])
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    print(json.dumps(result["meta"]), flush=True)
    if args.part in ("all", "loss"):
        for i, case in enumerate(loss_grid(args.smoke)):
            start = time.perf_counter()
            try:
                record = gpu_loss_case(case, device, args.repeats)
            except Exception as err:  # noqa: BLE001 - recorded; the exit status says so
                record = {"case": asdict(case), "error": f"{type(err).__name__}: {err}"[:2000]}
                result["failures"].append(record["error"])
                _free(device)
            record["wall_s"] = time.perf_counter() - start
            result["loss_path"].append(record)
            write()
            summary = {k: round(v, 3) for k, v in record.get("ratios", {}).items()}
            times = {k: round(v * 1e3, 1) for k, v in record.get("median_s", {}).items()}
            mem = {k: round(v / GIB, 2) for k, v in record.get("peak_bytes", {}).items()}
            print(f"[loss {i + 1}] {case} ms={times} GiB={mem} ratios={summary} {record.get('error', '')}", flush=True)
    if args.part in ("all", "step"):

        def on_result(record: dict) -> None:
            if "error" in record:
                result["failures"].append(f"train_step {record['variant']}/{record['trainer']}: {record['error'][-300:]}")
            result["train_step"].append(record)
            write()
            print(f"[step {record['variant']}/{record['trainer']}] {json.dumps(record.get('median'))}", flush=True)

        run_training_steps(
            device, args.smoke, args.steps, args.batch, args.max_new_tokens, args.seed, on_result, variants
        )
    write()
    print("train step ours/gkd:", json.dumps(result["train_step_ratios"]), flush=True)
    if result["failures"]:
        print("FAILURES:\n" + "\n".join(result["failures"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
