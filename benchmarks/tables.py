"""Markdown tables of the benchmark JSON files, pasted into BENCHMARKS.md (numbers are never typed by hand).

    python -m benchmarks.tables benchmarks/results/loss_path.json [benchmarks/results/train_step_tiny.json ...]
"""

from __future__ import annotations

import json
import sys


__all__ = ["gpu_loss_table", "gpu_step_table", "loss_path_table", "train_step_table"]

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
        statuses = (record.get("status", {}).get(impl), record.get("time_status", {}).get(impl))
        return "OOM" if "OOM" in statuses else "—"
    return f"{t:.2f}"


def _referee(record: dict) -> str:
    """Max relative difference to the float64 reference of ours and each anchor, where it was computed."""
    referee = record.get("referee") or {}
    if not referee:
        return "—"
    return " / ".join(f"{max(referee[i].values()):.1e}" if i in referee else "—" for i in ("rockopd", "gkd", "distillation"))


def loss_path_table(records: list[dict]) -> str:
    """One row per case: median time (s) and peak memory (GiB) per implementation, ratios, agreement.

    A `chunk` column appears when some case ran with another `loss_chunk_size` than 512, and columns of our divergence
    path (`--divergence-path`) when some case timed or measured it."""
    with_chunk = any(r["case"].get("chunk_size", 512) != 512 for r in records)
    with_div = any("rockopd_divergence" in r.get("status", {}) for r in records)
    cols = ["H", "V", "L", "beta", "frozen"] + (["chunk"] if with_chunk else [])
    cols += ["ours s", "GKD s", "Distill s", "ours uniform s"] + (["ours div. path s"] if with_div else [])
    cols += ["ours GiB", "GKD GiB", "Distill GiB"] + (["ours div. path GiB"] if with_div else [])
    cols += ["time ours/GKD", "time ours/Distill", "time frozen/uniform", "mem ours/GKD", "mem ours/Distill"]
    cols += ["time div. path/ours", "mem div. path/ours"] if with_div else []
    cols += ["max rel. diff", "vs float64: ours / GKD / Distill"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        c, q = r["case"], r.get("ratios", {})
        diffs = [v for a in r.get("agreement", {}).values() for v in a.values()]

        def ratio(key: str) -> str:
            return f"{q[key]:.2f}" if key in q else "—"

        cells = [str(c[k]) for k in ("hidden", "vocab", "length", "beta", "frozen")]
        cells += [str(c.get("chunk_size", 512))] if with_chunk else []
        cells += [_time(r, i) for i in ("rockopd", "gkd", "distillation", "rockopd_uniform")]
        cells += [_time(r, "rockopd_divergence")] if with_div else []
        cells += [_mem(r, i) for i in ("rockopd", "gkd", "distillation")]
        cells += [_mem(r, "rockopd_divergence")] if with_div else []
        cells += [ratio(k) for k in ("time_vs_gkd", "time_vs_distillation", "time_vs_own_uniform", "mem_vs_gkd")]
        cells += [ratio("mem_vs_distillation")]
        cells += [ratio("divergence_path_vs_fused_time"), ratio("divergence_path_vs_fused_mem")] if with_div else []
        cells += [f"{max(diffs):.1e}" if diffs else "—", _referee(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def train_step_table(result: dict) -> str:
    """Phase medians of each trainer pair (GKD, and Distillation when present) and the ratios ours / TRL's."""
    keys = [("generation_s", "generation (s)"), ("loss_forward_s", "loss forward (s)"), ("backward_s", "backward (s)"),
            ("loss_backward_s", "loss + backward (s)"), ("optimizer_s", "optimizer (s)"), ("total_s", "total step (s)"),
            ("peak_bytes", "peak memory (MiB)"), ("completion_tokens", "completion tokens / step"),
            ("completion_tokens_per_s", "completion tokens / s")]  # fmt: skip
    # Each pair (TRL's trainer, ours, their ratio) that the results file holds; older files hold the GKD pair only.
    pairs = [(base, ours, ratios, head) for base, ours, ratios, head in (
        ("gkd", "rockopd", "ratios", "GKDTrainer | RockOPDTrainer | ours / GKD"),
        ("distillation", "rockdistillation", "ratios_distillation",
         "DistillationTrainer | RockDistillationTrainer | ours / Distillation"),
    ) if base in result and ours in result]  # fmt: skip
    out = "| phase | " + " | ".join(p[3] for p in pairs) + " |\n|---|" + "---|---|---|" * len(pairs) + "\n"
    for key, label in keys:
        scale = 1 / 2**20 if key == "peak_bytes" else 1
        cells = []
        for base, ours, ratios, _ in pairs:
            g, o = result[base]["median"][key], result[ours]["median"][key]
            cells.append(f"{g * scale:.2f} | {o * scale:.2f} | {result[ratios].get(key, float('nan')):.2f}")
        out += f"| {label} | " + " | ".join(cells) + " |\n"
    return out


def gpu_loss_table(records: list[dict]) -> str:
    """`benchmarks.gpu` loss-path cases: bf16 median times (ms) and peak memory (GiB), ratios, the float32 agreement
    and each implementation's bf16 distance to float64 (loss / worst gradient)."""
    impls = ("rockopd", "rockopd_eager", "gkd", "distillation")
    with_eager = any("rockopd_eager" in r.get("median_s", {}) for r in records)
    shown = [i for i in impls if with_eager or i != "rockopd_eager"]
    names = {"rockopd": "ours", "rockopd_eager": "ours eager", "gkd": "GKD", "distillation": "Distill"}
    cols = ["H s/t", "V", "L", "beta", "frozen", "chunk"] + [f"{names[i]} ms" for i in shown] + ["ours uniform ms"]
    cols += [f"{names[i]} GiB" for i in ("rockopd", "gkd", "distillation")]
    cols += ["time ours/GKD", "time ours/Distill", "time frozen/uniform", "mem ours/GKD", "mem ours/Distill"]
    cols += ["compiled/eager"] if with_eager else []
    cols += ["fp32 max rel. diff to ours", "bf16 vs float64: ours / GKD / Distill"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        c, q, med = r["case"], r.get("ratios", {}), r.get("median_s", {})
        if "error" in r:
            lines.append(f"| {c['hidden']} | {c['vocab']} | {c['length']} | {c['beta']} | {c['frozen']} | error: "
                         f"{r['error'][:80]} |")  # fmt: skip
            continue

        def ratio(key: str) -> str:
            return f"{q[key]:.2f}" if key in q else "—"

        def ms(impl: str) -> str:
            return f"{med[impl] * 1e3:.1f}" if impl in med else r.get("status", {}).get(impl, "—")

        def bf16(impl: str) -> str:
            d = r.get("bf16_vs_float64", {}).get(impl)
            return f"{d['loss_rel']:.0e}/{max(d['grad_h_rel'], d['grad_w_rel']):.0e}" if d else "—"

        anchors = [a for name, a in r.get("agreement", {}).items() if name != "rockopd_eager"]
        diffs = [v for a in anchors for v in a.values()]
        cells = [f"{c['hidden']}/{c.get('teacher_hidden') or c['hidden']}", str(c["vocab"]), str(c["length"])]
        cells += [str(c["beta"]), str(c["frozen"]), str(c.get("chunk_size", 512))]
        cells += [ms(i) for i in shown] + [ms("rockopd_uniform")]
        cells += [_mem(r, i) for i in ("rockopd", "gkd", "distillation")]
        cells += [ratio(k) for k in ("time_vs_gkd", "time_vs_distillation", "time_vs_own_uniform", "mem_vs_gkd")]
        cells += [ratio("mem_vs_distillation")] + ([ratio("compiled_vs_eager_time")] if with_eager else [])
        cells += [f"{max(diffs):.1e}" if diffs else "—", " / ".join(bf16(i) for i in ("rockopd", "gkd", "distillation"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gpu_step_table(records: list[dict]) -> str:
    """`benchmarks.gpu` training steps: per student variant, both trainers' phase medians and ours / GKD."""
    keys = [("generation_s", "generation s"), ("loss_backward_s", "loss + backward s"), ("optimizer_s", "optimizer s"),
            ("total_s", "total step s"), ("peak_bytes", "step peak GiB"), ("peak_allocated_bytes", "device peak GiB"),
            ("completion_tokens_per_s", "completion tokens/s")]  # fmt: skip
    by = {(r["variant"], r["trainer"]): r for r in records}
    lines = ["| student | phase | GKDTrainer | RockOPDTrainer | ours / GKD |", "|---|---|---|---|---|"]
    for variant in dict.fromkeys(r["variant"] for r in records):
        gkd, ours = by.get((variant, "gkd"), {}), by.get((variant, "rockopd"), {})
        if "median" not in gkd or "median" not in ours:
            lines.append(f"| {variant} | failed: {(gkd.get('error') or ours.get('error') or '')[-80:]!r} | | | |")
            continue
        label = f"{variant} ({ours['trainable_params'] / 1e6:.1f} M trainable)"
        for key, name in keys:
            if key not in gkd["median"] or key not in ours["median"]:  # the device peak exists on CUDA only
                continue
            g, o = gkd["median"][key], ours["median"][key]
            scale = 1 / GIB if "bytes" in key else 1
            lines.append(f"| {label} | {name} | {g * scale:.3g} | {o * scale:.3g} | {o / g:.2f} |")
            label = ""
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    for path in argv if argv is not None else sys.argv[1:]:
        with open(path) as f:
            data = json.load(f)
        print(f"<!-- {path} -->")
        if data.get("meta", {}).get("benchmark") == "gpu":
            print(gpu_loss_table(data["loss_path"]) + "\n\n" + gpu_step_table(data["train_step"]))
        else:
            print(loss_path_table(data["records"]) if "records" in data else train_step_table(data))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
