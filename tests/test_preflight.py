"""preflight.py, what launch.sh checks before it installs anything: a Python that vLLM
supports (picked among the node's interpreters) and an NVIDIA driver new enough for
torch's CUDA build. The pure functions over many versions, then the command itself over
a PATH of stand-in interpreters."""

import os
import subprocess
import sys

import pytest

import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "version, ok",
    [((3, 9), False), ((3, 10, 12), False), ((3, 11), True), ((3, 12, 1), True), ((3, 14), True), ((3, 15), False)],
)
def test_python_versions_that_vllm_supports(version, ok):
    error = preflight.python_error(version)
    assert (error is None) == ok
    if not ok:
        assert f"Python {version[0]}.{version[1]}" in error and "3.11-3.14" in error


def test_the_first_supported_interpreter_is_picked_and_none_is_refused_in_one_line():
    versions = {"python3": (3, 10), "python3.12": (3, 12), "python3.11": (3, 11)}
    assert preflight.pick_python(preflight.CANDIDATES, versions.get) == ("python3.12", None)
    assert preflight.pick_python(preflight.CANDIDATES, {"python3": (3, 12)}.get) == ("python3", None)
    name, why = preflight.pick_python(preflight.CANDIDATES, {"python3": (3, 10), "python3.9": (3, 9)}.get)
    assert name is None and "python3 is 3.10" in why and "\n" not in why
    assert "no python3 found" in preflight.pick_python(preflight.CANDIDATES, {}.get)[1]


@pytest.mark.parametrize(
    "version, ok",
    [("470.256.02", False), ("535.104.05", False), ("575.57.08", False), ("580.65.06", True), ("590.1", True)],
)
def test_a_driver_older_than_torchs_cuda_build_needs_is_refused(version, ok):
    error = preflight.driver_error(version)
    assert (error is None) == ok
    if not ok:
        assert version in error and str(preflight.MIN_DRIVER) in error and "\n" not in error


def test_the_driver_version_is_read_from_procs_text():
    closed = (
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\nGCC version: gcc 12"
    )
    open_module = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)"
    assert preflight.proc_driver_version(closed) == "535.104.05"
    assert preflight.proc_driver_version(open_module) == "580.65.06"
    assert preflight.proc_driver_version("no driver here") is None


def stand_in(folder, name, version):
    """An executable that answers the version query as that Python would."""
    path = folder / name
    path.write_text(f"#!/bin/sh\necho {version[0]} {version[1]}\n")
    path.chmod(0o755)


def test_the_command_picks_a_supported_python_from_path_or_refuses(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir, "python3", (3, 10))
    command = [sys.executable, os.path.join(ROOT, "preflight.py"), "python"]
    env = {"PATH": str(bin_dir)}
    refused = subprocess.run(command, env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()] and "python3 is 3.10" in refused.stderr
    stand_in(bin_dir, "python3.11", (3, 11))
    picked = subprocess.run(command, env=env, capture_output=True, text=True)
    assert picked.returncode == 0 and picked.stdout.strip() == str(bin_dir / "python3.11"), picked.stderr
