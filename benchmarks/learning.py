"""The full learning check of the CPU default, as a researcher would run it: a fresh
model cache (so the tiny model's build and warm-up count), `bash launch.sh`, then the
held-out greedy accuracy at the start and the end, and the wall time.

    python benchmarks/learning.py [extra job.py flags]
"""

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "run")
    env = {**os.environ, "GRPO_CACHE": os.path.join(tmp, "cache")}
    start = time.time()
    result = subprocess.run(
        ["bash", "launch.sh", "--out-dir", out, *sys.argv[1:]],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wall = time.time() - start
    if result.returncode != 0:
        print(result.stdout[-4000:])
        sys.exit(f"launch.sh failed with exit code {result.returncode}")
    # What the user saw: the quiet console (a progress bar's redraws as their last frame).
    print("console:\n" + "\n".join("    " + line.rsplit("\r", 1)[-1] for line in result.stdout.split("\n")))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    evals = [r for r in rows if "eval_accuracy" in r]
    for r in evals:
        print(f"step {r['step']:4d}  eval accuracy {r['eval_accuracy']:.3f}  format {r['eval_format']:.3f}")
    first, last = evals[0]["eval_accuracy"], evals[-1]["eval_accuracy"]
    print(f"start accuracy {first:.3f}, end accuracy {last:.3f}, wall time {wall:.0f} s (build and warm-up included)")
    print(
        "PASS" if first <= 0.25 and last >= 0.85 and wall < 600 else "FAIL",
        "(target: start <= 0.25, end >= 0.85, under 600 s)",
    )
