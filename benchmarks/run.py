"""Run every benchmark in turn: loss path, its scaling fit and plot, and the training step on both pairs.

    python -m benchmarks.run [--full] [--skip-real]

Results go to `benchmarks/results/` (`loss_path.json`, `scaling.json`, `scaling.png`, `train_step_<pair>.json`).
One heavy process runs at a time; see BENCHMARKS.md for the sizes and how long each part takes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks import loss_path, scaling, train_step


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the full 72-case loss-path grid (many hours on 2 cores)")
    parser.add_argument("--skip-real", action="store_true", help="skip the SmolLM2 training-step benchmark")
    args = parser.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    lp = os.path.join(RESULTS, "loss_path.json")
    code = loss_path.main(["--out", lp] + (["--full"] if args.full else []))
    scaling.main([lp, "--plot", os.path.join(RESULTS, "scaling.png"), "--out", os.path.join(RESULTS, "scaling.json")])
    train_step.main(["--pair", "tiny", "--steps", "4", "--max-new-tokens", "128"])
    if not args.skip_real:
        train_step.main(["--pair", "smollm2", "--steps", "3", "--max-new-tokens", "128"])
    return code


if __name__ == "__main__":
    sys.exit(main())
