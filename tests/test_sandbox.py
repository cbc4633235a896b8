"""The sandbox (sandbox.py) against hostile programs: directly, as a code task's tests in
a real run (code_tests), and as python tool calls in a real multi-turn run."""

import json
import os
import socket
import subprocess

import pytest
from hostile import programs, write_task

import checkpoint
import sandbox
from conftest import FAST, rows, torchrun
from tasks.code import code_tests, extract_code

SECRET = "GRPO_TEST_SECRET"
SECRET_VALUE = "s3cret-2f9c1e7a"
bubblewrap = pytest.mark.skipif(
    sandbox.mode()[0] != "bubblewrap", reason=f"no bubblewrap here ({sandbox.mode()[1]}); .ci/run installs it"
)


@pytest.fixture
def listener():
    """A TCP listener on 127.0.0.1 that no sandboxed program may reach: yields (port, accepted)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    accepted = []

    def check():
        try:
            accepted.append(server.accept())
        except BlockingIOError:
            pass
        return accepted

    yield server.getsockname()[1], check
    server.close()


def survivors():
    """Processes a harm meant to outlive its call (their argv names 3617)."""
    found = subprocess.run(["pgrep", "-f", "sleep 3617"], capture_output=True, text=True).stdout.split()
    return [p for p in found if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]


def home_probe(tmp_path):
    """A file that stands for the home folder's: a harm that reads or deletes it must fail."""
    marker = os.path.expanduser("~/.cache/grpo-sandbox-probe")
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    with open(marker, "w") as f:
        f.write(SECRET_VALUE)
    return marker


@bubblewrap
def test_every_harm_is_stopped_and_named(tmp_path, listener, monkeypatch):
    """Each hostile program ends in an error or harmlessly, and afterwards: the run folder
    and the home folder are intact, the secret was never printed, nothing it started
    runs, no connection reached the listener, and the caller's memory did not grow."""
    port, accepted = listener
    monkeypatch.setenv(SECRET, SECRET_VALUE)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.pt").write_bytes(b"weights")
    marker = home_probe(tmp_path)
    rss = int(open("/proc/self/statm").read().split()[1])
    results = {name: sandbox.run(code, timeout=3) for name, code in programs(run_dir, port, SECRET).items()}
    for name, r in results.items():
        assert r["error"] is not None or name == "outlive", (name, r)
        assert "deleted" not in r["stdout"] and SECRET_VALUE not in r["stdout"] + r["stderr"], (name, r)
    assert results["endless_loop"]["error"].startswith("timeout")
    assert results["memory_bomb"]["error"] == "MemoryError"
    assert "Resource temporarily unavailable" in results["fork_bomb"]["error"]
    assert "No space left on device" in results["fill_disk"]["error"]
    assert results["forge_fds"]["error"].endswith("wrote to 2 descriptors")  # its own stdout and stderr only
    assert "Connection refused" in results["socket"]["error"] or "unreachable" in results["socket"]["error"]
    assert (run_dir / "checkpoint.pt").read_bytes() == b"weights"
    assert open(marker).read() == SECRET_VALUE
    assert not accepted() and not survivors()
    assert int(open("/proc/self/statm").read().split()[1]) - rss < 64 << 20 >> 12  # pages: under 64 MB


def test_the_fallback_holds_the_limits_it_claims(tmp_path, monkeypatch):
    """GRPO_SANDBOX=fallback: no isolation (named at start), but the limits on time,
    memory, file size and open files, a scrubbed environment, no inherited descriptors,
    an empty working folder removed after and capped output all hold."""
    monkeypatch.setenv("GRPO_SANDBOX", "fallback")
    monkeypatch.setenv(SECRET, SECRET_VALUE)
    monkeypatch.setattr(sandbox, "_mode", None)
    kind, line = sandbox.mode()
    assert kind == "fallback" and "no filesystem or network isolation" in line
    inherited = os.open(os.devnull, os.O_WRONLY)
    os.set_inheritable(inherited, True)
    try:
        checks = {
            "while True: pass": "timeout: ran past 2 s",
            "x = bytearray(2 << 30)": "MemoryError",
            "open('big', 'wb').write(b'x' * (32 << 20))": "OSError: [Errno 27] File too large",
            "fs = [open('/dev/null') for _ in range(100)]": "OSError: [Errno 24] Too many open files: '/dev/null'",
            f"import os; os.write({inherited}, b'forged')": "OSError: [Errno 9] Bad file descriptor",
        }
        for code, error in checks.items():
            assert sandbox.run(code, timeout=2)["error"] == error, code
    finally:
        os.close(inherited)
    seen = sandbox.run("import os, json; print(json.dumps([dict(os.environ), os.getcwd(), os.listdir('.')]))")
    env, cwd, files = json.loads(seen["stdout"])
    assert SECRET not in env and files == [] and not os.path.exists(cwd)
    assert len(sandbox.run("print('x' * (1 << 22))")["stdout"]) == sandbox.OUTPUT_CAP


def test_code_tests_scores_the_fraction_passing():
    record = {"tests": ["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 7"]}
    assert extract_code("Here:\n```python\nx = 1\n```\nthen\n```python\ndef f(x):\n    return 2 * x\n```") == (
        "def f(x):\n    return 2 * x\n"
    )
    assert code_tests("```python\ndef f(x):\n    return 2 * x\n```", record) == pytest.approx(2 / 3)
    assert code_tests("def f(x): return {1: 2, 2: 4, 3: 7}[x]", record) == 1.0
    assert code_tests("def f(x) return", record) == 0.0  # does not compile
    assert code_tests("import os\nos._exit(0)", record) == 0.0  # an exit is no pass
    assert code_tests("print('0 0')\ndef f(x): return 0", record) == 0.0  # nor is a forged line
    assert code_tests.check({"tests": []}) and code_tests.check({"tests": ["assert 1"]}) is None


def test_the_python_tool_reports_output_or_error():
    import tools

    assert tools.call([tools.python], json.dumps({"name": "python", "arguments": {"code": "print(6 * 7)"}})) == "42\n"
    reply = tools.call([tools.python], json.dumps({"name": "python", "arguments": {"code": "print(1)\n1 / 0"}}))
    assert reply == "1\nerror: ZeroDivisionError: division by zero"


@bubblewrap
def test_hostile_completions_in_a_real_run_harm_nothing(tiny_model, tmp_path, listener):
    """A real run (torchrun, vLLM, FSDP) of a code task whose every row's test is a harm,
    with the python tool running the same harm in a second turn: every harm scores 0, the
    sandbox's errors are counted in the step's metrics, the run ends cleanly with its
    checkpoint, and nothing leaked, survived, connected or grew."""
    port, accepted = listener
    out, data = tmp_path / "run", tmp_path / "harms.jsonl"
    write_task(data, out, port, SECRET)
    marker = home_probe(tmp_path)
    flags = [*FAST, "--model", tiny_model, "--dataset", data, "--rewards", "code_tests", "--steps", 3]
    flags += ["--prompts-per-step", 4, "--group-size", 2, "--max-new-tokens", 48, "--reward-workers", 2]
    flags += ["--env", "tests.plugins.hostile:through_python_tool", "--max-turns", 2, "--samples-every", 1]
    flags += ["--save-every", 1, "--reward-timeout", 20, "--max-reward-errors", 1, "--out-dir", out]
    os.environ[SECRET] = SECRET_VALUE
    try:
        result = torchrun(2, *flags, timeout=900)
    finally:
        del os.environ[SECRET]
    assert result.returncode == 0, result.stdout[-5000:]
    assert "sandbox: bubblewrap" in result.stdout
    train = [r for r in rows(out) if "loss" in r]
    assert len(train) == 3 and all(r["reward_errors"] == 0 for r in train), train
    assert sum(r["sandbox_errors"] for r in train) >= 3 * 8 - 2 * 2, train  # every tool call's harm but outlive's
    assert all(r["peak_memory_mb_sampler"] < 4000 for r in train), train  # the memory bomb grew no trainer
    samples = (out / "samples.jsonl").read_text()
    for s in map(json.loads, samples.splitlines()):  # a harm scores 0; spawning a process is no failure in itself
        question = next(m["content"] for m in s["turns"] if m["role"] == "user")
        assert s["reward"] == (question == "Write outlive."), s
        tool = [m["content"] for m in s["turns"] if m["role"] == "tool"]
        assert all(("error: " in reply) == (question != "Write outlive.") for reply in tool), s
    assert any(m["role"] == "tool" for s in map(json.loads, samples.splitlines()) for m in s["turns"]), samples
    everything = result.stdout + samples + (out / "metrics.jsonl").read_text()
    assert SECRET_VALUE not in everything and "deleted" not in everything
    assert open(marker).read() == SECRET_VALUE
    assert checkpoint.find_checkpoint("latest", str(out))[0].endswith("step_3")  # complete, as the run wrote it
    assert not accepted() and not survivors()
