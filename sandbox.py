"""A sandbox for code the model wrote. `run(code, timeout)` runs a Python program in a
fresh process and returns plain data: {"stdout", "stderr", "error", "seconds"}, error
None when the program ran cleanly and a one-line reason otherwise (its exception, a limit
it hit, the timeout). A harm it stops is an `error`, never an exception in the caller, so
the rewards, the `python` tool and a user's own reward all call this one function.

Every program gets, in both modes below: limits on CPU seconds, memory (address space),
the size of any file it writes, open files and processes (setrlimit, set by the program's
own interpreter before a line of the program runs, hard limits included, so it cannot
raise them); the wall clock (`timeout`, then SIGKILL to its whole process group); an empty
working folder that is removed after; no inherited file descriptors (its stdin is empty,
its stdout and stderr are files of its own, read back capped at OUTPUT_CAP); a scrubbed
environment (no variable of the caller's); Python in isolated mode (-I: no user site, no
PYTHON* variables).

Two modes, chosen once a process and named on stderr at first use (`mode()`):
- "bubblewrap" (`bwrap`; Debian's `bubblewrap` package), where it starts: new pid,
  network, IPC and UTS namespaces; a filesystem of its own holding only the system's /usr
  (and /bin, /lib), Python's install, all read-only, and a size-capped tmpfs as its
  working folder and /tmp, so no home folder, no run folder, no checkpoints and no host
  /proc exist for it to read or delete; no network but a loopback of its own; as uid 65534
  (nobody), so the process limit counts only the sandboxes'. When the program exits or is
  killed, the pid namespace goes with it: nothing it started outlives the call.
- "fallback" (no bwrap, or it cannot start here: no user namespaces, say): the limits
  above in a separate process and session. Missing, and named at start: filesystem
  isolation (the program runs with the caller's rights on the caller's files), network
  isolation, a program that leaves its session (setsid) can outlive the call, and, for
  root, the process limit (the kernel exempts root from RLIMIT_NPROC).
  GRPO_SANDBOX=fallback forces it (the tests use it to check what it claims).

What the well-known harnesses do, and what this does differently: OpenAI's human-eval
(`execution.py`) runs the program in a forked child with setrlimit and "reliability
guards" that null out os.system, shutil.rmtree and friends inside the same interpreter,
which a program undoes with one import (its README says it is not a sandbox); the bigcode
harness uses the same guard. verl sends code to a remote sandbox service over HTTP. Taken:
rlimits set before the program runs, a fresh temp folder, a wall clock. Better here: a
real isolation tool rather than monkey-patches, a fresh interpreter per call (nothing of
the caller's memory is shared, unlike a fork), no service to run, and a result that is
only text (nothing the program writes is ever unpickled or executed by the caller)."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

NOBODY = 65534
OUTPUT_CAP = 64 * 1024  # characters of stdout and of stderr kept; a program may print gigabytes
LIMITS = {"memory_mb": 512, "file_mb": 16, "open_files": 64, "processes": 32, "disk_mb": 64}
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}

# Runs first in the sandbox's interpreter: read the program, close stdin, set the limits,
# drop to nobody (bubblewrap as root keeps CAP_SETUID for this one step), then run it.
BOOT = """
import os, resource, sys
program = sys.stdin.read()
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
for name, value in {limits}:
    resource.setrlimit(getattr(resource, name), (value, value))
if {drop} and os.getuid() == 0:
    os.setgroups([]); os.setgid({nobody}); os.setuid({nobody})
code = compile(program, "<program>", "exec")
del program, name, value
exec(code, {{"__name__": "__main__"}})
"""

stopped = 0  # calls of this process that ended in an error: the rewards' workers report it per call
_mode = None


def run(code: str, timeout: float = 5.0, **limits) -> dict:
    """Run `code` as a Python program under LIMITS (override any by keyword) for at most
    `timeout` wall seconds. Never raises for anything the program does."""
    global stopped
    limits = {**LIMITS, **limits}
    kind, _ = mode()
    # bubblewrap's working folder is its own tmpfs; the fallback's a fresh folder on disk
    workdir = None if kind == "bubblewrap" else tempfile.mkdtemp(prefix="sandbox-")
    start = time.monotonic()
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    try:
        command = [os.path.realpath(sys.executable), "-I", "-B", "-c", _boot(limits, timeout, kind)]
        if kind == "bubblewrap":
            command = _bwrap(limits) + command
        env = {**ENV, "HOME": workdir or "/tmp"}
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            cwd=workdir or "/",
            env=env,
            close_fds=True,
            start_new_session=True,
        )
        try:
            proc.stdin.write(code.encode("utf-8", "replace"))
            proc.stdin.close()
        except OSError:  # it died before reading its program (bwrap could not start)
            pass
        try:
            status, timed_out = proc.wait(timeout), False
        except subprocess.TimeoutExpired:
            status, timed_out = None, True
        _kill_group(proc)
        status = proc.wait() if status is None else status
        stdout, stderr = _read(out), _read(err)
    finally:
        out.close()
        err.close()
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    error = _error(status, stderr, timed_out, timeout, kind)
    stopped += error is not None
    return {"stdout": stdout, "stderr": stderr, "error": error, "seconds": time.monotonic() - start}


def mode():
    """("bubblewrap" or "fallback", the line that says what is in force), probed once a
    process: bwrap must be installed and start a sandbox here."""
    global _mode, stopped
    if _mode is None:
        missing = "no filesystem or network isolation; a program that calls setsid() can outlive its call"
        if os.getuid() == 0:  # the kernel exempts root from RLIMIT_NPROC
            missing += "; as root, no process limit"
        if os.environ.get("GRPO_SANDBOX") == "fallback":
            _mode = ("fallback", f"sandbox: fallback (GRPO_SANDBOX=fallback): resource limits only; {missing}")
        elif shutil.which("bwrap") is None:
            _mode = ("fallback", f"sandbox: fallback (bwrap not found; apt-get install bubblewrap): {missing}")
        else:
            _mode, errors = ("bubblewrap", ""), stopped
            probe = run("print('ok')", timeout=30)
            stopped = errors
            if probe["stdout"] == "ok\n":
                who = "nobody" if os.getuid() == 0 else "a user namespace"
                line = f"namespaces pid, net, ipc, uts; read-only /usr and Python; a {LIMITS['disk_mb']} MB tmpfs; as {who}"
                _mode = ("bubblewrap", f"sandbox: bubblewrap ({line})")
            else:
                why = (probe["error"] or probe["stderr"]).strip().splitlines()[-1:] or ["no reason given"]
                _mode = ("fallback", f"sandbox: fallback (bwrap cannot start here: {why[0]}): {missing}")
        print(_mode[1], file=sys.stderr, flush=True)
    return _mode


def _boot(limits, timeout, kind):
    rlimits = [
        ("RLIMIT_CPU", int(timeout) + 1),
        ("RLIMIT_AS", limits["memory_mb"] << 20),
        ("RLIMIT_FSIZE", limits["file_mb"] << 20),
        ("RLIMIT_NOFILE", limits["open_files"]),
        ("RLIMIT_NPROC", limits["processes"]),
        ("RLIMIT_CORE", 0),
    ]
    return BOOT.format(limits=rlimits, drop=kind == "bubblewrap", nobody=NOBODY)


def _bwrap(limits):
    """bwrap's arguments: the namespaces and the filesystem the program sees."""
    base = os.path.realpath(sys.base_prefix)
    args = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if os.getuid() == 0:  # no user namespace: the program drops to nobody itself (BOOT), then holds no capability
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:  # a user namespace of its own, where the process limit counts its processes only
        args += ["--unshare-user", "--disable-userns"]
    args += ["--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):  # merged /usr
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if not base.startswith("/usr/"):  # Python installed elsewhere (pyenv, conda): its folders, readable by nobody
        parents = [os.path.dirname(base)]
        while parents[-1] != "/":
            parents.append(os.path.dirname(parents[-1]))
        for folder in reversed(parents[:-1]):
            args += ["--perms", "0755", "--dir", folder]
        args += ["--ro-bind", base, base]
    args += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(limits["disk_mb"] << 20),
        "--tmpfs",
        "/tmp",
    ]
    env = {**ENV, "HOME": "/tmp"}
    return args + ["--chdir", "/tmp", "--clearenv", *[a for k, v in env.items() for a in ("--setenv", k, v)]]


def _kill_group(proc):
    """SIGKILL the program's process group (its children that stayed in it, bwrap's too)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(f):
    f.seek(0)
    return f.read(OUTPUT_CAP).decode("utf-8", "replace")


def _error(status, stderr, timed_out, timeout, kind):
    """None for a clean exit, else one line: the timeout, the signal, or the last line the
    program wrote to stderr (its exception)."""
    if timed_out:
        return f"timeout: ran past {timeout:g} s"
    if status == 0:
        return None
    lines = [line for line in stderr.splitlines() if line.strip()]
    signalled = -status if status < 0 else status - 128 if kind == "bubblewrap" and status > 128 else 0
    if signalled and not lines:
        name = signal.Signals(signalled).name if signalled in signal.valid_signals() else f"signal {signalled}"
        why = {"SIGXCPU": " (CPU time limit)", "SIGXFSZ": " (file size limit)", "SIGKILL": " (a limit, or killed)"}
        return f"killed by {name}{why.get(name, '')}"
    return lines[-1][:500] if lines else f"exit status {status}"
