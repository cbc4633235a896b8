"""What a user sees while a run goes. Quiet by default: the console shows rank 0's start
line, progress bar, evals and summary, the warnings that matter, and a failed rank's
last lines, once; each rank's whole output (vLLM's, transformers', torch's C++ warnings,
tracebacks) goes to <out_dir>/logs/rank_<r>.log. GRPO_VERBOSE=1 leaves every rank's
output on the console, as it comes.

The redirection is at the file-descriptor level, so that output written below Python
(gloo, NCCL, TORCH_WARN) reaches the log too; the console is a copy of the stdout the
rank started with (torchrun's, which launch.sh leaves on the terminal). Light on
purpose: no torch import, so tiny.py and the flag check can use it."""

import ctypes
import logging
import os
import signal
import sys
import traceback
from datetime import timedelta

from tqdm import tqdm

VERBOSE = "GRPO_VERBOSE"  # 1: every rank's output on the console, as before
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
TAIL_LINES = 12  # of a failed rank's log, on the console
BAR = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"  # tqdm's, its rate left to the postfix
_state = {"console": None}


def verbose():
    return os.environ.get(VERBOSE, "") not in ("", "0")


def logs_dir(out_dir):
    return os.path.join(out_dir, "logs")


def log_path(out_dir, rank):
    return os.path.join(logs_dir(out_dir), f"rank_{rank}.log")


def stream():
    """The console: the rank's original stdout once setup() ran, else stderr."""
    return _state["console"] or sys.stderr


def progress_bar(first, total):
    """Rank 0's progress bar over the steps, on the console."""
    return tqdm(initial=first, total=total, desc="grpo", file=stream(), bar_format=BAR)


def start_line(cfg, world, local_world, gpus):
    """Rank 0's first console line: what runs where, and where the logs go."""

    def n(count, word):
        return f"{count} {word}{'s' * (count != 1)}"

    where = f"{n(len(gpus), 'GPU')} ({','.join(gpus)})" if gpus else "CPU (no NVIDIA GPU found)"
    if world > local_world:
        where = f"{world // local_world} nodes x {where}"
    what = "eval only" if cfg.eval_only else n(cfg.steps, "step")
    logs = f"{VERBOSE}=1: every rank's output here" if verbose() else f"logs in {logs_dir(cfg.out_dir)}/"
    return f"grpo: {cfg.model} on {cfg.dataset}, {what}; {n(cfg.learners, 'learner')} + {n(world - cfg.learners, 'sampler')} on {where}; {logs}"


def say(text):
    """A line (or a few) on the console, above a progress bar if one is shown there."""
    try:
        tqdm.write(text, file=stream())
    except (OSError, ValueError):  # the console went away (a closed pipe): the log still has it
        pass


log = logging.getLogger("grpo")  # this repo's own messages: info to the log, warnings (see warn) also to the console


def warn(text):
    """A warning that matters to the user: in this rank's log, and on the console from
    the ranks setup() gave the console's warnings to."""
    log.warning(text)


_warned = set()


def warn_once(key, text):
    """warn(text) the first time `key` comes, once a process: a failure that repeats every
    step is said once, then only counted."""
    if key not in _warned:
        _warned.add(key)
        warn(text)


class _ConsoleHandler(logging.Handler):
    def emit(self, record):
        say(self.format(record))


class _StderrHandler(logging.Handler):
    """sys.stderr as it is when a record comes (so pytest's capture sees it)."""

    def emit(self, record):
        sys.stderr.write(self.format(record) + "\n")


def _grpo_logger(handlers, level):
    log = logging.getLogger("grpo")
    for h in list(log.handlers):
        log.removeHandler(h)
    for h in handlers:
        log.addHandler(h)
    log.setLevel(level)
    log.propagate = False


# Outside a run (unit tests, a notebook), the warnings of data.py, rewards.py and
# checkpoint.py go to stderr, as print() would.
_grpo_logger([_StderrHandler(logging.WARNING)], logging.INFO)


def setup(out_dir, rank, role, warnings_here, append=False, restart=0):
    """Send this rank's output to its log (unless GRPO_VERBOSE) and keep the console for
    what the user reads. `warnings_here`: whether the 'grpo' loggers' warnings reach the
    console from this rank (rank 0 and the first sampler, so that a warning every
    sampler meets shows once). `append` keeps an earlier log (a resumed or restarted run)."""
    if verbose():
        _state["console"] = sys.stdout
        _grpo_logger([_StderrHandler(logging.INFO)], logging.INFO)
        return
    path = log_path(out_dir, rank)
    os.makedirs(logs_dir(out_dir), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    console = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC), 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    _state["console"] = console
    # vLLM would give its loggers a handler of its own on stdout inside LLM(); this leaves
    # them to the root handler below (all of vLLM's loggers are under 'vllm').
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=LOG_FORMAT, datefmt="%H:%M:%S", force=True)
    to_log = logging.StreamHandler(sys.stderr)
    to_log.setFormatter(logging.Formatter(LOG_FORMAT, "%H:%M:%S"))
    handlers = [to_log]
    if warnings_here:
        handlers.append(_ConsoleHandler(logging.WARNING))
    _grpo_logger(handlers, logging.INFO)
    again = f", restart {restart}" if restart else ""  # where a restarted job's log resumes (watchdog.last_line)
    print(f"rank {rank} ({role}), pid {os.getpid()}{again}: {' '.join(sys.argv)}", flush=True)


def _tail(path, lines=TAIL_LINES):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 32768))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return log_lines(text)[-lines:]


def log_lines(text):
    """A log's lines as a reader sees them: a progress bar's redraws are one line of
    '\r'-separated frames, of which the last is kept; blank lines are dropped."""
    out = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]
    return [line for line in out if line.strip()]


def failure_block(who, path, lines=TAIL_LINES):
    """What the console shows of a failed rank: who, the end of its log, and the log."""
    tail = "\n".join("    " + line for line in _tail(path, lines))
    return f"\n{who} failed; the end of its log, {path}:\n{tail}"


def _stop_bars(close):
    """A rank that stops early ends its progress bar where it stands: closed (its line
    finished) before it says why, or else frozen, since tqdm would draw it once more at
    exit, after another rank's lines."""
    for bar in list(getattr(tqdm, "_instances", ())):
        if close:
            bar.close()
        bar.disable = True


def die_with_parent():
    """Tie this process's life to its parent's (Linux's PR_SET_PDEATHSIG): torchrun starts
    each rank in a session of its own, so a torchrun killed outright (kill -9, an OOM kill)
    would leave its ranks running, and a rank killed so would leave its reward workers."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: a killed parent may leave its children behind


def gloo_peer_error(error):
    """Whether error is gloo's report of a peer's broken or timed-out connection: a bare
    RuntimeError whose message names its transport ("[.../gloo/transport/tcp/pair.cc:537]
    Read error [...]: Connection reset by peer"). NCCL's are DistBackendError."""
    return isinstance(error, RuntimeError) and "gloo/transport" in str(error)


class Failures:
    """Around a rank's run: when it fails, the console shows the first failed rank of
    the job, the end of its log and the log's path, once. The first is decided by the
    job's store (`.store`, once connected), so ranks that fail after it do not print.
    A broken or timed-out connection to a peer (`peer_errors`, and gloo's) does not count
    as a first failure: a rank that is killed prints nothing, so its peers' broken
    connections would otherwise be blamed; launch.sh names such a rank from torchrun's
    report. `quiet_exits`: exit statuses that are no failure (preemption)."""

    def __init__(self, out_dir, rank, role, quiet_exits=(), peer_errors=()):
        self.out_dir, self.rank, self.role = out_dir, rank, role
        self.quiet_exits, self.peer_errors, self.store = quiet_exits, peer_errors, None

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is None or verbose():
            return False
        if isinstance(error, SystemExit) and error.code in (0, None, *self.quiet_exits):
            _stop_bars(close=False)
            return False
        message = isinstance(error, SystemExit) and isinstance(error.code, str)
        if message:
            print(error.code, file=sys.stderr)
        else:
            traceback.print_exception(kind, error, tb, file=sys.stderr)
        sys.stderr.flush()
        peer_error = self._peer_error(error)
        if peer_error:  # for launch.sh, which names the rank that really failed
            open(os.path.join(logs_dir(self.out_dir), f"peer_error_{self.rank}"), "w").close()
        speak = not peer_error and self._first()
        _stop_bars(close=speak)
        if speak:
            with open(os.path.join(logs_dir(self.out_dir), "failed"), "w") as f:
                f.write(f"{self.rank}\n")
            say(failure_block(f"rank {self.rank} ({self.role})", log_path(self.out_dir, self.rank)))
        if message:
            raise SystemExit(1) from None  # already in the log; Python would print it again
        sys.excepthook = lambda *args: None  # the same: the traceback is in the log already
        return False

    def _peer_error(self, error):
        return isinstance(error, self.peer_errors) or gloo_peer_error(error)

    def _first(self):
        if self.store is None:
            return True
        try:
            self.store.set_timeout(timedelta(seconds=10))
            mine = str(self.rank)  # the first failed rank, which a restart names (watchdog.py)
            return self.store.compare_set("failed", "", mine).decode() == mine
        except Exception:  # no store to ask: better twice than never
            return True


def clear_marks(out_dir):
    """Remove the marks a failed or preempted job left in its logs folder for launch.sh."""
    folder = logs_dir(out_dir)
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name in ("failed", "preempted") or name.startswith("peer_error_"):
            os.remove(os.path.join(folder, name))


def preempted(out_dir, text, here):
    """A preemption's one line, from rank 0 (`here`), with a marker from which launch.sh
    exits 75 like the ranks; the other ranks write it to their log."""
    if not here:
        print(text, file=sys.stderr)
        return
    _stop_bars(close=True)
    say(text)
    if not verbose():
        with open(os.path.join(logs_dir(out_dir), "preempted"), "w") as f:
            f.write(text + "\n")
