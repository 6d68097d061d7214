"""How many teacher log-probabilities does on-policy distillation need? The top-k tail-bin loss against the full one.

For a student / teacher pair, on completions the student samples itself (as in training) for held-out GSM8K prompts
and MATH-500 problems, and for each k: the sparse divergence's share of the full one per token, the loss's relative
error, the cosine between the LoRA gradients of the sparse and of the full loss (per batch), the Jaccard overlap of the
top-50 rock set by R(v) = count x mean divergence with the full-vocabulary one (and the rocks' categories), and the
bytes per completion token of vLLM's JSON answer. The teacher's top-k is what vLLM's `prompt_logprobs=k` lists: the
k most likely ids, plus the sampled token when it is outside them.

```
python -m benchmarks.topk --gsm8k ../shared/data/gsm8k/train.jsonl --math500 ../shared/data/math500/test.jsonl \
    --out examples/reports/topk
```

Resumable: rollouts and each measured batch are written as they finish, and a rerun skips what exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


from .loss_path import cpu_description


KS = (1, 4, 16, 64, 256)
BETAS = (0.0, 1.0)
ROCKS = 50


def _lora_student(student: torch.nn.Module, r: int, alpha: int) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    from peft import LoraConfig, get_peft_model

    from hf_rockopd.console import quiet_training

    with quiet_training():  # peft reads transformers' renamed `is_gradient_checkpointing` while it wraps
        model = get_peft_model(student, LoraConfig(r=r, lora_alpha=alpha, target_modules="all-linear", lora_dropout=0.0))
    return model, [p for p in model.parameters() if p.requires_grad]


def _problems(path: str | None, kind: str, limit: int, seed: int) -> list[list[dict[str, str]]]:
    """Chats of `limit` prompts: GSM8K's held-out tail (as `hf-rockopd distill` holds it out), or a seeded draw of
    MATH-500."""
    from hf_rockopd.data.chat import question_messages, read_jsonl

    if path is None:
        return []
    rows = [row for _, row in read_jsonl(path)]
    if kind == "gsm8k":
        chosen = rows[-limit:]
    else:
        chosen = random.Random(seed).sample(rows, limit)
    return [question_messages(row["question" if kind == "gsm8k" else "problem"]) for row in chosen]


def _rollouts(out: Path, name: str, student, tokenizer, prompts, max_new_tokens: int, seed: int) -> dict[str, Any]:
    """The student's sampled completions (temperature 1, as on-policy training samples), cached in `out`."""
    from hf_rockopd.evaluation.rollout import generate_completions

    path = out / f"rollouts_{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    torch.manual_seed(seed)
    prompt_ids, completion_ids = generate_completions(
        student, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=len(prompts), do_sample=True
    )
    data = {"prompt_ids": prompt_ids, "completion_ids": completion_ids}
    path.write_text(json.dumps(data))
    return data


@torch.no_grad()
def _teacher_rows(teacher, ids, mask, prompt_len, rows_mask, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's hidden states and full log-probabilities `(N, V)` at the positions predicting completion
    tokens."""
    from hf_rockopd.models.introspection import backbone, logits_fn

    hidden = backbone(teacher)(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    hidden = hidden[:, prompt_len - 1 : -1][rows_mask]
    head = logits_fn(teacher)
    log_probs = torch.cat([torch.log_softmax(head(hidden[i : i + chunk]).float(), -1) for i in range(0, len(hidden), chunk)])
    return hidden, log_probs


def _wire_bytes(log_probs: torch.Tensor, tokens: torch.Tensor, k: int, tokenizer) -> float:
    """Bytes per completion token of vLLM's JSON `prompt_logprobs` for these positions (decoded tokens included)."""
    from hf_rockopd.teachers.protocol import prompt_logprobs_entry
    from hf_rockopd.teachers.sources import topk_with_own_token

    packed = topk_with_own_token(log_probs, tokens, k)
    entries = []
    for row, token in zip(packed, tokens.tolist()):
        ids, lps = row[0].long().tolist(), row[1].tolist()
        keep = [i for i, t in enumerate(ids) if t >= 0]
        ranks = list(range(1, k + 1))[: min(k, len(keep))]
        if len(keep) > k:  # the own token outside the top k, with its true rank
            ranks.append(int((log_probs[len(entries)] > log_probs[len(entries), token]).sum()) + 1)
        decode = lambda i: tokenizer.decode([i])  # noqa: E731
        entries.append(prompt_logprobs_entry([ids[i] for i in keep], [lps[i] for i in keep], ranks, decode))
    return len(json.dumps(entries).encode()) / max(len(entries), 1)


def measure_batch(student, lora_params, teacher, tokenizer, prompt_ids, completion_ids, ks, betas, wire: bool):
    """Per-token divergences (full and per k), losses and LoRA-gradient cosines of one batch."""
    from hf_rockopd.losses import chunked_weighted_loss
    from hf_rockopd.models.introspection import backbone, logits_fn
    from hf_rockopd.evaluation.rollout import pack_completions, pad_token_id
    from hf_rockopd.teachers.sources import topk_with_own_token

    ids, mask, prompt_len = pack_completions(prompt_ids, completion_ids, pad_token_id(tokenizer))
    rows = mask[:, prompt_len:].bool()
    tokens = ids[:, prompt_len:][rows]
    n = int(rows.sum())
    t0 = time.perf_counter()
    teacher_hidden, teacher_lp = _teacher_rows(teacher, ids, mask, prompt_len, rows)
    hidden = backbone(student)(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    student_hidden = hidden[:, prompt_len - 1 : -1][rows]
    student_head, teacher_head = logits_fn(student), logits_fn(teacher)
    weights = torch.ones(n)
    result: dict[str, Any] = {"tokens": tokens.tolist(), "n": n, "by_beta": {}}

    def loss_and_grad(teacher_rows, head, beta):
        loss, scores = chunked_weighted_loss(student_hidden, teacher_rows, student_head, head, weights, n, beta=beta)
        grads = torch.autograd.grad(loss, lora_params, retain_graph=True, allow_unused=True)
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, lora_params)])
        return float(loss.detach()), scores.divergence.tolist(), flat

    for beta in betas:
        full_loss, full_div, full_grad = loss_and_grad(teacher_hidden, teacher_head, beta)
        entry = {"full": {"loss": full_loss, "divergence": full_div}}
        for k in ks:
            packed = topk_with_own_token(teacher_lp, tokens, k)
            loss, div, grad = loss_and_grad(packed, None, beta)
            # In float64: torch's float32 cosine_similarity over ~9M entries is off by up to 6e-3 (values above 1).
            cosine = float(torch.nn.functional.cosine_similarity(grad.double(), full_grad.double(), dim=0))
            entry[str(k)] = {"loss": loss, "divergence": div, "grad_cosine": cosine}
        result["by_beta"][str(beta)] = entry
    if wire:
        result["wire_bytes_per_token"] = {str(k): _wire_bytes(teacher_lp, tokens, k, tokenizer) for k in ks}
    result["seconds"] = time.perf_counter() - t0
    return result


def _rock_set(tokens: np.ndarray, divergence: np.ndarray, exclude: set[int], top: int = ROCKS) -> list[int]:
    """The `top` token types by R(v) = count x mean divergence = the summed divergence of the type."""
    totals: dict[int, float] = {}
    for t, d in zip(tokens.tolist(), divergence.tolist()):
        if t not in exclude:
            totals[t] = totals.get(t, 0.0) + d
    return [t for t, _ in sorted(totals.items(), key=lambda item: -item[1])[:top]]


def summarize(batches: dict[str, list[dict[str, Any]]], ks, betas, tokenizer) -> list[dict[str, Any]]:
    """One row per dataset, beta and k (k = "full" is the reference)."""
    from hf_rockopd.lab import token_category

    exclude = set(tokenizer.all_special_ids)
    rows = []
    for dataset, measured in batches.items():
        if not measured:
            continue
        tokens = np.concatenate([np.asarray(b["tokens"]) for b in measured])
        for beta in betas:
            key = str(beta)
            full = np.concatenate([np.asarray(b["by_beta"][key]["full"]["divergence"]) for b in measured])
            full_rocks = _rock_set(tokens, full, exclude)
            for k in ks:
                sparse = np.concatenate([np.asarray(b["by_beta"][key][str(k)]["divergence"]) for b in measured])
                scored = full > 1e-6  # a share of a zero divergence says nothing
                share = sparse[scored] / full[scored]
                errors = [abs(b["by_beta"][key][str(k)]["loss"] - b["by_beta"][key]["full"]["loss"])
                          / b["by_beta"][key]["full"]["loss"] for b in measured]  # fmt: skip
                cosines = [b["by_beta"][key][str(k)]["grad_cosine"] for b in measured]
                rocks = _rock_set(tokens, sparse, exclude)
                jaccard = len(set(rocks) & set(full_rocks)) / len(set(rocks) | set(full_rocks))
                categories = {}
                for name, chosen in (("full", full_rocks), ("topk", rocks)):
                    labels = [token_category(tokenizer.decode([t])) for t in chosen]
                    categories[name] = {c: labels.count(c) for c in sorted(set(labels))}
                wire = [b["wire_bytes_per_token"][str(k)] for b in measured if "wire_bytes_per_token" in b]
                rows.append({
                    "dataset": dataset, "beta": beta, "k": k, "batches": len(measured), "tokens": int(len(tokens)),
                    "share_median": float(np.median(share)), "share_q25": float(np.quantile(share, 0.25)),
                    "share_q75": float(np.quantile(share, 0.75)),
                    "loss_rel_error_mean": float(np.mean(errors)), "loss_rel_error_max": float(np.max(errors)),
                    "grad_cosine_mean": float(np.mean(cosines)), "grad_cosine_min": float(np.min(cosines)),
                    "rock_jaccard_top50": jaccard, "rock_categories": categories,
                    "wire_bytes_per_token": float(np.mean(wire)) if wire else None,
                })  # fmt: skip
    return rows


def write_report(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out / "topk.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# How many teacher log-probabilities does OPD need? (top-k + tail bin against the full vocabulary)",
        "",
        f"Pair: teacher `{meta['teacher']}`, student `{meta['student']}` (LoRA r{meta['lora_r']}, fresh adapters). "
        f"Completions sampled by the student at temperature 1, up to {meta['max_new_tokens']} tokens. "
        f"Machine: {meta['machine']}. Command: `{meta['command']}`.",
        "",
        "share: sparse / full divergence per completion token (median [q25, q75]); loss error: |L_k − L| / L per "
        "batch (mean, max); cosine: LoRA gradient of the sparse loss against the full one per batch (mean, min); "
        "Jaccard: top-50 rock set by R(v) against the full-vocabulary one (special tokens excluded); bytes: vLLM's "
        "JSON `prompt_logprobs` per completion token.",
        "",
        "| data | beta | k | share median [q25, q75] | loss error mean / max | grad cosine mean / min | Jaccard@50 "
        "| bytes / token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        wire = f"{r['wire_bytes_per_token']:,.0f}" if r["wire_bytes_per_token"] is not None else "–"
        lines.append(
            f"| {r['dataset']} | {r['beta']:g} | {r['k']} | {r['share_median']:.3f} [{r['share_q25']:.3f}, "
            f"{r['share_q75']:.3f}] | {r['loss_rel_error_mean']:.3f} / {r['loss_rel_error_max']:.3f} | "
            f"{r['grad_cosine_mean']:.4f} / {r['grad_cosine_min']:.4f} | {r['rock_jaccard_top50']:.2f} | {wire} |"
        )
    lines += ["", "Rock categories of the top-50 set (full vocabulary → top-k):", ""]
    for r in rows:
        lines.append(f"- {r['dataset']}, beta {r['beta']:g}, k {r['k']}: {r['rock_categories']['full']} → "
                     f"{r['rock_categories']['topk']}")  # fmt: skip
    (out / "topk.md").write_text("\n".join(lines) + "\n")

    panels = [("share_median", "divergence share (median)"), ("grad_cosine_mean", "LoRA gradient cosine (mean)"),
              ("rock_jaccard_top50", "rock-set Jaccard@50"), ("wire_bytes_per_token", "bytes per token (JSON)")]  # fmt: skip
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    for ax, (key, title) in zip(axes, panels):
        for dataset in dict.fromkeys(r["dataset"] for r in rows):
            for beta in dict.fromkeys(r["beta"] for r in rows):
                sel = [r for r in rows if r["dataset"] == dataset and r["beta"] == beta and r[key] is not None]
                if sel:
                    ax.plot([r["k"] for r in sel], [r[key] for r in sel], marker="o", label=f"{dataset}, beta {beta:g}")
        ax.set_xscale("log", base=2)
        if key == "wire_bytes_per_token":
            ax.set_yscale("log")
        ax.set_xlabel("k (teacher log-probabilities per position)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].axhline(0.99, color="grey", linestyle="--", linewidth=1)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Top-k teacher vs full vocabulary: {meta['teacher']} → {meta['student']}")
    fig.tight_layout()
    fig.savefig(out / "topk.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    parser.add_argument("--student", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--gsm8k", help="GSM8K jsonl; its last --problems questions are the held-out prompts")
    parser.add_argument("--math500", help="MATH-500 jsonl; --problems of them drawn with --seed")
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS))
    parser.add_argument("--betas", type=float, nargs="+", default=list(BETAS))
    parser.add_argument("--lora_r", type=int, default=16)
    parser.add_argument("--lora_alpha", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="examples/reports/topk")
    args = parser.parse_args(argv)

    from hf_rockopd.models import resolve_causal_lm

    out = Path(args.out)
    (out / "batches").mkdir(parents=True, exist_ok=True)
    student_resolved = resolve_causal_lm(args.student)
    tokenizer = student_resolved.tokenizer
    teacher = resolve_causal_lm(args.teacher, with_tokenizer=False).model.eval()
    student, lora_params = _lora_student(student_resolved.model, args.lora_r, args.lora_alpha)
    batches: dict[str, list[dict[str, Any]]] = {}
    for name, path in (("gsm8k", args.gsm8k), ("math500", args.math500)):
        prompts = _problems(path, name, args.problems, args.seed)
        if not prompts:
            continue
        data = _rollouts(out, name, student, tokenizer, prompts, args.max_new_tokens, args.seed)
        batches[name] = []
        for i, start in enumerate(range(0, len(prompts), args.batch_size)):
            path_i = out / "batches" / f"{name}_{i}.json"
            if not path_i.exists():
                stop = start + args.batch_size
                result = measure_batch(student, lora_params, teacher, tokenizer, data["prompt_ids"][start:stop],
                                       data["completion_ids"][start:stop], args.ks, args.betas, wire=i == 0)  # fmt: skip
                path_i.write_text(json.dumps(result))
                print(f"{name} batch {i}: {result['n']} tokens in {result['seconds']:.0f} s", flush=True)
            batches[name].append(json.loads(path_i.read_text()))
    rows = summarize(batches, args.ks, args.betas, tokenizer)
    meta = {
        "teacher": args.teacher, "student": args.student, "lora_r": args.lora_r, "max_new_tokens": args.max_new_tokens,
        "problems": args.problems, "seed": args.seed,
        "command": "python -m benchmarks.topk " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{cpu_description()}, {os.cpu_count()} cores, torch {torch.__version__}",
    }  # fmt: skip
    write_report(out, rows, meta)
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    main()
