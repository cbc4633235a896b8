"""Checkpoints under real torchrun: exact resume after kill -9, a kill during a save,
SIGTERM preemption, refusals, and checkpoints that transformers and vLLM both load."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import conftest
from conftest import ROOT, children, rank0_env, rows, torchrun, torchrun_cmd, transformers_vs_vllm

FAST = ["--learners", 2, *conftest.FAST]


def weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def start(out, *args, exits=None):
    """torchrun in its own session. With `exits` (a folder), each rank runs under
    tests/plugins/exit_status.py, which writes its exit status to exits/rank_<RANK>."""
    cmd = torchrun_cmd(3, *FAST, "--out-dir", out, *args)
    if exits is not None:
        script = cmd.index(os.path.join(ROOT, "job.py"))
        cmd[script:script] = [os.path.join(ROOT, "tests", "plugins", "exit_status.py"), str(exits)]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def wait_for(condition, proc, timeout=300, poll=0.05):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline, "timed out"
        time.sleep(poll)


def latest(out):
    marker = os.path.join(out, "checkpoints", "latest")
    return open(marker).read().strip() if os.path.exists(marker) else None


@pytest.fixture(scope="module")
def straight(tiny_model, tmp_path_factory):
    """One uninterrupted 4-step run saving at steps 2 and 4, shared by the tests below
    (each job costs about 20 s of start-up): the reference for resume, a checkpoint to
    load elsewhere, and an out-dir that holds a run. Tests that change it copy it first."""
    out = tmp_path_factory.mktemp("checkpoint") / "straight"
    result = torchrun(3, *FAST, "--steps", 4, "--save-every", 2, "--out-dir", out)
    assert result.returncode == 0, result.stdout[-3000:]
    return out


def test_resume_after_kill_equals_an_uninterrupted_run(straight, tmp_path):
    broken = tmp_path / "broken"
    proc = start(broken, "--steps", 1000, "--save-every", 2)
    wait_for(lambda: latest(broken) == "step_2", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    result = torchrun(3, *FAST, "--steps", 4, "--out-dir", broken, "--resume")
    assert result.returncode == 0, result.stdout[-3000:]

    a, b = rows(straight), rows(broken)
    assert [r["step"] for r in b] == [0, 1, 2, 3]  # no duplicate or missing step
    assert [r["reward_mean"] for r in a] == [r["reward_mean"] for r in b]
    wa, wb = weights(straight / "final"), weights(broken / "final")
    diff = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    print(f"resumed vs straight final weights: max abs diff {diff:.2e}")
    assert diff < 1e-6


def frozen(pid):
    """Whether every thread of pid is stopped (a SIGSTOP takes effect asynchronously)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:  # a thread that has just exited
            continue
        if state not in "tT":
            return False
    return True


def test_kill_during_save_keeps_the_previous_checkpoint(tiny_model, tmp_path):
    out = tmp_path / "run"
    proc = start(out, "--steps", 1000, "--save-every", 1, "--keep-last", 2)
    root = out / "checkpoints"

    def partial():
        return [d for d in os.listdir(root) if d.startswith("step_") and d.endswith(".tmp")] if root.exists() else []

    # Once a checkpoint is half written (step_<k>.tmp, after an earlier one is complete),
    # freeze every rank and check that it still is, then kill them frozen: the kill lands
    # inside the save for certain. A save that completes before the freeze is let go, and
    # a later step's save is tried.
    for attempt in range(20):
        wait_for(lambda: latest(out) is not None and partial(), proc, poll=0.002)
        ranks = children(proc.pid)
        for pid in ranks:
            os.killpg(pid, signal.SIGSTOP)  # each rank leads a session of its own
        wait_for(lambda: all(frozen(pid) for pid in ranks), proc, timeout=10, poll=0.01)
        caught, done = partial(), latest(out)
        if caught:
            break
        for pid in ranks:
            os.killpg(pid, signal.SIGCONT)
    assert caught, "no save was caught half written in 20 tries"
    for pid in ranks:
        os.killpg(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"killed inside the save of {caught[0]} (try {attempt + 1}); latest: {done}")
    # The kill landed inside the save: its folder is still the temporary one, and
    # `latest` still names the previous checkpoint, complete.
    (k,) = [int(d[5:-4]) for d in caught]
    assert partial() == caught and not (root / f"step_{k}").exists()
    assert latest(out) == done == f"step_{k - 1}"
    assert (root / done / "trainer.json").exists() and (root / done / "train_state" / ".metadata").exists()
    assert len([d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp")]) <= 2
    result = torchrun(3, *FAST, "--steps", k, "--out-dir", out, "--resume")
    assert result.returncode == 0, result.stdout[-3000:]
    assert [r["step"] for r in rows(out)] == list(range(k))


@pytest.mark.parametrize("staleness, signalled", [(0, "torchrun"), (1, "job")])
def test_preemption_checkpoints_and_every_rank_exits_with_75(tiny_model, tmp_path, staleness, signalled):
    """SIGTERM to torchrun alone, which forwards it to every rank (S=0), or SIGINT to
    every process of the job at once, torchrun and each rank's own process group, as a
    scheduler sends it (S=1): every rank exits with 75 once the checkpoint is saved, and
    torchrun with 1, naming the signal it got."""
    out, exits = tmp_path / "run", tmp_path / "exits"
    exits.mkdir()
    proc = start(out, "--steps", 1000, "--max-staleness", staleness, exits=exits)
    wait_for(lambda: (out / "metrics.jsonl").exists() and len(rows(out)) >= 2, proc)
    sig = signal.SIGTERM if signalled == "torchrun" else signal.SIGINT
    for pid in children(proc.pid) if signalled == "job" else []:
        os.killpg(pid, sig)
    os.killpg(proc.pid, sig)
    output, _ = proc.communicate(timeout=90)
    status = {f: int((exits / f).read_text()) for f in sorted(os.listdir(exits))}
    assert status == {"rank_0": 75, "rank_1": 75, "rank_2": 75}, (status, output[-3000:])
    assert proc.returncode == 1 and f"got signal: {int(sig)}" in output, output[-3000:]
    done = latest(out)
    assert done is not None
    step = int(done[5:])
    assert step == len(rows(out))  # the checkpoint holds exactly the steps logged


def finished(exits, ranks=3):
    return len([f for f in os.listdir(exits) if f.startswith("rank_") and not f.endswith(".tmp")]) == ranks


@pytest.mark.parametrize("long_part, signalled", [("sampler", "torchrun"), ("learner", "job")])
def test_a_signal_cuts_a_long_step_short_within_20_s(straight, tmp_path, long_part, signalled):
    """A step far longer than a scheduler's grace (30 s): a reward that sleeps 600 s at step
    2 (the sampler's half), or 2 s per micro-batch in 64 micro-batches (the learners' half,
    one step ahead). SIGTERM to torchrun alone, or to every process of the job: the step
    is dropped, the last complete one checkpointed and every rank gone, with status 75,
    within 20 s of the signal; --resume redoes the dropped step, and on-policy the run
    is the uninterrupted one (the `straight` run: a weight-0 reward changes nothing)."""
    out, exits = tmp_path / "run", tmp_path / "exits"
    exits.mkdir()
    marker = tmp_path / "slow"
    if long_part == "sampler":
        os.environ["GRPO_TEST_SLOW_STEP"] = f"2:{marker}"
        flags = ["--steps", 4, "--rewards", "accuracy,format,tests.plugins.task_rewards:slow_at_step=0"]
        flags += ["--reward-timeout", 900]
    else:
        os.environ["GRPO_TEST_SLOW_LEARNER"] = str(marker)
        flags = ["--steps", 1000, "--objective", "tests.plugins.user_objective:slow_clip", "--max-staleness", 1]
        flags += ["--prompts-per-step", 32, "--micro-batch-size", 1, "--max-tokens-per-microbatch", 0]
    try:
        proc = start(out, *flags, exits=exits)
    finally:
        os.environ.pop("GRPO_TEST_SLOW_STEP", None)
        os.environ.pop("GRPO_TEST_SLOW_LEARNER", None)
    try:
        if long_part == "learner":
            wait_for(lambda: len(rows(out)) >= 2, proc)
            (tmp_path / "slow.go").touch()
        wait_for(marker.exists, proc)
        time.sleep(1.0)  # well inside the long part
        signalled_at = time.time()
        for pid in children(proc.pid) if signalled == "job" else []:
            os.killpg(pid, signal.SIGTERM)  # each rank's process group: the rank and its reward workers
        os.killpg(proc.pid, signal.SIGTERM)
        step = len(rows(out))  # the step cut short
        wait_for(lambda: latest(out) == f"step_{step}", proc, timeout=60, poll=0.05)
        saved_s = time.time() - signalled_at
        wait_for(lambda: finished(exits), proc, timeout=60, poll=0.05)
        exited_s = time.time() - signalled_at
        output, _ = proc.communicate(timeout=60)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    print(
        f"{long_part} step cut short at step {step}: checkpoint complete {saved_s:.1f} s and every rank exited {exited_s:.1f} s after the signal"
    )
    status = {f: int((exits / f).read_text()) for f in sorted(os.listdir(exits))}
    assert status == {"rank_0": 75, "rank_1": 75, "rank_2": 75}, (status, output[-3000:])
    assert exited_s < 20, exited_s
    assert len(rows(out)) == step  # nothing of the dropped step was logged
    if long_part == "learner":
        return
    assert step == 2
    result = torchrun(3, *FAST, "--steps", 4, "--out-dir", out, "--resume")
    assert result.returncode == 0, result.stdout[-3000:]
    a, b = rows(straight), rows(out)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for key in ("reward_mean", "loss", "grad_norm"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    wa, wb = weights(straight / "final"), weights(out / "final")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) == 0.0


def test_existing_run_is_refused_and_bad_checkpoints_are_named(straight, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    env = rank0_env()

    def direct(*args):
        check = list(args[:1]) if args[:1] == ("check",) else []  # launch.sh's check: no rank runs
        args = args[len(check) :]
        return subprocess.run(
            [sys.executable, os.path.join(ROOT, "job.py"), *check, *map(str, [*FAST[:2], "--out-dir", out, *args])],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    r = direct("--steps", 6)
    assert r.returncode == 2 and "already holds a run" in r.stderr and "--resume" in r.stderr
    os.remove(out / "checkpoints" / "step_4" / "train_state" / ".metadata")
    r = direct("--steps", 6, "--resume", out / "checkpoints" / "step_4")  # a path: that one or nothing
    assert r.returncode == 2 and "incomplete" in r.stderr and ".metadata" in r.stderr, r.stderr
    r = direct("check", "--steps", 6, "--resume")  # the newest complete one: step_2, said in one line
    assert r.returncode == 0 and "step_4 is incomplete: train_state/.metadata is missing: passed over" in r.stderr
    assert r.stderr.splitlines()[-1] == f"job.py: --resume: falling back to {out}/checkpoints/step_2", r.stderr
    (out / "checkpoints" / "step_2" / "trainer.json").write_text("{not json")
    r = direct("--steps", 6, "--resume", out / "checkpoints" / "step_2")
    assert r.returncode == 2 and "trainer.json" in r.stderr, r.stderr
    r = direct("--steps", 6, "--resume")
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr and "step_2" in r.stderr, r.stderr
    r = direct("--steps", 6, "--resume", tmp_path / "nowhere")
    assert r.returncode == 2 and "incomplete" in r.stderr
    shutil.rmtree(out / "checkpoints")
    r = direct("--steps", 6, "--resume")
    assert r.returncode == 2 and "no checkpoint" in r.stderr


def test_checkpoint_loads_in_transformers_and_vllm_alike(straight, tiny_model):
    ckpt = straight / "checkpoints" / "step_2"
    assert max((weights(ckpt)[k] - weights(tiny_model)[k]).abs().max().item() for k in weights(ckpt)) > 1e-5
    gap = transformers_vs_vllm(ckpt, "Ann has 3 pens and gets 4 more.\n3+4=7\n#### 7")
    print(f"checkpoint log-probs, transformers vs vLLM: max abs diff {gap:.2e}")
    assert gap < 1e-4


def test_non_finite_steps_are_skipped_then_abort(tiny_model, tmp_path):
    out = tmp_path / "run"
    result = torchrun(
        3,
        *FAST,
        "--steps",
        10,
        "--rewards",
        "accuracy,tests.plugins.nan_reward:nan",
        "--max-skips",
        2,
        "--out-dir",
        out,
    )
    assert result.returncode != 0
    assert "2 consecutive steps with a non-finite loss or grad norm" in result.stdout
    metrics = rows(out)
    assert [r["step"] for r in metrics] == [0, 1] and all(r["skipped"] == 1 for r in metrics)
    assert not (out / "final").exists()
