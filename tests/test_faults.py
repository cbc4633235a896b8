"""Runs that heal themselves, with the faults injected for real under launch.sh and
torchrun: kill -9 of a learner and then of a sampler under RESTARTS (the run finishes by
itself, each step once, the final weights an uninterrupted run's bit for bit); a
SIGSTOPped sampler caught by the watchdog; a broken newest checkpoint passed over; a
full disk (a 10 MB tmpfs) that leaves the previous checkpoint whole."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file
from test_checkpoint import latest

from conftest import FAST, ROOT, console_lines, launch, rank0_env, ranks_of, refusal, rows, stop

RUN = [*FAST, "--learners", 2, "--steps", 12, "--save-every", 2]


def finish(proc, timeout=600):
    try:
        raw, _ = proc.communicate(timeout=timeout)
    finally:
        stop(proc)
    return raw


def wait_until(condition, proc, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def ranks(proc):
    """{rank: pid}, or {} while torchrun is between two sets of ranks."""
    try:
        return ranks_of(proc)
    except (FileNotFoundError, ProcessLookupError, KeyError):
        return {}


def final_weights(out):
    return load_file(os.path.join(out, "final", "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "straight"
    proc = launch(out, *RUN)
    assert proc.wait(timeout=600) == 0, proc.stdout.read().decode()[-3000:]
    return out


def test_killed_learner_then_sampler_restart_and_finish_as_if_never_killed(uninterrupted, tmp_path):
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    print(f"kill moments drawn with seed {seed}")
    out = tmp_path / "healed"
    proc = launch(out, *RUN, env={"RESTARTS": "3"})
    for n, (rank, after) in enumerate(((1, rng.randint(1, 4)), (2, rng.randint(6, 8))), 1):  # a learner, the sampler
        wait_until(lambda: len(rows(out)) >= after and len(ranks(proc)) == 3, proc)
        # inside a step, a sync or a save, wherever it falls, but before the last steps: a
        # rank killed in its exit is another fault (it has said it is done)
        time.sleep(rng.uniform(0, 0.3))
        pid, done = ranks(proc)[rank], len(rows(out))
        os.kill(pid, signal.SIGKILL)
        killed = time.time()
        # Training again: the restarted rank 0's first row. Its log's header names the
        # restart; it then cuts metrics.jsonl back to the checkpoint it resumes and appends.
        header = f", restart {n}:"
        wait_until(lambda: header in (out / "logs" / "rank_0.log").read_text(errors="replace"), proc)
        started, resumed = time.time(), int((latest(out) or "step_0")[5:])
        wait_until(lambda: os.path.getmtime(out / "metrics.jsonl") > started and len(rows(out)) > resumed, proc)
        print(
            f"rank {rank} killed after {done} rows: the job restarted {started - killed:.1f} s later from step "
            f"{resumed}, and trained again (its first row) {time.time() - killed:.1f} s after the kill"
        )
    raw = finish(proc)
    lines = console_lines(raw)
    print("\n".join(lines))
    assert proc.returncode == 0, raw.decode()[-3000:]
    restarts = [line for line in lines if line.startswith("restart ")]
    assert len(restarts) == 2, lines
    assert restarts[0].startswith("restart 1 of 3: rank 1 (learner) was killed"), restarts
    assert restarts[1].startswith("restart 2 of 3: rank 2 (sampler) was killed"), restarts
    assert all("the job continues from step" in line for line in restarts)
    assert [r["step"] for r in rows(out)] == list(range(12))  # every step once, none lost or repeated
    a, b = final_weights(uninterrupted), final_weights(out)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)  # bit for bit


def test_a_stopped_sampler_is_named_within_the_bound_and_the_job_restarts(tiny_model, tmp_path):
    out = tmp_path / "hung"
    hang = 5
    proc = launch(out, *RUN[:-4], "--steps", 3, "--hang-seconds", hang, env={"RESTARTS": "1"})
    wait_until(lambda: len(rows(out)) >= 1, proc)
    everyone = ranks_of(proc)
    os.kill(everyone[2], signal.SIGSTOP)
    stopped = time.time()
    try:
        # the watchdog's line goes to the console and to the watcher's log
        wait_until(lambda: any("sent no heartbeat" in open(p).read() for p in logs(out)), proc, timeout=60)
        seen = time.time() - stopped
        raw = finish(proc)
    finally:  # should the watchdog fail, no stopped rank or its waiting peers outlive the test
        for pid in everyone.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    lines = console_lines(raw)
    print("\n".join(lines), f"\nstopped sampler seen after {seen:.1f} s (--hang-seconds {hang})")
    assert proc.returncode == 0, raw.decode()[-3000:]
    assert seen < hang + 5  # the bound: --hang-seconds, plus a beat, plus this test's polling
    named = [line for line in lines if "sent no heartbeat" in line]
    assert len(named) == 1 and named[0].startswith("rank 2 (sampler) sent no heartbeat for "), lines
    assert any(line.startswith("restart 1 of 1: rank 2 (sampler) stopped sending heartbeats") for line in lines)
    assert [r["step"] for r in rows(out)] == [0, 1, 2]


def logs(out):
    folder = out / "logs"
    return [folder / n for n in os.listdir(folder) if n.startswith("rank_")] if folder.exists() else []


def check(out, *args):
    """launch.sh's own check of the flags (no model, no store): what --resume resolves to."""
    env = {**rank0_env(), "GROUP_RANK": "0"}
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "job.py"), "check", *map(str, [*RUN, "--out-dir", out, *args])],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_broken_newest_checkpoint_falls_back_and_another_config_is_refused(uninterrupted, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    r = check(out, "--resume", "auto")
    assert r.returncode == 0 and r.stderr == "", r.stderr  # the newest, step_12, silently
    shard = out / "checkpoints" / "step_12" / "train_state" / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)  # a file cut short, as a full disk or a kill mid-copy leaves it
    os.remove(out / "checkpoints" / "step_10" / "model.safetensors")  # and a missing file
    r = check(out, "--resume", "auto")
    print(r.stderr)
    assert r.returncode == 0, r.stderr
    said = r.stderr.splitlines()
    assert len(said) == 3 and "step_12 is broken: train_state/__1_0.distcp has" in said[0], said
    assert "step_10 is incomplete: model.safetensors is missing" in said[1], said
    assert said[2] == f"job.py: --resume: falling back to {out}/checkpoints/step_8", said
    r = check(out, "--resume", "auto", "--lr", "3e-5")
    assert r.returncode == 2 and "holds a run with another config (lr: " in r.stderr, r.stderr
    assert check(out, "--resume", "auto", "--steps", 20, "--eval-every", 5).returncode == 0  # what may change


def test_a_full_disk_keeps_the_previous_checkpoint_and_stops_in_one_line(tiny_model, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    # A real full disk: a 10 MB tmpfs holds one 6 MB checkpoint of the tiny model, not two.
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root only): {mounted.stderr.decode().strip()}")
    try:
        out = disk / "run"
        proc = launch(out, *RUN[:-4], "--steps", 4, "--save-every", 2)
        raw = finish(proc)
        lines = console_lines(raw)
        print("\n".join(lines))
        assert proc.returncode == 1, raw.decode()[-3000:]
        said = [line for line in lines if "not saved (no space left on device" in line]
        assert said and f"the previous one, {out}/checkpoints/step_2, is intact" in said[0], lines
        assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_2"]  # its temporary folder gone
        assert check(out, "--resume", out / "checkpoints" / "step_2", "--steps", 4).returncode == 0  # complete
        r = check(out, "--resume", "auto", "--steps", 4)  # a restart would only fill the disk again
        assert r.returncode == 2 and "MB free and a checkpoint takes" in r.stderr, r.stderr
    finally:
        subprocess.run(["umount", "-l", str(disk)])


# ---------------------------------------------------------------- the parts, without a run


def test_restart_flags_are_refused_in_one_line(capsys):
    assert "would resume the run it replaces" in refusal(capsys, "--overwrite --resume auto")
    assert "--hang-seconds must be >= 0" in refusal(capsys, "--hang-seconds -1")


def fake_checkpoint(root, step):
    """A folder with what checkpoint_error reads, and its manifest."""
    import json

    from checkpoint import MANIFEST, file_sizes

    path = root / "checkpoints" / f"step_{step}"
    (path / "train_state").mkdir(parents=True)
    (path / "trainer.json").write_text(json.dumps({"step": step, "config": {"lr": 1e-5}}))
    (path / "config.json").write_text("{}")
    (path / "train_state" / ".metadata").write_bytes(b"m" * 10)
    (path / "train_state" / "__0_0.distcp").write_bytes(b"x" * 100)
    (path / MANIFEST).write_text(json.dumps(file_sizes(path)))
    return path


def test_the_newest_complete_checkpoint_is_found_and_broken_ones_named(tmp_path):
    from checkpoint import find_checkpoint

    assert find_checkpoint("auto", tmp_path) == ("", [])  # nothing yet: a fresh start
    with pytest.raises(ValueError, match="no checkpoint to resume"):
        find_checkpoint("latest", tmp_path)
    two, ten = fake_checkpoint(tmp_path, 2), fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 4)
    (tmp_path / "checkpoints" / "step_12.tmp").mkdir()  # a save cut short is never a candidate
    assert find_checkpoint("auto", tmp_path) == (str(ten), [])  # by step number: 10 after 4
    with open(ten / "train_state" / "__0_0.distcp", "r+b") as f:
        f.truncate(60)
    path, skipped = find_checkpoint("latest", tmp_path)
    assert path.endswith("step_4") and skipped == [
        f"checkpoint {ten} is broken: train_state/__0_0.distcp has 60 bytes of the 100 written"
    ]
    assert find_checkpoint(str(two), tmp_path) == (str(two), [])
    for step in (2, 4):
        os.remove(tmp_path / "checkpoints" / f"step_{step}" / "config.json")
    with pytest.raises(ValueError, match="no complete checkpoint in .*step_10 is broken.*step_4 is incomplete"):
        find_checkpoint("auto", tmp_path)  # never a fresh start over a run whose checkpoints all broke
    with pytest.raises(ValueError, match="config.json is missing"):
        find_checkpoint(str(two), tmp_path)


def test_the_restart_line_names_the_rank_and_the_cause(tmp_path):
    import torch.distributed as dist

    import watchdog

    (tmp_path / "logs").mkdir()
    store = dist.HashStore()
    before = watchdog.attempt_store(store, 0)
    for r, beat in enumerate([105.0, 103.0, 101.0]):  # rank 2 stopped first
        before.set(f"beat/{r}", repr(beat))
    (tmp_path / "logs" / "rank_2.log").write_text("rank 2 (sampler), pid 9: job.py\nsampling\n\rbar 1\rbar 2\n")
    (tmp_path / "logs" / "rank_1.log").write_text(
        "x\nValueError: boom\n\nrank 1 (learner), pid 7, restart 1: job.py\nnew\n"
    )
    os.environ["TORCHELASTIC_MAX_RESTARTS"] = "3"
    try:
        line = watchdog.restart_line(store, 1, 3, 2, str(tmp_path), 0)
        assert line == (
            "restart 1 of 3: rank 2 (sampler) was killed without an error of its own (a signal: kill -9, the OOM "
            "killer, a lost node); its log ends: bar 2; the job continues from step 0 (no checkpoint yet)"
        )
        before.set("exit/2", "1")  # it exited after all: of the ranks that did not, the first to stop beating
        assert "rank 1 (learner) was killed" in watchdog.restart_line(store, 1, 3, 2, str(tmp_path), 4)
        before.set("failed", "1")  # a rank that failed with an error is the cause, with its last line
        line = watchdog.restart_line(store, 1, 3, 2, str(tmp_path), 4)
        assert (
            line
            == "restart 1 of 3: rank 1 (learner) failed: ValueError: boom; the job continues from step 4, its newest complete checkpoint"
        )
        before.set("hung", "2 0")  # the watchdog's finding comes first
        assert "rank 2 (sampler) stopped sending heartbeats" in watchdog.restart_line(store, 1, 3, 2, str(tmp_path), 4)
    finally:
        del os.environ["TORCHELASTIC_MAX_RESTARTS"]
