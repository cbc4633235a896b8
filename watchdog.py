"""Faults the job heals from: every rank's heartbeat in the job's store, a watchdog that
names a rank gone silent and ends the job, and, when torchrun restarts the job
(launch.sh's RESTARTS, torchrun's --max-restarts), the one line that says which rank
failed, why, and from which step the job goes on.

Why a heartbeat, beside the process groups' timeout: a collective must be allowed to wait
as long as the longest honest step (a sampler's long completions, a checkpoint of a large
model), minutes to tens of minutes (--timeout-minutes), but a heartbeat comes from a thread
of its own, every BEAT seconds, whatever the rank's main thread is doing. A rank that sends
none for --hang-seconds is not slow: it is stopped (SIGSTOP, a frozen node) or cut off.
Every rank watches every other, so a silent rank 0 is caught too; the first to see it
says so, kills it where it shares the node, and every watcher exits 1, which torchrun
handles as any crash: the job ends, or restarts. A rank alive but blocked forever in a
collective still beats: the groups' own timeout ends that one.

What a restarted job knows of the attempt before comes from the same store (torchrun's
agent keeps it across restarts): each attempt's keys are under its own prefix
(`attempt_<n>/`): beats, exits, the first failed rank (console.Failures) and the hung rank."""

import atexit
import os
import signal
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

import console

BEAT = 1.0  # seconds between heartbeats; a hang is seen within --hang-seconds + BEAT


def attempt():
    """This job's restart count: 0 for its first start (torchrun sets it)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def attempt_store(store, n):
    """The keys of attempt n, apart from every other attempt's: a restarted job meets the
    same store, whose old group addresses must not be read as new ones."""
    return dist.PrefixStore(f"attempt_{n}", store)


def role(rank, learners):
    return "learner" if rank < learners else "sampler"


def start(rank, world, learners, hang_seconds):
    """This rank's heartbeat and watchdog thread, on a store client of its own (the main
    thread's may be blocked inside a call); the exit mark that tells a crash from a kill."""
    timeout = timedelta(seconds=30)
    raw = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    store = attempt_store(raw, attempt())
    store.set(f"where/{rank}", f"{socket.gethostname()} {os.getpid()}")
    done = threading.Event()
    thread = threading.Thread(target=_watch, args=(store, rank, world, learners, hang_seconds, done), daemon=True)
    thread.start()
    pid = os.getpid()

    def at_exit():
        # The thread stops before Python finalizes: a daemon thread still inside the
        # store's C++ call then is unwound by force, and the process aborts (SIGABRT).
        if os.getpid() != pid:  # a forked child (a reward worker) inherits this handler
            return
        done.set()
        thread.join(timeout=10)
        _quietly(store.set, f"exit/{rank}", "1")

    atexit.register(at_exit)


def _watch(store, rank, world, learners, hang_seconds, done):
    seen = {}  # rank: (its last beat's value, when this rank saw it change), by this clock
    keys = [f"beat/{r}" for r in range(world)]
    while not done.is_set():
        now = time.time()
        try:
            store.set(f"beat/{rank}", repr(now))
            # Only once every rank has beaten: before that, a missing rank is still starting.
            if hang_seconds and store.check(keys):
                for r, beat in enumerate(store.multi_get(keys)):
                    if seen.get(r, (None,))[0] != beat:
                        seen[r] = (beat, now)
                    elif now - seen[r][1] > hang_seconds and not store.check([f"exit/{r}"]):
                        _hung(store, rank, r, now - seen[r][1], learners, hang_seconds)
        except Exception as e:  # the store is gone (torchrun is ending the job): nothing left to watch
            print(f"heartbeat stopped: {e}", flush=True)
            return
        done.wait(BEAT)


def _hung(store, me, r, silent, learners, hang_seconds):
    line = (
        f"rank {r} ({role(r, learners)}) sent no heartbeat for {silent:.0f} s (stopped, frozen or cut off; "
        f"--hang-seconds {hang_seconds:g}): ending the job"
    )
    print(f"rank {me}: {line}", flush=True)  # into this rank's log
    mark = f"{r} {me}"
    if store.compare_set("hung", "", mark).decode() == mark:  # the first watcher speaks, once
        console.say("\n" + line)  # from any rank: past the end of rank 0's progress bar
        host, pid = store.get(f"where/{r}").decode().split()
        if host == socket.gethostname():  # torchrun would wait its grace for a stopped rank
            _quietly(os.kill, int(pid), signal.SIGKILL)
    _quietly(store.set, f"exit/{me}", "1")
    os._exit(1)


def _quietly(call, *args):
    try:
        call(*args)
    except Exception:  # at exit, or a store already gone: the mark is a courtesy
        pass


def restart_line(store, n, world, learners, out_dir, first_step):
    """Rank 0's line at restart n: who failed in attempt n - 1, why, and where this one
    starts. The cause, in the order of certainty: a rank the watchdog found silent; the
    first rank that failed with an error (console.Failures); else a rank that never
    reached its exit (killed by a signal: kill -9, the OOM killer, a lost node), the one
    whose heartbeat stopped first."""
    before = attempt_store(store, n - 1)

    def get(key):
        return before.get(key).decode() if before.check([key]) else None

    if hung := get("hung"):
        r, why = int(hung.split()[0]), "stopped sending heartbeats (stopped, frozen or cut off)"
    elif (failed := get("failed")) is not None:
        r = int(failed)
        why = f"failed: {last_line(console.log_path(out_dir, r), n)}"
    else:
        gone = [r for r in range(world) if get(f"exit/{r}") is None]
        r = min(gone, key=lambda g: float(get(f"beat/{g}") or 0)) if gone else None
        why = "was killed without an error of its own (a signal: kill -9, the OOM killer, a lost node)"
        if r is not None and (last := last_line(console.log_path(out_dir, r), n)):
            why += f"; its log ends: {last}"
    who = f"rank {r} ({role(r, learners)})" if r is not None else "a rank"
    where = f"step {first_step}, its newest complete checkpoint" if first_step else "step 0 (no checkpoint yet)"
    of = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    return f"restart {n} of {of}: {who} {why}; the job continues from {where}"


def last_line(path, n):
    """The last line a rank wrote in attempts before n: its log is appended to across
    restarts, and each attempt starts with a header naming it (console.setup)."""
    try:
        with open(path, errors="replace") as f:
            lines = console.log_lines(f.read())
    except OSError:
        return ""
    header = f", restart {n}:"
    cut = next((i for i, line in enumerate(lines) if line.startswith("rank ") and header in line), len(lines))
    return lines[cut - 1].strip() if cut else ""
