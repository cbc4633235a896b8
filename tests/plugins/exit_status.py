"""torchrun's script in place of job.py, for the tests that assert each rank's exit
status: torchrun reports none when it is itself signalled, and a rank is not the test's
child, so the test cannot wait for it.

    torchrun ... tests/plugins/exit_status.py DIR job.py ARGS...

runs `python job.py ARGS...` as its child, in its own process group (the session torchrun
made for the rank, so torchrun's killpg, or a test's, reaches job.py as it would without
this wrapper), waits for it, writes its exit status (negative: killed by that signal) to
DIR/rank_<RANK>, and exits with the same status."""

import os
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from console import die_with_parent  # noqa: E402


def main():
    record_dir, *command = sys.argv[1:]
    # The signals are job.py's to handle: a no-op handler here (not SIG_IGN, which the
    # child would inherit across exec) keeps this process waiting for it.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    die_with_parent()  # torchrun killed outright: this goes, and job.py with it (its own PDEATHSIG)
    status = subprocess.Popen([sys.executable, *command]).wait()
    path = os.path.join(record_dir, f"rank_{os.environ['RANK']}")
    with open(path + ".tmp", "w") as f:
        f.write(f"{status}\n")
    os.replace(path + ".tmp", path)
    if status < 0:  # killed by a signal: die by the same one, so torchrun sees what job.py got
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


if __name__ == "__main__":
    main()
