"""LoRA against full fine-tuning on the CPU default, row by row in one run of this script:
the held-out greedy accuracy at the end and the wall time of each row, at equal steps.

    python benchmarks/lora.py [--steps 300] [--only NAME,...] [--keep DIR] [NAME="job.py flags" ...]

Without rows it runs the sweep below: full fine-tuning, LoRA with its defaults at ranks 16,
4 and 64, then one rate for A and B (`--lora-b-lr 1`) at 1x and 3x full's 1e-3, the setting
the defaults replaced. A row given on the command line (name="flags") runs instead. Each
row is `bash launch.sh` with an eval at the start and the end only, so the rows' evals cost
alike.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from real_model import processor  # names the CPU's bf16 flags: they decide the dtype

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = [
    ("full", ""),
    ("r16", "--lora-rank 16"),
    ("r4", "--lora-rank 4"),
    ("r64", "--lora-rank 64"),
    ("r16 one rate 1x", "--lora-rank 16 --lr 1e-3 --lora-b-lr 1"),
    ("r16 one rate 3x", "--lora-rank 16 --lr 3e-3 --lora-b-lr 1"),
]


def run_row(flags, steps, keep):
    """One launch.sh run: (final held-out accuracy, first, wall seconds, metrics rows).
    keep: a folder to leave the run in (its metrics.jsonl), else a temporary one."""
    with tempfile.TemporaryDirectory() as tmp:
        out = keep or os.path.join(tmp, "run")
        cmd = ["bash", "launch.sh", "--out-dir", out, "--steps", str(steps), "--eval-every", str(steps)]
        cmd += ["--samples-every", "0", *flags.split()]
        start = time.time()
        result = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall = time.time() - start
        if result.returncode != 0:
            print(result.stdout[-3000:])
            return None, None, wall, []
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
        return evals[-1], evals[0], wall, [r for r in rows if "grad_norm" in r]


def median(values):
    return sorted(values)[len(values) // 2] if values else float("nan")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--only", default="", help="comma-separated row names of the sweep")
    parser.add_argument("--keep", default="", help="leave each row's run in KEEP/<row name>")
    parser.add_argument("rows", nargs="*", help='name="flags" rows instead of the sweep')
    args = parser.parse_args()
    rows = [tuple(r.split("=", 1)) for r in args.rows] or ROWS
    if args.only:
        rows = [r for r in rows if r[0] in args.only.split(",")]
    print(f"{datetime.date.today()}, {processor()}, {args.steps} steps, tiny default")
    # The off-policy drift and the step sizes, for telling a collapse from slow learning:
    # the largest per-step mean |log pi_learner - log pi_sampler|, and the median and
    # largest gradient norm before clipping.
    print("| row | flags | held-out start | held-out end | max mismatch_mean | grad norm median, max | wall s |")
    print("|---|---|---|---|---|---|---|")
    for name, flags in rows:
        keep = os.path.join(args.keep, name.replace(" ", "_")) if args.keep else ""
        end, first, wall, train = run_row(flags, args.steps, keep)
        shown = f"{first:.3f} | {end:.3f}" if end is not None else "failed | failed"
        drift = max((r.get("mismatch_mean", float("nan")) for r in train), default=float("nan"))
        norms = [r["grad_norm"] for r in train]
        grads = f"{median(norms):.2f}, {max(norms, default=float('nan')):.2f}"
        print(
            f"| {name} | `{flags or '(full fine-tuning)'}` | {shown} | {drift:.3f} | {grads} | {wall:.0f} |", flush=True
        )


if __name__ == "__main__":
    sys.exit(main())
