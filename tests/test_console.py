"""The console a user sees under launch.sh: a start line, one progress bar, evals and a
summary; every rank's own output in <out_dir>/logs; a bad flag refused in one line
before torchrun starts; a failed, killed or preempted run said once, with nothing
around it."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import BAR, FAST, ROOT, children, console_lines, launch, ranks_of, rows, stop


def wait_for_steps(proc, out, steps, timeout=300):
    deadline = time.time() + timeout
    while len(rows(out)) < steps:
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.time() < deadline, "the run did not reach its steps"
        time.sleep(0.3)


def test_default_run_prints_a_start_line_a_bar_evals_and_a_summary(tiny_model, tmp_path):
    out = tmp_path / "run"
    proc = launch(out, "--steps", 3)
    try:
        raw, _ = proc.communicate(timeout=600)
    finally:
        stop(proc)
    text = raw.decode()
    assert proc.returncode == 0, text[-3000:]
    lines = console_lines(raw)
    print("\n".join(lines))
    assert len(lines) <= 15, lines
    assert (
        lines[0]
        == f"grpo: tiny on synthetic, 3 steps; 2 learners + 1 sampler on CPU (no NVIDIA GPU found); logs in {out}/logs/"
    )
    assert [line.split(":")[0] for line in lines if line.startswith("eval at step")] == [
        "eval at step 0",
        "eval at step 3",
    ]
    assert any(line.startswith("run finished: 3 steps") for line in lines) and any(
        line.startswith("eval accuracy:") for line in lines
    )
    # the bar, on one line: reward, accuracy and seconds per step
    assert re.search(r"grpo: 100%\|[^|]*\| 3/3 \[[^\]]*, reward \d\.\d{3}, acc \d\.\d\d, \d+\.\d s/step\]", text)
    for noise in (
        "INFO",
        "WARNING",
        "Failed to load weights",
        "OMP_NUM_THREADS",
        "NUMA",
        "Loading weights",
        "FutureWarning",
    ):
        assert noise not in text, noise
    logs = out / "logs"
    assert sorted(os.listdir(logs)) == ["rank_0.log", "rank_1.log", "rank_2.log", "torchrun.log"]
    sampler = (logs / "rank_2.log").read_text()
    assert sampler.startswith("rank 2 (sampler), pid ")
    assert "Initializing a V1 LLM engine" in sampler and "Reloading weights inplace" in sampler
    assert sampler.count("Reloading and processing weights took") >= 3  # a line per sync: the log has every step
    assert "Failed to load weights" not in sampler  # the rotary embedding's, at every sync (sampler.py)
    assert "Loading weights" in (logs / "rank_0.log").read_text()  # transformers' bars, in the learner's log


@pytest.mark.parametrize(
    "args, nproc, flag",
    [
        (["--learners", 3], "3", "--learners"),
        (["--lr", "abc"], "", "argument --lr"),
        (["--no-such-flag"], "", "unrecognized arguments"),
        # a mistyped model: a path that is no model folder, a folder without a config.json,
        # and a hub name that can be neither found in the local cache nor fetched
        (["--model", "/nonexistent/model"], "", "--model /nonexistent/model: no such folder"),
        (["--model", ROOT], "", f"--model {ROOT}: a folder without a config.json"),
        (["--model", "nobody-grpo-test/no-such-model"], "", "--model nobody-grpo-test/no-such-model: not in the local"),
    ],
)
def test_a_bad_flag_is_one_line_and_status_2_before_torchrun(tmp_path, args, nproc, flag):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHON": sys.executable, "NPROC": nproc}
    start = time.time()
    result = subprocess.run(
        ["bash", os.path.join(ROOT, "launch.sh"), *map(str, args), "--out-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("job.py: error: ") and flag in lines[0], (
        result.stdout + result.stderr
    )
    assert not out.exists()  # refused before torchrun started a rank (a rank makes the folder)
    assert time.time() - start < 60


def test_help_needs_no_torchrun():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "job.py"), "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.startswith("usage: job.py") and "--out-dir" in result.stdout
    # every flag has its field's comment as its help, and --help shows it
    from config import field_help

    helps = field_help()
    assert all(helps.values()), [name for name, text in helps.items() if not text]
    shown = "".join(result.stdout.split())  # argparse wraps the help text, at hyphens too
    assert all("".join(text.split()) in shown for text in helps.values())


BROKEN_OBJECTIVE = """
def objective(logp, sampler_logp, advantages, mask):
    raise RuntimeError("boom in the objective")
"""


def assert_one_report(raw, header):
    """The start line, then one report: its header and the end of the log, indented,
    with no redrawn progress bar after it."""
    lines = console_lines(raw)
    print("\n".join(lines))
    assert lines[0].startswith("grpo: tiny on synthetic"), lines
    found = [i for i, line in enumerate(lines) if re.fullmatch(header, line)]
    assert found == [1], lines
    assert all(line.startswith("    ") for line in lines[2:]) and len(lines) > 2, lines
    text = raw.decode()
    assert not BAR.search(text[text.index(lines[1]) :]), text[-2000:]
    return lines, re.fullmatch(header, lines[1])


def test_a_failed_rank_is_named_once_with_its_last_lines_and_log(tiny_model, tmp_path):
    (tmp_path / "broken_objective.py").write_text(BROKEN_OBJECTIVE)
    out = tmp_path / "run"
    proc = launch(
        out, "--steps", 3, *FAST, "--objective", "broken_objective:objective", env={"PYTHONPATH": str(tmp_path)}
    )
    try:
        raw, _ = proc.communicate(timeout=600)
    finally:
        stop(proc)
    assert proc.returncode == 1
    # both learners raise at step 0; the first to fail reports, the other only logs
    lines, match = assert_one_report(raw, r"rank ([01]) \(learner\) failed; the end of its log, (.*):")
    assert match[2] == str(out / "logs" / f"rank_{match[1]}.log") and os.path.exists(match[2])
    assert lines[-1] == "    RuntimeError: boom in the objective"
    assert "Traceback (most recent call last)" in open(match[2]).read()


def exited(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: its parent has not reaped it


def test_a_killed_rank_is_named_once_from_torchrun(tiny_model, tmp_path):
    """The sampler is killed while torchrun is stopped, and torchrun resumes only once the
    learners have died of the broken connections, seconds later: its 'root cause' (the
    earliest time, and a killed rank's is when torchrun notices it) is then a learner, as
    it was by chance once in CI. The console must still name the sampler."""
    out = tmp_path / "run"
    proc = launch(out, "--steps", 1000, *FAST)
    try:
        wait_for_steps(proc, out, 1)
        ranks = ranks_of(proc)
        (torchrun,) = children(proc.pid)
        os.kill(torchrun, signal.SIGSTOP)
        try:
            os.kill(ranks[2], signal.SIGKILL)  # the sampler: it cannot say so itself
            deadline = time.time() + 60
            while not (exited(ranks[0]) and exited(ranks[1])) and time.time() < deadline:
                time.sleep(0.2)
            time.sleep(2)  # torchrun's times are in whole seconds
        finally:
            os.kill(torchrun, signal.SIGCONT)
        raw, _ = proc.communicate(timeout=120)
    finally:
        stop(proc)
    assert proc.returncode == 1
    report = (out / "logs" / "torchrun.log").read_text()
    assert re.search(r"Root Cause.*\n.*\n.*\n.*\n *rank *: [01] ", report), report[-3000:]  # the race, forced
    assert (out / "logs" / "peer_error_0").exists() and (out / "logs" / "peer_error_1").exists()
    header = r"rank 2 \(sampler\) died with status -9 \(Signal 9 \(SIGKILL\) received by PID \d+\); the end of its log, (.*):"
    _, match = assert_one_report(raw, header)
    assert match[1] == str(out / "logs" / "rank_2.log")
    assert not (out / "logs" / "failed").exists()  # no learner took its broken connection for the first failure
    assert not any(os.path.exists(f"/proc/{p}") for p in ranks.values())  # no rank left behind


def test_sigterm_to_launch_sh_checkpoints_and_exits_75(tiny_model, tmp_path):
    out = tmp_path / "run"
    proc = launch(out, "--steps", 1000, *FAST)
    try:
        wait_for_steps(proc, out, 2)
        proc.send_signal(signal.SIGTERM)  # to launch.sh, which passes it on to torchrun
        raw, _ = proc.communicate(timeout=120)
    finally:
        stop(proc)
    lines = console_lines(raw)
    print("\n".join(lines))
    assert proc.returncode == 75
    step = len(rows(out))
    saved = out / "checkpoints" / f"step_{step}"
    assert lines[1:] == [
        f"stopped by a signal after step {step}: checkpoint {saved} saved (--resume continues); exit 75"
    ], lines
    assert raw.decode().endswith(lines[1] + "\n")  # and no progress bar drawn again after it
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{step}"


def test_a_signal_whose_ranks_cannot_save_is_one_line(tiny_model, tmp_path):
    """launch.sh is signalled, but the ranks die before they could save (killed outright
    here, as a scheduler's SIGKILL after its grace would): one line says that no
    checkpoint was saved, in place of a failed rank's report."""
    out = tmp_path / "run"
    proc = launch(out, "--steps", 1000, *FAST)
    try:
        wait_for_steps(proc, out, 1)
        ranks = ranks_of(proc)
        for pid in ranks.values():
            os.kill(pid, signal.SIGKILL)
        proc.send_signal(signal.SIGTERM)
        raw, _ = proc.communicate(timeout=120)
    finally:
        stop(proc)
    lines = console_lines(raw)
    print("\n".join(lines))
    assert proc.returncode != 0 and not (out / "checkpoints" / "latest").exists()
    assert lines[1:] == [f"stopped by a signal before any checkpoint was saved: nothing to resume; logs in {out}/logs"]
