"""Scaling of the loss path: fitted growth of peak memory with B·L·V, and a plot, from `loss_path.json`.

For each implementation the peak memory of the uniform-weight cases with `beta` 0 or 1 (the same operations) is fitted as `memory = a · (B·L·V)^k`
(least squares in log-log, `scipy.stats.linregress`): `k ≈ 1` is linear in the logits size, `k ≈ 0` flat.

Run: `python -m benchmarks.scaling benchmarks/results/loss_path*.json --plot benchmarks/results/scaling.png`
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from scipy import stats


__all__ = ["fit_growth", "plot"]

GIB = 1024**3


def _points(records: list[dict], impl: str) -> list[tuple[int, int, float]]:
    out = []
    for r in records:
        c = r["case"]
        # beta 0 and 1 run the same operations (two log-softmaxes and one KL); the mixture is another family.
        if c["beta"] in (0.0, 1.0) and c["frozen"] == 0.0 and impl in r.get("peak_bytes", {}):
            out.append((c["batch"] * c["length"] * c["vocab"], c["length"], r["peak_bytes"][impl]))
    return sorted(out)


def fit_growth(records: list[dict]) -> dict:
    """Per implementation, the exponent `k` of `memory ∝ (B·L·V)^k` and the points it was fitted on.

    Example:
    ```python
    >>> from benchmarks.scaling import fit_growth
    >>> recs = [{"case": {"beta": 1.0, "frozen": 0.0, "batch": 1, "length": n, "vocab": 10},
    ...          "peak_bytes": {"gkd": 8 * n}} for n in (10, 100)]
    >>> round(fit_growth(recs)["gkd"]["exponent"], 3)
    1.0
    ```
    """
    out = {}
    for impl in ("rockopd", "gkd", "distillation"):
        pts = _points(records, impl)
        if len(pts) < 2:
            continue
        fit = stats.linregress([math.log(p[0]) for p in pts], [math.log(p[2]) for p in pts])
        out[impl] = {"exponent": float(fit.slope), "points": [{"blv": p[0], "length": p[1], "peak_bytes": p[2]} for p in pts]}
    return out


def plot(records: list[dict], path: str) -> None:
    """Peak memory against B·L·V (log-log) for each implementation, OOM points marked at the cap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for impl, marker in (("rockopd", "o"), ("gkd", "s"), ("distillation", "^")):
        pts = _points(records, impl)
        if pts:
            ax.plot([p[0] for p in pts], [p[2] / GIB for p in pts], marker=marker, label=impl)
        ooms = [r for r in records if r.get("status", {}).get(impl) == "OOM" and r["case"]["beta"] in (0.0, 1.0)
                and r["case"]["frozen"] == 0.0]  # fmt: skip
        for r in ooms:
            c = r["case"]
            ax.scatter([c["batch"] * c["length"] * c["vocab"]], [6.0], marker="x", color="red")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("B·L·V (logits elements)")
    ax.set_ylabel("peak RSS over baseline (GiB)")
    ax.set_title("Loss path fwd+bwd, beta 0/1, H=576 V=49152 (x: OOM at cap)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="loss_path.json file(s); their records are pooled")
    parser.add_argument("--plot", default=None, help="PNG to write")
    parser.add_argument("--out", default=None, help="JSON of the fits")
    args = parser.parse_args(argv)
    records = []
    for path in args.results:
        with open(path) as f:
            records += json.load(f)["records"]
    fits = fit_growth(records)
    for impl, fit in fits.items():
        print(f"{impl}: memory ∝ (B·L·V)^{fit['exponent']:.2f} over {len(fit['points'])} points")
    if args.plot:
        plot(records, args.plot)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(fits, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
