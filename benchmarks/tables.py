"""Markdown tables of the benchmark JSON files, pasted into BENCHMARKS.md (numbers are never typed by hand).

    python -m benchmarks.tables benchmarks/results/loss_path.json [benchmarks/results/train_step_tiny.json ...]
"""

from __future__ import annotations

import json
import sys


__all__ = ["loss_path_table", "train_step_table"]

GIB = 1024**3


def _mem(record: dict, impl: str) -> str:
    status = record.get("status", {}).get(impl)
    if status is None:
        return "—"
    if status != "ok":
        return status
    return f"{record['peak_bytes'][impl] / GIB:.3f}"


def _time(record: dict, impl: str) -> str:
    t = record.get("median_s", {}).get(impl)
    if t is None:
        return "OOM" if record.get("status", {}).get(impl) == "OOM" else "—"
    return f"{t:.2f}"


def _referee(record: dict) -> str:
    """Max relative difference to the float64 reference of ours and each anchor, where it was computed."""
    referee = record.get("referee") or {}
    if not referee:
        return "—"
    return " / ".join(f"{max(referee[i].values()):.1e}" if i in referee else "—" for i in ("rockopd", "gkd", "distillation"))


def loss_path_table(records: list[dict]) -> str:
    """One row per case: median time (s) and peak memory (GiB) per implementation, ratios, agreement."""
    head = (
        "| H | V | L | beta | frozen | ours s | GKD s | Distill s | ours uniform s | ours GiB | GKD GiB | Distill GiB "
        "| time ours/GKD | time ours/Distill | time frozen/uniform | mem ours/GKD | mem ours/Distill | max rel. diff | vs float64: ours / GKD / Distill |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in records:
        c, q = r["case"], r.get("ratios", {})
        diffs = [v for a in r.get("agreement", {}).values() for v in a.values()]

        def ratio(key: str) -> str:
            return f"{q[key]:.2f}" if key in q else "—"

        rows.append(
            f"| {c['hidden']} | {c['vocab']} | {c['length']} | {c['beta']} | {c['frozen']} | {_time(r, 'rockopd')} "
            f"| {_time(r, 'gkd')} | {_time(r, 'distillation')} | {_time(r, 'rockopd_uniform')} | {_mem(r, 'rockopd')} "
            f"| {_mem(r, 'gkd')} | {_mem(r, 'distillation')} | {ratio('time_vs_gkd')} | {ratio('time_vs_distillation')} "
            f"| {ratio('time_vs_own_uniform')} | {ratio('mem_vs_gkd')} | {ratio('mem_vs_distillation')} "
            f"| {f'{max(diffs):.1e}' if diffs else '—'} | {_referee(r)} |"
        )
    return head + "\n".join(rows)


def train_step_table(result: dict) -> str:
    """Phase medians of both trainers and their ratio."""
    keys = [("generation_s", "generation (s)"), ("loss_forward_s", "loss forward (s)"), ("backward_s", "backward (s)"),
            ("loss_backward_s", "loss + backward (s)"), ("optimizer_s", "optimizer (s)"), ("total_s", "total step (s)"),
            ("peak_bytes", "peak memory (MiB)"), ("completion_tokens", "completion tokens / step"),
            ("completion_tokens_per_s", "completion tokens / s")]  # fmt: skip
    out = "| phase | GKDTrainer | RockOPDTrainer | ours / GKD |\n|---|---|---|---|\n"
    for key, label in keys:
        g, o = result["gkd"]["median"][key], result["rockopd"]["median"][key]
        scale = 1 / 2**20 if key == "peak_bytes" else 1
        out += f"| {label} | {g * scale:.2f} | {o * scale:.2f} | {result['ratios'].get(key, float('nan')):.2f} |\n"
    return out


def main(argv: list[str] | None = None) -> int:
    for path in argv if argv is not None else sys.argv[1:]:
        with open(path) as f:
            data = json.load(f)
        print(f"<!-- {path} -->")
        print(loss_path_table(data["records"]) if "records" in data else train_step_table(data))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
