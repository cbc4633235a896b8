"""Scoring: the tasks' rewards by name (tasks/: `accuracy`, `format`, `code_tests`, ...;
how names resolve is in tasks/__init__.py), user rewards by module:function, and their
weighted sum over a batch, with rewards run in worker processes under a timeout unless
they declare `fn.in_process`.

Every reward has the signature `fn(completion: str, record: dict) -> float`. `record`
holds every column of the dataset row, plus "prompt" (the user's message text),
"prompt_ids" and "step". A reward may declare the columns it reads as `fn.needs`, and a
finer row check as `fn.check(row) -> None or a reason`; the data loader skips and counts
the rows that fail them, and the instruction it scores as `fn.system_prompt`, which then
becomes the prompts' system message. A reward that declares `fn.in_process = True`
(`accuracy` and `format`: they never raise and run in time linear in the completion, with
only anchored or length-capped regexes, so no input can make them backtrack
catastrophically) is scored in the caller's process; any other runs in a worker."""

import atexit
import contextlib
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import time
import traceback

import sandbox
import tasks
from console import die_with_parent, warn_once
from plugins import load_function


def parse_reward_spec(spec):
    """'accuracy,format=0.5,task.name,my.module:fn=2' -> [(name, fn, weight)]: a task's
    reward by name (tasks/__init__.py) or any function by module:function. Raises
    ValueError with a readable message, so a bad flag fails before any model loads."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, weight = item.partition("=") if "=" in item else (item, "", "1")
        try:
            weight = float(weight)
        except ValueError:
            raise ValueError(f"reward weight of {name!r} is not a number: {weight!r}")
        if ":" in name:
            fn = load_function(name, "reward")
        elif (fn := tasks.find("REWARDS", name, "reward")) is None:
            raise ValueError(
                f"unknown reward {name!r}: use one of {tasks.defined('REWARDS')} (tasks/), task.name or module:function"
            )
        out.append((name, fn, weight))
    if not out:
        raise ValueError("no reward given")
    return out


# ---------------------------------------------------------------- scoring a batch

TIMEOUT = "timeout"
GRACE = 0.5  # seconds past a call's timeout before its worker is killed; a call that returns is judged by its own clock
_pools = {}


def score_batch(completions, records, reward_fns, step=0, timeout=10.0, workers=1):
    """Score completions[i] against records[i] under the weighted rewards:
    (totals, parts, counts), parts[i] = {name: value}. A call that raises or dies scores 0
    and counts as a reward error (its first traceback is printed once per reward); one
    that runs past `timeout` seconds scores 0 and counts as a reward timeout. counts =
    {reward_errors, reward_timeouts, rewards_failed: completions with a failed call,
    rewards: completions, sandbox_errors: the programs the calls ran in the sandbox that
    ended in an error}, all sums, so the samplers' counts add up."""
    parts, done, pooled, sandbox_errors = [{} for _ in completions], [], [], 0
    for i, (completion, record) in enumerate(zip(completions, records)):
        record = {**record, "step": step}
        for k, (name, fn, _) in enumerate(reward_fns):
            if getattr(fn, "in_process", False):
                done.append((i, name, float(fn(completion, record)), None))
            else:
                pooled.append((i, name, (k, completion, record)))
    if pooled:  # one pool per reward set, started on first use and kept: workers start once a run
        key = (tuple(name for name, _, _ in reward_fns), workers)
        if key not in _pools:
            _pools[key] = RewardPool(key[0], workers)
            atexit.register(_pools[key].close)
        results = _pools[key].run([call for _, _, call in pooled], timeout)
        done += [(i, name, value, error) for (i, name, _), (value, error, _) in zip(pooled, results)]
        sandbox_errors = sum(n for _, _, n in results)
    counts, failed = {"reward_errors": 0, "reward_timeouts": 0, "sandbox_errors": sandbox_errors}, set()
    for i, name, value, error in done:
        parts[i][name] = value
        if error:
            failed.add(i)
            counts["reward_timeouts" if error == TIMEOUT else "reward_errors"] += 1
            what = f"ran past --reward-timeout {timeout:g} s" if error == TIMEOUT else f"failed:\n{error.rstrip()}"
            warn_once((name, error == TIMEOUT), f"reward {name!r} {what}\n(scored 0; later ones are only counted)")
    totals = [sum(w * p[name] for name, _, w in reward_fns) for p in parts]
    return totals, parts, {**counts, "rewards_failed": len(failed), "rewards": len(completions)}


def check_failures(counts, max_fraction, step, source="rewards"):
    """Stop the run (SystemExit, one clear line) when more than `max_fraction`
    (--max-reward-errors) of a step's completions had a reward call fail, or of its
    episodes the environment (`source` "environment", episodes.py's counts): a broken
    reward or environment must not train on zeros or cut-short episodes for hours."""
    key = "reward" if source == "rewards" else "env"
    failed = counts["rewards_failed"] if key == "reward" else counts["env_errors"] + counts["env_timeouts"]
    total = counts["rewards"] if key == "reward" else counts["episodes"]
    what = "completions had a reward fail" if key == "reward" else "episodes had the environment fail"
    if total and failed > max_fraction * total:
        raise SystemExit(
            f"{source}: step {step}: {failed} of {total} {what} ({counts[f'{key}_errors']} errors, "
            f"{counts[f'{key}_timeouts']} timeouts), more than --max-reward-errors {max_fraction:g}; "
            "the first failure of each is printed above"
        )


# User rewards run in worker processes, not threads. A call that hangs or loops is killed
# at its timeout, where a hung thread would run on, keep its pool slot, hold the GIL against
# the sampler and keep the interpreter from exiting; and N processes run CPU-heavy rewards
# in parallel, which threads cannot under the GIL. Each worker is `python rewards.py SPEC`
# (fork+exec, so nothing of vLLM's threads or of the caller's __main__ comes along); it
# takes one call at a time over its stdin (pickled: the trainer's own data, whatever
# Python values a dataset row holds) and answers with one line of JSON (value, traceback
# or None, seconds, sandbox errors): a worker runs code the trainer does not trust, and
# unpickling its reply would run whatever it sent.
class RewardPool:
    def __init__(self, names, workers, start_timeout=120.0, raw=False):
        """raw: each call's value comes back as the function returned it (an environment's
        message), not as a float (a reward)."""
        self.spec, self.start_timeout, self.procs = ",".join(names), start_timeout, [None] * workers
        self.raw = raw

    def _spawn(self):
        path = [p or os.getcwd() for p in sys.path]  # the caller's imports resolve alike in the worker
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        command = [sys.executable, os.path.abspath(__file__), self.spec, *(["raw"] if self.raw else [])]
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        try:
            ready = (
                select.select([proc.stdout], [], [], self.start_timeout)[0] and proc.stdout.readline() == b'"ready"\n'
            )
        except Exception:  # EOF: the worker died loading the rewards
            ready = False
        if not ready:
            proc.kill()
            raise SystemExit(f"rewards: a worker for {self.spec!r} did not start (its error, if any, is above)")
        return proc

    def _kill(self, w):
        proc, self.procs[w] = self.procs[w], None
        proc.kill()
        status = proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
        return status

    def run(self, calls, timeout):
        """[(value, error, sandbox errors)] for calls [(function index, first, second argument)],
        error None, a traceback or TIMEOUT. Each worker has one call in flight; one past its
        deadline is killed."""
        results, todo, busy = [None] * len(calls), list(range(len(calls)))[::-1], {}  # busy: worker -> (call, sent at)
        while todo or busy:
            for w in range(len(self.procs)):
                if w not in busy and todo:
                    if self.procs[w] is None or self.procs[w].poll() is not None:
                        self.procs[w] = self._spawn()
                    i = todo.pop()
                    try:
                        pickle.dump(calls[i], self.procs[w].stdin)
                        self.procs[w].stdin.flush()
                        busy[w] = (i, time.monotonic())
                    except OSError:  # it died between calls
                        results[i] = (0.0, f"reward worker died (exit status {self._kill(w)})", 0)
            if not busy:
                continue
            wait = min(sent for _, sent in busy.values()) + timeout + GRACE - time.monotonic()
            ready = select.select([self.procs[w].stdout for w in busy], [], [], max(0.0, wait))[0]
            for w in list(busy):
                i, sent = busy[w]
                if self.procs[w].stdout in ready:
                    del busy[w]
                    try:
                        reply = json.loads(self.procs[w].stdout.readline())
                        value, error, n = reply["value"], reply["error"], reply["sandbox_errors"]
                        results[i] = (0.0, TIMEOUT, n) if reply["seconds"] > timeout else (value, error, n)
                    except Exception:  # EOF or not our JSON: the reward killed its worker (os._exit, a crash)
                        results[i] = (0.0, f"reward worker died (exit status {self._kill(w)})", 0)
                elif time.monotonic() > sent + timeout + GRACE:
                    del busy[w]
                    self._kill(w)
                    results[i] = (0.0, TIMEOUT, 0)
        return results

    def close(self):
        for w, proc in enumerate(self.procs):
            if proc is not None:
                self._kill(w)


def _serve(spec, raw=False):
    """A worker's loop: load the rewards, then answer calls until stdin closes."""
    die_with_parent()  # with the caller, even mid-call
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the caller, which ends its workers
    calls, out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # a reward that reads stdin or prints cannot touch the calls
    os.dup2(2, 1)  # or the replies: its prints, on import too, go to stderr, at once
    sys.stdout = sys.stderr
    fns = [fn for _, fn, _ in parse_reward_spec(spec)]
    out.write(b'"ready"\n')
    out.flush()
    while True:
        try:
            k, completion, record = pickle.load(calls)
        except EOFError:
            return
        start, errors = time.perf_counter(), sandbox.stopped
        try:
            value = fns[k](completion, record)
            value = value if raw else float(value)
            json.dumps(value)  # plain data only: a value that is not fails here, as the call's error
            error = None
        except Exception:
            value, error = 0.0, traceback.format_exc()
        seconds, n = time.perf_counter() - start, sandbox.stopped - errors
        out.write(
            json.dumps({"value": value, "error": error, "seconds": seconds, "sandbox_errors": n}).encode() + b"\n"
        )
        out.flush()


if __name__ == "__main__":
    _serve(sys.argv[1], raw=sys.argv[2:] == ["raw"])
