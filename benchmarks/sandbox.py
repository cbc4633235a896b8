"""What the sandbox costs: calls per second through sandbox.run against plain exec in a
reward worker, for a trivial program and a 100 ms one, with bubblewrap and with the
fallback (GRPO_SANDBOX=fallback), each mode in a process of its own.

    python benchmarks/sandbox.py [--calls 40]

Plain exec is the README's old example: the program exec'd inside a worker process
that is already running (no process start per call)."""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = {
    "trivial": "x = 1 + 1",
    "100 ms": "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 0.1:\n    pass",
}
MEASURE = """
import json, sys, time
sys.path.insert(0, {root!r})
import sandbox
kind, line = sandbox.mode()
rates = {{}}
for name, code in {programs!r}.items():
    start = time.perf_counter()
    for _ in range({calls}):
        assert sandbox.run(code, timeout=10)["error"] is None
    rates[name] = {calls} / (time.perf_counter() - start)
print(json.dumps({{"mode": kind, "line": line, "rates": rates}}))
"""


def plain_exec(calls):
    rates = {}
    for name, code in PROGRAMS.items():
        start = time.perf_counter()
        for _ in range(calls):
            exec(code, {})
        rates[name] = calls / (time.perf_counter() - start)
    return rates


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=40)
    calls = parser.parse_args().calls
    rows = {"plain exec in a worker": plain_exec(calls)}
    for forced in ("", "fallback"):
        env = {**os.environ, "GRPO_SANDBOX": forced}
        code = MEASURE.format(root=ROOT, programs=PROGRAMS, calls=calls)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.splitlines()[-1])
        rows[f"sandbox: {result['mode']}"] = result["rates"]
    print(f"{'calls per second':28s}" + "".join(f"{name:>12s}" for name in PROGRAMS))
    for label, rates in rows.items():
        print(f"{label:28s}" + "".join(f"{rates[name]:12.1f}" for name in PROGRAMS))


if __name__ == "__main__":
    main()
