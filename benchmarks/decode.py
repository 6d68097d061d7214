"""Greedy decode steps against the memory floor, before (MKL) and after (oneDNN-packed linears), on the Qwen pair.

A decode step reads every weight once, so its floor is the model's weight bytes over the machine's read
bandwidth; this prints, for the teacher and the student at batch 1, 8 and 16, the measured step, its ratio to that
floor, and whether the packed model's greedy tokens equal the dense model's. The step is the time of a generate call
of `--tokens` + 1 new tokens minus that of 1 new token, over `--tokens`, so the prompt's prefill is not counted.

```
python -m benchmarks.decode                       # the Qwen pair (make install-qwen), about 10 minutes on 2 cores
python -m benchmarks.decode --models HuggingFaceTB/SmolLM2-135M-Instruct --batches 1 8 --tokens 8
```
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from .loss_path import cpu_description


ROOT = Path(__file__).resolve().parents[1]
PROMPT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Think step by step."
)


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of a streaming read (`Tensor.sum` over `gib` GiB of float32), best of `repeats`."""
    data = torch.ones(int(gib * 2**30) // 4)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter once (tied ones once), less an untied input embedding (a lookup)."""
    unique = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in unique.values())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is None or output.weight is not embedding:
        total -= embedding.numel() * embedding.element_size()
    return total


def _generate(model, input_ids, attention_mask, new_tokens: int) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    return out[:, input_ids.shape[1] :], time.perf_counter() - start


def decode_step(model, tokenizer, batch: int, tokens: int) -> tuple[float, torch.Tensor]:
    """Seconds per greedy decode step at `batch` rows (prefill excluded), and the generated ids."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text)["input_ids"]] * batch)
    mask = torch.ones_like(ids)
    _generate(model, ids, mask, 2)  # warm-up: first-call allocations and oneDNN primitive creation
    _, prefill = _generate(model, ids, mask, 1)
    generated, total = _generate(model, ids, mask, tokens + 1)
    return (total - prefill) / tokens, generated


MODES = ("mkl", "packed", "packed_head")


def measure_model(
    name: str, batches: list[int], tokens: int, bandwidth: float, threads: list[int], modes: tuple[str, ...] = MODES
) -> dict[str, Any]:
    """The dense and the packed rows of one model (those of `modes`); the same model object is packed in place
    between them."""
    from hf_rockopd.models import pack_for_inference, resolve_causal_lm

    resolved = resolve_causal_lm(name)
    model, tokenizer = resolved.model.eval(), resolved.tokenizer
    nbytes = weight_bytes(model)
    floor = nbytes / bandwidth
    rows, dense_ids = [], {}
    packed = 0
    # One model, packed in place step by step: the body's linears (what `distill` does to its teacher, whose head the
    # loss projects through), then the head too (what `eval`, the lab and `serve-teacher` do).
    for mode in MODES:
        if mode != "mkl":
            packed += pack_for_inference(model, skip=("lm_head",) if mode == "packed" else ())
        if mode not in modes:
            continue
        for batch in batches:
            step, ids = decode_step(model, tokenizer, batch, tokens)
            same = None
            if mode == "mkl":
                dense_ids[batch] = ids
            elif batch in dense_ids:
                same = int((ids == dense_ids[batch]).all(dim=1).sum())
            rows.append(
                {"mode": mode, "batch": batch, "threads": torch.get_num_threads(), "step_s": step,
                 "ratio_to_floor": step / floor, "same_greedy_rows": same}
            )
            print(f"{name} {mode:11s} batch {batch:2d}: {step * 1e3:7.1f} ms/step = {step / floor:4.2f}x floor", flush=True)
    default_threads = torch.get_num_threads()
    for count in threads if "packed_head" in modes else []:
        if count == default_threads:
            continue
        torch.set_num_threads(count)
        step, _ = decode_step(model, tokenizer, 8, tokens)
        rows.append({"mode": "packed_head", "batch": 8, "threads": count, "step_s": step, "ratio_to_floor": step / floor,
                     "same_greedy_rows": None})
        print(f"{name} packed_head batch  8, {count} threads: {step * 1e3:7.1f} ms/step", flush=True)
    torch.set_num_threads(default_threads)
    return {"model": name, "weight_bytes": nbytes, "floor_s": floor,
            "packed_layers": packed, "rows": rows}


def measure_lora(name: str, batches: list[int], tokens: int, bandwidth: float) -> dict[str, Any]:
    """A LoRA student as `make distill` trains it (r 16 on every linear layer): its rollouts' and evaluation's decode
    step with MKL, then with its frozen base layers packed (`pack_frozen_linears`; the head stays dense: the loss reads
    it). The adapters start at zero, so the greedy tokens must equal the dense model's."""
    from peft import LoraConfig, get_peft_model

    from hf_rockopd.models import pack_frozen_linears, resolve_causal_lm

    resolved = resolve_causal_lm(name)
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear")
    model, tokenizer = get_peft_model(resolved.model, config).eval(), resolved.tokenizer
    nbytes = weight_bytes(model)
    floor = nbytes / bandwidth
    rows, dense_ids, packed = [], {}, 0
    for mode in ("lora_mkl", "lora_packed_base"):
        if mode == "lora_packed_base":
            packed = pack_frozen_linears(model)
        for batch in batches:
            step, ids = decode_step(model, tokenizer, batch, tokens)
            same = None
            if mode == "lora_mkl":
                dense_ids[batch] = ids
            else:
                same = int((ids == dense_ids[batch]).all(dim=1).sum())
            rows.append(
                {"mode": mode, "batch": batch, "threads": torch.get_num_threads(), "step_s": step,
                 "ratio_to_floor": step / floor, "same_greedy_rows": same}
            )
            print(f"{name} {mode:16s} batch {batch:2d}: {step * 1e3:7.1f} ms/step = {step / floor:4.2f}x floor", flush=True)
    return {"model": name, "lora": {"r": 16, "target_modules": "all-linear"}, "weight_bytes": nbytes, "floor_s": floor,
            "packed_layers": packed, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    """The decode table of docs/performance.md."""
    lines = [
        f"Processor: {result['processor']}; {result['threads']} threads; read bandwidth "
        f"{result['bandwidth_gb_s']:.1f} GB/s; {result['tokens']} greedy tokens per measurement, prefill excluded.",
        "",
        "| model | weights | floor / step | batch | MKL (before) | packed body | packed body + head | same greedy tokens |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for entry in result["models"]:
        default = [r for r in entry["rows"] if r["threads"] == result["threads"]]
        by = {(r["mode"], r["batch"]): r for r in default}
        if any(mode not in {r["mode"] for r in default} for mode in MODES):
            continue  # a partial run (`--modes`): its rows are in the JSON
        for batch in sorted({r["batch"] for r in default}):
            cells = [
                f"{r['step_s'] * 1e3:.0f} ms ({r['ratio_to_floor']:.2f}x)"
                for r in (by[("mkl", batch)], by[("packed", batch)], by[("packed_head", batch)])
            ]
            same = "; ".join(f"{by[(m, batch)]['same_greedy_rows']}/{batch}" for m in ("packed", "packed_head"))
            lines.append(
                f"| {entry['model'].split('/')[-1]} | {entry['weight_bytes'] / 1e9:.2f} GB | {entry['floor_s'] * 1e3:.0f} ms "
                f"| {batch} | {' | '.join(cells)} | {same} rows |"
            )
    for entry in result.get("lora_models", []):
        by = {(r["mode"], r["batch"]): r for r in entry["rows"]}
        if lines[-1] != "":
            lines += ["", "A LoRA student (r 16, every linear layer) as `make distill` decodes its rollouts (batch 2) and "
                      "evaluation answers (batch 8):", "",
                      "| model | weights | floor / step | batch | MKL (before) | packed base layers | same greedy tokens |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
        for batch in sorted({r["batch"] for r in entry["rows"]}):
            mkl, packed = by[("lora_mkl", batch)], by[("lora_packed_base", batch)]
            lines.append(
                f"| {entry['model'].split('/')[-1]} + LoRA | {entry['weight_bytes'] / 1e9:.2f} GB | "
                f"{entry['floor_s'] * 1e3:.0f} ms | {batch} | {mkl['step_s'] * 1e3:.0f} ms ({mkl['ratio_to_floor']:.2f}x) | "
                f"{packed['step_s'] * 1e3:.0f} ms ({packed['ratio_to_floor']:.2f}x) | {packed['same_greedy_rows']}/{batch} rows |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"]
    )
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 16])
    parser.add_argument("--tokens", type=int, default=24, help="Greedy tokens per measurement (after a warm-up).")
    parser.add_argument("--threads", nargs="*", type=int, default=[1], help="Other thread counts tried at batch 8.")
    parser.add_argument(
        "--lora_models", nargs="*", default=["Qwen/Qwen2.5-Coder-0.5B-Instruct"], help="Measured again under LoRA."
    )
    parser.add_argument("--lora_batches", nargs="+", type=int, default=[2, 8])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="Rows measured per model.")
    parser.add_argument("--interop_threads", type=int, default=None, help="torch.set_num_interop_threads first.")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode.json"))
    args = parser.parse_args(argv)
    if args.interop_threads is not None:
        torch.set_num_interop_threads(args.interop_threads)
    torch.manual_seed(0)
    bandwidth = read_bandwidth()
    print(f"{cpu_description()}: read bandwidth {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads", flush=True)
    result = {
        "processor": cpu_description(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg(),
        "bandwidth_gb_s": bandwidth / 1e9,
        "tokens": args.tokens,
        "interop_threads": torch.get_num_interop_threads(),
        "environment": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "MKL_", "GOMP_"))},
        "models": [
            measure_model(m, args.batches, args.tokens, bandwidth, args.threads, tuple(args.modes)) for m in args.models
        ],
        "lora_models": [measure_lora(m, args.lora_batches, args.tokens, bandwidth) for m in args.lora_models],
    }
    result["load_average_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    Path(args.out).with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
