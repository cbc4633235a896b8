"""LoRA against full fine-tuning on the CPU default, row by row in one run of this script:
the held-out greedy accuracy at the end and the wall time of each row, at equal steps.

    python benchmarks/lora.py [--steps 300] [--only NAME,...] [NAME="job.py flags" ...]

Without rows it runs the sweep below: full fine-tuning, then LoRA over the learning rate
(as a multiple of full's 1e-3), the rank, the targets, alpha and the initialisation. A row
given on the command line (name="flags") runs instead. Each row is `bash launch.sh` with an
eval at the start and the end only, so the rows' evals cost alike.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
ROWS = [
    ("full", ""),
    ("r16 lr 1x", "--lora-rank 16 --lr 1e-3"),
    ("r16 lr 3x", "--lora-rank 16 --lr 3e-3"),
    ("r16 lr 10x", "--lora-rank 16 --lr 1e-2"),
    ("r16 lr 30x", "--lora-rank 16 --lr 3e-2"),
]


def processor():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


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
    print(f"{datetime.date.today()}, {processor()}, {os.cpu_count()} cores, {args.steps} steps, tiny default")
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
