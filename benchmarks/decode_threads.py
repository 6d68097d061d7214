"""Thread and OpenMP settings for CPU generation: the packed teacher's decode step under each setting.

OpenMP reads its environment when the process starts, so every setting is a fresh `python -m benchmarks.decode`
process (the packed teacher, body and head, at batch 8, as `eval` and the lab run it); the step of each is printed
against the default's, from one run of this script. Intra-op threads (`torch.set_num_threads`) are measured by
`benchmarks.decode --threads` itself.

```
python -m benchmarks.decode_threads          # 2 rounds of 5 settings, about 15 minutes on 2 cores
```
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .loss_path import cpu_description


ROOT = Path(__file__).resolve().parents[1]
# What each setting is: libgomp's (torch's OpenMP on Linux wheels) wait policy decides whether idle threads spin
# between the many small parallel regions of a decode step or sleep; binding pins a thread to a core.
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "OMP_WAIT_POLICY=ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "OMP_PROC_BIND=close OMP_PLACES=cores": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
    "interop threads 1": {},
}


def run_setting(name: str, env: dict[str, str], model: str, batch: int, tokens: int) -> dict[str, Any]:
    """One fresh process under `env`: its packed step at `batch` (seconds) and its processor line."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decode.json"
        command = [sys.executable, "-m", "benchmarks.decode", "--models", model, "--batches", str(batch), "--tokens",
                   str(tokens), "--threads", "--lora_models", "--modes", "packed_head", "--out", str(out)]
        if name == "interop threads 1":
            command += ["--interop_threads", "1"]
        subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    (row,) = result["models"][0]["rows"]
    return {"setting": name, "env": env, "interop_threads": result["interop_threads"], "step_s": row["step_s"],
            "ratio_to_floor": row["ratio_to_floor"], "bandwidth_gb_s": result["bandwidth_gb_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument(
        "--repeats", type=int, default=2, help="Rounds over all settings (round-robin, so a drift of the host's speed "
        "reaches every setting alike)."
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_threads.json"))
    args = parser.parse_args(argv)
    runs = []
    for round_ in range(args.repeats):
        for name in args.settings:
            runs.append({"round": round_, **run_setting(name, SETTINGS[name], args.model, args.batch, args.tokens)})
            print(f"round {round_} {name:40s} {runs[-1]['step_s'] * 1e3:7.1f} ms/step "
                  f"(read bandwidth {runs[-1]['bandwidth_gb_s']:.1f} GB/s)", flush=True)
    # Each setting against the default of the same round: the host's speed moves between rounds.
    rows = []
    for name in args.settings:
        steps = [r["step_s"] for r in runs if r["setting"] == name]
        ratios = [
            r["step_s"] / next(d["step_s"] for d in runs if d["setting"] == args.settings[0] and d["round"] == r["round"])
            for r in runs if r["setting"] == name
        ]
        rows.append({"setting": name, "env": SETTINGS[name], "steps_s": steps, "ratios_to_first": ratios})
    result = {"processor": cpu_description(), "model": args.model, "batch": args.batch, "tokens": args.tokens,
              "first_setting": args.settings[0], "load_average_at_end": os.getloadavg(), "rows": rows, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"Processor: {result['processor']}; {args.model}, packed body + head, batch {args.batch}, "
             f"{args.tokens} greedy tokens, one process per setting and round, {args.repeats} rounds.", "",
             f"| setting | step, each round | × {args.settings[0]} of the same round |", "| --- | --- | --- |"]
    lines += [
        f"| {r['setting']} | {', '.join(f'{x * 1e3:.0f} ms' for x in r['steps_s'])} | "
        f"{', '.join(f'{x:.2f}' for x in r['ratios_to_first'])} |"
        for r in rows
    ]
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
