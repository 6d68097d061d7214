"""Scaling of the loss path: fitted growth of peak memory and of time with B·L·V, and a plot, from `loss_path.json`.

For each implementation, the uniform-weight cases with `beta` 0 or 1 (the same operations) of one head shape (the
most common `(H, V)` in the records: the length sweep) are fitted as `y = a · (B·L·V)^k` by least squares in log-log
(`scipy.stats.linregress`): `k ≈ 1` is linear in the logits size, `k ≈ 0` flat.

Run: `python -m benchmarks.scaling benchmarks/results/loss_path.json --plot benchmarks/results/scaling.png`
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter

from scipy import stats


__all__ = ["fit_growth", "plot"]

GIB = 1024**3
IMPLS = ("rockopd", "gkd", "distillation")
QUANTITIES = {"memory": "peak_bytes", "time": "median_s"}


def _sweep_shape(records: list[dict]) -> tuple[int, int] | None:
    shapes = Counter((r["case"]["hidden"], r["case"]["vocab"]) for r in records)
    return shapes.most_common(1)[0][0] if shapes else None


def _points(records: list[dict], impl: str, quantity: str) -> list[tuple[int, int, float]]:
    key, shape = QUANTITIES[quantity], _sweep_shape(records)
    out = []
    for r in records:
        c = r["case"]
        # beta 0 and 1 run the same operations (two log-softmaxes and one KL); the mixture is another family.
        if (c["hidden"], c["vocab"]) != shape or c["beta"] not in (0.0, 1.0) or c["frozen"] != 0.0:
            continue
        if c.get("chunk_size", 512) != 512:  # another chunk is another memory floor, not a point of the sweep
            continue
        if impl in r.get(key, {}):
            out.append((c["batch"] * c["length"] * c["vocab"], c["length"], r[key][impl]))
    return sorted(out)


def fit_growth(records: list[dict], quantity: str = "memory") -> dict:
    """Per implementation, the exponent `k` of `quantity ∝ (B·L·V)^k` and the points it was fitted on.

    Args:
        records (`list[dict]`): records of `benchmarks.loss_path` (pooled over files).
        quantity (`str`, *optional*, defaults to `"memory"`): `"memory"` (peak bytes) or `"time"` (median seconds).

    Example:
    ```python
    >>> from benchmarks.scaling import fit_growth
    >>> recs = [{"case": {"hidden": 4, "beta": 1.0, "frozen": 0.0, "batch": 1, "length": n, "vocab": 10},
    ...          "peak_bytes": {"gkd": 8 * n}} for n in (10, 100)]
    >>> round(fit_growth(recs)["gkd"]["exponent"], 3)
    1.0
    ```
    """
    if quantity not in QUANTITIES:
        raise ValueError(f"quantity must be one of {sorted(QUANTITIES)}, got {quantity!r}.")
    out = {}
    for impl in IMPLS:
        pts = _points(records, impl, quantity)
        if len(pts) < 2:
            continue
        fit = stats.linregress([math.log(p[0]) for p in pts], [math.log(p[2]) for p in pts])
        out[impl] = {
            "exponent": float(fit.slope),
            "points": [{"blv": p[0], "length": p[1], QUANTITIES[quantity]: p[2]} for p in pts],
        }
    return out


def plot(records: list[dict], path: str, cap_gib: float | None = None) -> None:
    """Peak memory and time against B·L·V (log-log) for each implementation; memory OOMs marked at the cap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shape = _sweep_shape(records)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, quantity in zip(axes, ("memory", "time")):
        scale = GIB if quantity == "memory" else 1.0
        for impl, marker in zip(IMPLS, "os^"):
            pts = _points(records, impl, quantity)
            if pts:
                ax.plot([p[0] for p in pts], [p[2] / scale for p in pts], marker=marker, label=impl)
            if quantity == "memory" and cap_gib:
                ooms = [
                    r["case"]
                    for r in records
                    if r.get("status", {}).get(impl) == "OOM"
                    and (r["case"]["hidden"], r["case"]["vocab"]) == shape
                    and r["case"]["frozen"] == 0.0
                ]
                if ooms:
                    xs = [c["batch"] * c["length"] * c["vocab"] for c in ooms]
                    ax.scatter(xs, [cap_gib] * len(xs), marker="x", color="red", label=f"{impl} OOM (cap)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("B·L·V (logits elements)")
        ax.set_ylabel("peak RSS over baseline (GiB)" if quantity == "memory" else "median fwd+bwd time (s)")
        ax.set_title(f"loss path {quantity}, beta 0/1, H={shape[0]} V={shape[1]}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="loss_path.json file(s); their records are pooled")
    parser.add_argument("--plot", default=None, help="PNG to write")
    parser.add_argument("--out", default=None, help="JSON of the fits")
    args = parser.parse_args(argv)
    records, cap = [], None
    for path in args.results:
        with open(path) as f:
            data = json.load(f)
        records += data["records"]
        cap = data.get("meta", {}).get("budget_gib", cap)
    fits = {quantity: fit_growth(records, quantity) for quantity in QUANTITIES}
    for quantity, by_impl in fits.items():
        for impl, fit in by_impl.items():
            print(f"{impl}: {quantity} ∝ (B·L·V)^{fit['exponent']:.2f} over {len(fit['points'])} points")
    if args.plot:
        plot(records, args.plot, cap)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(fits, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
