"""torch.profiler breakdown of one loss-path forward + backward, ours and TRL's chunked DistillationTrainer path.

    python -m benchmarks.profile_loss [--length 256] [--batch 1] [--beta 1.0] [--top 12]

Prints, per implementation, the operators with the largest self CPU time (after one unprofiled warm-up run).
"""

from __future__ import annotations

import argparse
import sys

from torch.profiler import ProfilerActivity, profile

from benchmarks.loss_path import LossCase, make_inputs, run_once


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--beta", type=float, default=1.0)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    case = LossCase(args.hidden, args.vocab, args.batch, args.length, args.beta, 0.0)
    inputs = make_inputs(case)
    for impl in ("rockopd", "distillation", "gkd"):
        run_once(impl, inputs, case)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_once(impl, inputs, case)
        total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
        print(f"\n=== {impl}: {total:.2f} s self CPU in total ===")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=40))
    return 0


if __name__ == "__main__":
    sys.exit(main())
