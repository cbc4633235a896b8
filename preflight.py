"""What launch.sh checks on a node before it installs anything, each a one-line refusal:
a Python that vLLM supports, and on GPUs a driver new enough for torch's CUDA build.
It runs under whatever python3 the node has, before .venv exists, so it keeps to the
standard library and to syntax that old Pythons still parse.

    python3 preflight.py python   # prints the interpreter to build .venv with, or exits 2
    python3 preflight.py driver   # exits 2 if the NVIDIA driver is too old for torch
"""

import re
import shutil
import subprocess
import sys

# vLLM's wheels (requirements.txt) are built for these Pythons only; pip on another
# fails deep inside the resolver with no word about the version.
PYTHONS = ((3, 11), (3, 14))
# torch's PyPI wheel of the version requirements.txt pins is built for CUDA 13.0, whose
# kernels need an NVIDIA driver of this branch or newer; an older one shows every GPU
# but fails every rank at torch.cuda.set_device.
MIN_DRIVER = 580
CANDIDATES = ("python3", "python3.12", "python3.13", "python3.11", "python3.14")


def python_error(version):
    """None if vLLM supports this (major, minor), else why not."""
    low, high = PYTHONS
    if low <= tuple(version[:2]) <= high:
        return None
    return "Python %d.%d: vLLM needs Python %d.%d-%d.%d" % (tuple(version[:2]) + low + high)


def pick_python(candidates, version_of):
    """(the first candidate whose version vLLM supports, None) or (None, the refusal).
    version_of(name) -> (major, minor), or None where that interpreter is absent."""
    seen = []
    for name in candidates:
        version = version_of(name)
        if version is None:
            continue
        if python_error(version) is None:
            return name, None
        seen.append("%s is %d.%d" % ((name,) + tuple(version[:2])))
    low, high = PYTHONS
    found = "; ".join(seen) or "no python3 found"
    why = "launch.sh: vLLM needs Python %d.%d-%d.%d (%s): install one, or set PYTHON3=/path/to/python3.12"
    return None, why % (low + high + (found,))


def version_of(name):
    path = shutil.which(name)
    if path is None:
        return None
    try:
        out = subprocess.run([path, "-c", "import sys; print(*sys.version_info[:2])"], stdout=subprocess.PIPE)
        return tuple(int(x) for x in out.stdout.split())
    except (OSError, ValueError):
        return None


def driver_error(version):
    """None if the driver version string ('580.65.06') can run torch's CUDA build, else why not."""
    if version is None:
        return None  # no driver to read: the GPU count said GPUs, torch will say more
    major = int(version.split(".")[0])
    if major >= MIN_DRIVER:
        return None
    return (
        "launch.sh: NVIDIA driver %s is older than %d, which torch's CUDA 13.0 build (requirements.txt) needs:"
        " update the driver, or install a torch built for the CUDA this driver supports" % (version, MIN_DRIVER)
    )


def proc_driver_version(text):
    """The version in /proc/driver/nvidia/version's text ('... Kernel Module  580.65.06  ...',
    or '... Open Kernel Module for x86_64  580.65.06 ...'), or None."""
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", text)
    return found.group(1) if found else None


def driver_version():
    """The loaded NVIDIA kernel module's version, from /proc or nvidia-smi; None if neither says."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            return proc_driver_version(f.read())
    except OSError:
        pass
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        first = subprocess.run(query, stdout=subprocess.PIPE).stdout.decode().split()
        return first[0] if first else None
    except OSError:
        return None


def main(argv):
    if argv == ["python"]:
        name, why = pick_python(CANDIDATES, version_of)
    elif argv == ["driver"]:
        name, why = None, driver_error(driver_version())
    else:
        name, why = None, "usage: python3 preflight.py python|driver"
    if why:
        print(why, file=sys.stderr)
        sys.exit(2)
    if name:
        print(shutil.which(name))


if __name__ == "__main__":
    main(sys.argv[1:])
