import json
import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "plugins"))  # what the tests plug in: rewards, objectives, workers
from comm import free_port  # noqa: E402  (tests import it from here)

# GSM8K's test split (MIT, OpenAI; tests/gsm8k/LICENSE), kept in the clone so that every
# test runs on a fresh one.
GSM8K = os.path.join(ROOT, "tests", "gsm8k")
# A short run: small batches, no eval, no KL, on-policy, float32 (the tests that use it
# assert float32-exact figures), every group kept (at chance most of the tiny model's
# groups are uniform, and dropping them would leave steps with no update to check).
FAST = "--prompts-per-step 4 --group-size 4 --max-new-tokens 16 --eval-every 0 --beta 0 --max-staleness 0".split()
FAST += ["--dtype", "float32", "--no-drop-uniform-groups"]
# What the suite may leave in the clone: the environment, caches, and nothing else.
UNTOUCHED = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache"}


def rows(out_dir):
    """A run's metrics.jsonl, a dict per line ([] before its first step)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def pytest_configure(config):
    config.addinivalue_line("markers", "system: runs a model (torchrun, vLLM, FSDP); the rest is the fast tier")


def pytest_collection_modifyitems(items):
    """A test that needs a model (the tiny or the real one, directly or through a fixture)
    is a system test; the others are the fast tier: `bash launch.sh test -m "not system"`."""
    for item in items:
        if {"tiny_model", "smollm2"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.system)


@pytest.fixture
def gsm8k():
    """The folder with GSM8K's test split (test.jsonl, 1319 rows)."""
    return GSM8K


@pytest.fixture(autouse=True)
def own_working_dir(tmp_path, monkeypatch):
    """Every test runs in an empty folder of its own: a default --out-dir (runs/default)
    or any other relative path lands there, never in the clone, where the main job may
    have left a run of its own."""
    monkeypatch.chdir(tmp_path)


def tree_state():
    """(path, size, mtime) of every file in the clone outside UNTOUCHED."""
    state = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in UNTOUCHED]
        for name in files:
            st = os.stat(os.path.join(folder, name))
            state.add((os.path.relpath(os.path.join(folder, name), ROOT), st.st_size, st.st_mtime_ns))
    return state


def pytest_sessionstart(session):
    session.config.tree_before = tree_state()


def pytest_sessionfinish(session, exitstatus):
    """The suite fails if it wrote into the clone (a run, a checkpoint, a stray file):
    its tests must not depend on, nor leave, the working tree's state."""
    touched = sorted({path for path, *_ in tree_state() ^ session.config.tree_before})
    if touched:
        print(
            f"\nthe test suite (or another job in this clone) changed files in {ROOT}: {', '.join(touched[:10])}",
            file=sys.stderr,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def grpo_cache(tmp_path_factory):
    """The models' cache (GRPO_CACHE) for this test session: fresh, so the suite also
    proves the builds work on a clean machine. GRPO_TEST_CACHE (a folder) reuses one
    across sessions while developing; CI leaves it unset."""
    cache = os.environ.get("GRPO_TEST_CACHE") or str(tmp_path_factory.mktemp("grpo_cache"))
    os.environ["GRPO_CACHE"] = cache
    return cache


@pytest.fixture(scope="session")
def tiny_model(grpo_cache):
    """The embedded tiny model, built (with its format warm-up) once per test session."""
    import tiny

    path = tiny.tiny_model_dir()
    if not os.path.exists(path):
        tiny.build_tiny_model(path)
    return path


@pytest.fixture(scope="session")
def smollm2(grpo_cache):
    """A real pretrained model, SmolLM2-135M-Instruct, built from its registry package
    once per test session (tests/plugins/smollm2.py); skips, saying why, where it cannot be had."""
    from smollm2 import build_smollm2, missing_requirements, smollm2_dir

    if reason := missing_requirements():
        pytest.skip(f"the real pretrained model cannot be built: {reason}")
    path = smollm2_dir()
    if not os.path.exists(path):
        try:
            build_smollm2(path)
        except RuntimeError as e:
            pytest.skip(f"the real pretrained model cannot be built: {e}")
    return path


@pytest.fixture
def gloo_world():
    """This process as a one-rank gloo group, for a Learner built in the test itself."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def refusal(capsys, args, world_size=3):
    """The one line (and exit status 2) a config is refused with, before any model loads."""
    from config import parse_config, resolve

    with pytest.raises(SystemExit) as e:
        resolve(parse_config([*args.split(), "--out-dir", "/nonexistent/run"]), world_size=world_size, has_gpu=False)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, (args, err)
    return err


def rank0_env(world_size=3):
    """The environment torchrun gives rank 0 of a one-node job, for running job.py
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
        os.path.join(ROOT, "job.py"),
        *map(str, args),
    ]


def torchrun(nproc, *args, timeout=600):
    """Run job.py under real torchrun; returns the CompletedProcess (stdout+stderr in .stdout)."""
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


VLLM_LOGPROBS = """
import json, sys
from sampler import Sampler
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
engine = Sampler(sys.argv[1], 256, seed=0, dtype="float32")
ids = json.loads(sys.argv[2])
out = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
print("LOGPROBS", json.dumps([lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:])]))
"""


def transformers_vs_vllm(folder, text):
    """The largest gap between the log-probs of `text`'s tokens under transformers and
    under vLLM (a process of its own), both loading the model folder in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    hf = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    run = subprocess.run(
        [sys.executable, "-c", VLLM_LOGPROBS, str(folder), json.dumps(ids)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in run.stdout.splitlines() if x.startswith("LOGPROBS")), None)
    assert line, run.stderr[-3000:]
    return (hf - torch.tensor(json.loads(line[len("LOGPROBS ") :]))).abs().max().item()


# One frame of a progress bar: tqdm redraws it in place, frames apart by '\r'.
BAR = re.compile(r"(grpo|tiny model warm-up): +\d+%\|[^|]*\| \d+/\d+ \[[^\]]*\] *")


def launch(out, *args, env=None):
    env = {**os.environ, "PYTHON": sys.executable, "MASTER_PORT": str(free_port()), **(env or {})}
    env.pop("GRPO_VERBOSE", None)
    cmd = ["bash", os.path.join(ROOT, "launch.sh"), *map(str, args), "--out-dir", str(out)]
    # A session of its own, so that stop() can end launch.sh and torchrun at once (the
    # ranks die with torchrun) should launch.sh leave torchrun behind.
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def console_lines(raw):
    """What the console shows besides the progress bar: its lines, less the bar's frames
    and the blanks tqdm leaves when it clears the bar's line to write above it."""
    lines = []
    for line in raw.decode().split("\n"):
        lines += [f for f in line.split("\r") if f.strip() and not BAR.fullmatch(f)]
    return lines


def ranks_of(launcher):
    """{rank: pid} of a running launch.sh: its child is torchrun, whose children are the ranks."""
    return {rank_of(pid): pid for torchrun in children(launcher.pid) for pid in children(torchrun)}
