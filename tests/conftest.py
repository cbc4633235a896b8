import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k")


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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()), os.path.join(ROOT, "grpo.py"), *map(str, args)]


def torchrun(nproc, *args, timeout=600):
    """Run grpo.py under real torchrun; returns the CompletedProcess (stdout+stderr in .stdout)."""
    return subprocess.run(torchrun_cmd(nproc, *args), cwd=ROOT, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
