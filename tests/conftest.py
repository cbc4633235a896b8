import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from comm import free_port  # noqa: E402  (tests import it from here)

# The shared GSM8K copy: beside the clone, where CI has it (../shared/data/gsm8k).
GSM8K = os.path.normpath(os.path.join(ROOT, "..", "shared", "data", "gsm8k"))
GSM8K_TESTS = set()  # node ids of the tests that take the gsm8k fixture
# A short run: small batches, no eval, no KL, on-policy, float32 (the tests that use it
# assert float32-exact figures), every group kept (at chance most of the tiny model's
# groups are uniform, and dropping them would leave steps with no update to check).
FAST = "--prompts-per-step 4 --group-size 4 --max-new-tokens 16 --eval-every 0 --beta 0 --max-staleness 0".split()
FAST += ["--dtype", "float32", "--no-drop-uniform-groups"]


def rows(out_dir):
    """A run's metrics.jsonl, a dict per line ([] before its first step)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def gsm8k():
    """The shared GSM8K folder; a test that takes it skips where the folder is absent, and
    the end of the run says how its tests went, so a CI log shows that they ran."""
    if not os.path.isdir(GSM8K):
        pytest.skip(f"the shared GSM8K copy is not here ({GSM8K})")
    return GSM8K


def pytest_collection_finish(session):
    GSM8K_TESTS.update(item.nodeid for item in session.items if "gsm8k" in getattr(item, "fixturenames", ()))


def pytest_terminal_summary(terminalreporter):
    if not GSM8K_TESTS:
        return
    outcomes = {}
    for key, reports in terminalreporter.stats.items():
        for r in reports:
            if getattr(r, "nodeid", None) in GSM8K_TESTS and (r.when == "call" or r.outcome != "passed"):
                outcomes[key] = outcomes.get(key, 0) + 1
    found = "found" if os.path.isdir(GSM8K) else "NOT FOUND"
    counts = ", ".join(f"{n} {key}" for key, n in sorted(outcomes.items()))
    terminalreporter.write_line(f"shared GSM8K tests ({GSM8K}: {found}): {counts or 'none run'}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The embedded tiny model, built (with its format warm-up) once per test session in
    a fresh cache, so the suite also proves the build works on a clean machine."""
    import tiny

    # GRPO_TEST_CACHE (a folder) reuses one build across sessions while developing; CI
    # leaves it unset, so every CI run builds the model from scratch.
    cache = os.environ.get("GRPO_TEST_CACHE") or str(tmp_path_factory.mktemp("grpo_cache"))
    os.environ["GRPO_CACHE"] = cache
    path = tiny.tiny_model_dir()
    if not os.path.exists(path):
        tiny.build_tiny_model(path)
    return path


def rank0_env(world_size=3):
    """The environment torchrun gives rank 0 of a one-node job, for running grpo.py
    directly where a check must fail before any store is reached (port 1: none)."""
    env = {"RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(world_size)}
    return {**os.environ, **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def torchrun_cmd(nproc, *args):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        os.path.join(ROOT, "grpo.py"),
        *map(str, args),
    ]


def torchrun(nproc, *args, timeout=600):
    """Run grpo.py under real torchrun; returns the CompletedProcess (stdout+stderr in .stdout)."""
    return subprocess.run(
        torchrun_cmd(nproc, *args),
        cwd=ROOT,
        env=os.environ.copy(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def children(pid):
    """The ranks of a running torchrun job: torchrun starts each in a session of its own."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def rank_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return int(env[b"RANK"])
