"""Greedy decode steps against the memory floor, before (MKL) and after (oneDNN-packed linears), on the Qwen pair.

Issue 29. A decode step reads every weight once, so its floor is the model's weight bytes over the machine's read
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


def measure_model(name: str, batches: list[int], tokens: int, bandwidth: float, threads: list[int]) -> dict[str, Any]:
    """The dense and the packed rows of one model; the same model object is packed in place between them."""
    from hf_rockopd.models import pack_for_inference, resolve_causal_lm

    resolved = resolve_causal_lm(name)
    model, tokenizer = resolved.model.eval(), resolved.tokenizer
    nbytes = weight_bytes(model)
    floor = nbytes / bandwidth
    rows, dense_ids = [], {}
    packed = 0
    # One model, packed in place step by step: the body's linears (what `distill` does to its teacher, whose head the
    # loss projects through), then the head too (what `eval`, the lab and `serve-teacher` do).
    for mode in ("mkl", "packed", "packed_head"):
        if mode != "mkl":
            packed += pack_for_inference(model, skip=("lm_head",) if mode == "packed" else ())
        for batch in batches:
            step, ids = decode_step(model, tokenizer, batch, tokens)
            same = None
            if mode == "mkl":
                dense_ids[batch] = ids
            else:
                same = int((ids == dense_ids[batch]).all(dim=1).sum())
            rows.append(
                {"mode": mode, "batch": batch, "threads": torch.get_num_threads(), "step_s": step,
                 "ratio_to_floor": step / floor, "same_greedy_rows": same}
            )
            print(f"{name} {mode:11s} batch {batch:2d}: {step * 1e3:7.1f} ms/step = {step / floor:4.2f}x floor", flush=True)
    default_threads = torch.get_num_threads()
    for count in threads:
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


def markdown(result: dict[str, Any]) -> str:
    """The README's decode table."""
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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"]
    )
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 16])
    parser.add_argument("--tokens", type=int, default=24, help="Greedy tokens per measurement (after a warm-up).")
    parser.add_argument("--threads", nargs="*", type=int, default=[1], help="Other thread counts tried at batch 8.")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode.json"))
    args = parser.parse_args(argv)
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
        "models": [measure_model(m, args.batches, args.tokens, bandwidth, args.threads) for m in args.models],
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
