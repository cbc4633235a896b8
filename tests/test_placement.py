"""Where ranks run on GPUs, decided by pure functions and checked over many simulated
layouts: no GPU here, so this is how the GPU layouts are proven before any GPU run."""

import os
import subprocess

import pytest

from comm import default_layout, placement, visible_gpus
from config import parse_config, resolve
from conftest import ROOT


def layout(nnodes, nproc, learners, gpus):
    """Every rank's placement in a job of nnodes x nproc ranks, each node seeing `gpus`."""
    world = nnodes * nproc
    return [placement(r, r % nproc, nproc, world, learners, gpus) for r in range(world)]


def check(places, nproc, learners, gpus):
    """The invariants NCCL and vLLM need, whatever the layout."""
    slot = [(r // nproc, p.gpu) for r, p in enumerate(places)]  # (node, GPU id)
    learner_slots = [slot[r] for r in range(learners)]
    assert len(set(learner_slots)) == learners, f"two learners share a GPU: {learner_slots}"
    assert all(p.gpu in gpus for p in places), "a rank was given a GPU this node does not show"
    assert [p.learner for p in places] == [r < learners for r in range(len(places))]
    assert {p.learner_backend for p in places if p.learner} == {"cpu:gloo,cuda:nccl"}
    members = [0, *range(learners, len(places))]
    backends = {places[r].weight_backend for r in members}
    assert len(backends) == 1, f"the weight group's members disagree on its backend: {backends}"
    if backends == {"nccl"}:
        assert len({slot[r] for r in members}) == len(members), "NCCL asked to hold two ranks of one group on one GPU"
    for r in range(learners, len(places)):
        share = sum(places[s].sampler_gpu_memory for s in range(learners, len(places)) if slot[s] == slot[r])
        beside_learner = slot[r] in learner_slots
        assert 0 < share <= (0.3 if beside_learner else 0.8) + 1e-9, (r, share)
    return slot, backends.pop()


EIGHT = [str(i) for i in range(8)]


@pytest.mark.parametrize("num_gpus", [1, 2, 3, 4, 5, 6, 7, 8])
def test_launch_defaults_are_valid_for_every_gpu_count(num_gpus):
    gpus = EIGHT[:num_gpus]
    nproc, learners = default_layout(num_gpus)
    slot, backend = check(layout(1, nproc, learners, gpus), nproc, learners, gpus)
    samplers = nproc - learners
    # The default run (64 prompts x 8 completions on the hub model) must pass the flag checks.
    cfg = resolve(parse_config(["--learners", str(learners), "--out-dir", "/nonexistent/run"]), nproc, has_gpu=True)
    assert cfg.prompts_per_step % samplers == 0 and (cfg.prompts_per_step * cfg.group_size) % learners == 0
    if num_gpus == 1:
        assert (nproc, learners) == (2, 1) and backend == "gloo" and slot[0] == slot[1]
    else:
        assert len(set(slot)) == nproc and backend == "nccl", "with 2+ GPUs every rank gets one of its own"
    expected = {1: (2, 1), 2: (2, 1), 3: (3, 1), 4: (4, 2), 5: (5, 1), 6: (6, 2), 7: (6, 2), 8: (8, 4)}
    assert (nproc, learners) == expected[num_gpus]


def test_one_gpu_shared_by_a_learner_and_a_sampler():
    learner, sampler = layout(1, 2, 1, ["0"])
    assert learner.gpu == sampler.gpu == "0"
    assert learner.weight_backend == sampler.weight_backend == "gloo"  # NCCL cannot hold both on one GPU
    assert sampler.sampler_gpu_memory == pytest.approx(0.3) and learner.sampler_gpu_memory == 0.0


@pytest.mark.parametrize(
    "visible, expected", [("0,1", ["0", "1"]), ("2,3", ["2", "3"]), ("GPU-aa11,GPU-bb22", ["GPU-aa11", "GPU-bb22"])]
)
def test_cuda_visible_devices_on_an_eight_gpu_host(tmp_path, visible, expected):
    driver = tmp_path / "gpus"
    driver.mkdir()
    for i in range(8):
        (driver / f"0000:0{i}:00.0").mkdir()
    gpus = visible_gpus({"CUDA_VISIBLE_DEVICES": visible}, str(driver))
    assert gpus == expected
    assert visible_gpus({}, str(driver)) == EIGHT  # no variable: every GPU the driver lists
    nproc, learners = default_layout(len(gpus))
    places = layout(1, nproc, learners, gpus)
    check(places, nproc, learners, gpus)
    assert [p.gpu for p in places] == expected  # learner on the first visible GPU, sampler on the second


def test_no_driver_means_no_gpu_whatever_the_environment(tmp_path):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}, str(tmp_path / "absent")) == []
    places = layout(1, 3, 2, [])
    assert [p.gpu for p in places] == [None] * 3
    assert {p.learner_backend for p in places} == {"gloo"} and {p.weight_backend for p in places} == {"gloo"}


FAKE_SMI = """#!/bin/sh
[ "$1" = "-L" ] || exit 2
for i in $(seq 0 $((FAKE_GPUS - 1))); do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done
"""


@pytest.mark.parametrize("count, visible, expected", [(4, None, 4), (4, "2,3", 2), (2, "-1", 0), (0, "0,1", 0)])
def test_gpus_are_found_without_the_drivers_proc_folder(tmp_path, count, visible, expected):
    """Where /proc/driver/nvidia/gpus is absent (WSL2, some containers) the driver still
    answers `nvidia-smi -L`: launch.sh (before any package is installed) and job.py
    count the same GPUs from it, CUDA_VISIBLE_DEVICES still the filter."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    env = {"PATH": f"{smi.parent}:{os.environ['PATH']}", "FAKE_GPUS": str(count)}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    absent = str(tmp_path / "no_proc_folder")
    os.environ["FAKE_GPUS"] = str(count)  # for the Python side's own nvidia-smi call
    try:
        gpus = visible_gpus({k: v for k, v in env.items() if k == "CUDA_VISIBLE_DEVICES"}, absent, str(smi))
    finally:
        del os.environ["FAKE_GPUS"]
    assert len(gpus) == expected
    if os.path.isdir("/proc/driver/nvidia/gpus"):
        return  # launch.sh reads a real driver here
    shell = subprocess.run(
        ["bash", os.path.join(ROOT, "launch.sh"), "gpus"], env=env, capture_output=True, text=True, timeout=60
    )
    assert shell.returncode == 0 and int(shell.stdout) == expected, shell.stdout + shell.stderr
    assert visible_gpus({}, absent, str(tmp_path / "absent_smi")) == []  # no driver at all


@pytest.mark.parametrize(
    "nnodes, nproc, learners, cores, expected",
    [
        (1, 3, 2, 2, [1, 1, 1]),  # the CPU default on 2 cores: torchrun's one each
        (1, 2, 1, 2, [2, 1]),  # one learner takes both cores; the sampler is done in half a step
        (1, 3, 2, 16, [8, 8, 5]),  # torchrun's one per rank would leave 13 of 16 cores idle
        (1, 4, 1, 8, [8, 2, 2, 2]),
        (2, 3, 4, 4, [1, 1, 1, 4, 1, 1]),  # node 1: one learner (rank 3), two samplers
        (2, 2, 4, 4, [2, 2, 2, 2]),
    ],
)
def test_cpu_threads_give_the_learners_every_core(nnodes, nproc, learners, cores, expected):
    world = nnodes * nproc
    places = [placement(r, r % nproc, nproc, world, learners, [], cores=cores) for r in range(world)]
    assert [p.threads for p in places] == expected
    assert all(p.threads is None for p in layout(1, 3, 2, EIGHT[:3]))  # GPUs: torchrun's setting stays


def test_two_nodes_of_one_gpu():
    nproc, learners = default_layout(1, nnodes=2)
    assert (nproc, learners) == (1, 1)
    slot, backend = check(layout(2, nproc, learners, ["0"]), nproc, learners, ["0"])
    assert slot == [(0, "0"), (1, "0")] and backend == "nccl"  # one GPU per node: each rank has its own


def test_two_nodes_of_eight_gpus():
    nproc, learners = default_layout(8, nnodes=2)
    assert (nproc, learners) == (8, 8)
    slot, backend = check(layout(2, nproc, learners, EIGHT), nproc, learners, EIGHT)
    assert backend == "nccl"
    assert all(node == 0 for node, _ in slot[:8]) and all(node == 1 for node, _ in slot[8:])


@pytest.mark.parametrize(
    "nnodes, nproc, learners, num_gpus",
    [
        (1, 4, 3, 2),  # more learners than GPUs
        (1, 8, 8, 4),
        (2, 2, 2, 1),  # the old launch.sh default for 2 nodes x 1 GPU: both learners on node 0
    ],
)
def test_an_impossible_layout_is_refused_with_the_fix(nnodes, nproc, learners, num_gpus):
    gpus = EIGHT[:num_gpus]
    with pytest.raises(ValueError) as e:
        layout(nnodes, nproc, learners, gpus)
    message = str(e.value)
    assert "\n" not in message and "two learners on one GPU" in message
    assert f"--learners {min(num_gpus, nproc)} or fewer" in message


def test_samplers_sharing_a_gpu_split_its_memory():
    # 2 GPUs, 1 learner, 3 samplers: one sampler has GPU 1... then the others share.
    places = layout(1, 4, 1, ["0", "1"])
    slot, backend = check(places, 4, 1, ["0", "1"])
    assert backend == "gloo"  # two samplers on one GPU: not NCCL
    assert [p.gpu for p in places] == ["0", "1", "1", "1"]
    assert [round(p.sampler_gpu_memory, 3) for p in places[1:]] == [0.267, 0.267, 0.267]


def recipe_flags(path):
    """The recipe script's environment (NPROC, LEARNERS) and job.py flags, read from its
    `... exec bash launch.sh \\` command."""
    text = open(path).read().replace("\\\n", " ")
    command = next(line for line in text.splitlines() if "exec bash launch.sh" in line)
    env, _, flags = command.partition("exec bash launch.sh")
    return dict(kv.split("=") for kv in env.split()), [f for f in flags.split() if f != '"$@"']


def test_the_seed_recipe_is_a_valid_eight_gpu_run():
    env, flags = recipe_flags(os.path.join(ROOT, "recipes", "qwen3_5_4b_gsm8k.sh"))
    nproc, learners = int(env["NPROC"]), int(env["LEARNERS"])
    assert (nproc, learners) == (8, 4)
    cfg = resolve(
        parse_config(["--learners", str(learners), *flags[:-2], "--out-dir", "/nonexistent/run"]), nproc, True
    )
    assert (cfg.model, cfg.dataset, cfg.prompts_per_step, cfg.group_size) == ("Qwen/Qwen3.5-4B", "gsm8k", 8, 8)
    assert (cfg.max_new_tokens, cfg.epsilon, cfg.rewards, cfg.dtype) == (4096, 0.2, "accuracy,format", "bfloat16")
    assert cfg.max_tokens_per_microbatch >= cfg.max_prompt_len + 4096  # one whole sequence fits a micro-batch
    slot, backend = check(layout(1, nproc, learners, EIGHT), nproc, learners, EIGHT)
    assert len(set(slot)) == 8 and backend == "nccl"
    assert all(p.sampler_gpu_memory == pytest.approx(0.8) for p in layout(1, nproc, learners, EIGHT)[learners:])


def test_the_calculator_recipe_is_a_valid_eight_gpu_run():
    env, flags = recipe_flags(os.path.join(ROOT, "recipes", "gsm8k_calculator.sh"))
    nproc, learners = int(env["NPROC"]), int(env["LEARNERS"])
    argv = ["--learners", str(learners), *flags[:-2], "--out-dir", "/nonexistent/run"]
    cfg = resolve(parse_config(argv), nproc, True)
    assert (cfg.model, cfg.tools, cfg.env, cfg.max_turns) == (
        "Qwen/Qwen2.5-1.5B-Instruct",
        "calculator",
        "tools:use_tools",
        4,
    )
    assert cfg.max_tokens_per_microbatch >= cfg.max_prompt_len + cfg.max_new_tokens


def test_every_group_gets_the_one_timeout(monkeypatch):
    """NCCL's own default is 10 minutes; make_group must hand it --timeout-minutes. This
    torch build has no NCCL, so a stand-in records what it is asked for; gloo is real."""
    from datetime import timedelta

    import torch.distributed as dist

    from comm import make_group

    asked = {}

    class NCCL:  # the constructor's signature: (store, rank, size, options)
        class Options:
            _timeout = timedelta(minutes=10)

        def __init__(self, store, rank, size, options):
            asked.update(rank=rank, size=size, timeout=options._timeout)

    monkeypatch.setattr(dist, "ProcessGroupNCCL", NCCL, raising=False)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    make_group(store, "weights", 0, 1, "nccl", timedelta(minutes=30))
    assert asked == {"rank": 0, "size": 1, "timeout": timedelta(minutes=30)}
    assert make_group(store, "rollout", 0, 1, "gloo", timedelta(minutes=30)).options._timeout == timedelta(minutes=30)


def test_request_seeds_never_repeat_across_samplers_steps_and_requests():
    from sampler import request_seed

    keys = [(0, step, sampler, i) for step in range(3) for sampler in range(4) for i in range(64)]
    seeds = [request_seed(*k) for k in keys]
    assert len(set(seeds)) == len(keys) and all(0 <= s < 2**62 for s in seeds)
    # vLLM gives request j's n children seed + j: those never reach another request's seed
    children = {s + j for s in seeds for j in range(8)}
    assert len(children) == 8 * len(keys)
    assert request_seed(0, 1, 2, 3) == request_seed(0, 1, 2, 3) != request_seed(1, 1, 2, 3)


def test_the_sync_yardstick_copies_a_bounded_slice(monkeypatch):
    """metrics.memcpy_seconds times a copy of the synced bytes on learner 0's device, the
    GPU that holds the learner: it must not allocate twice the model there (17 GiB for
    Qwen3.5-4B), only a bounded slice, and scale the time to the whole."""
    import torch

    import metrics

    sizes = []
    empty = torch.empty

    def recording_empty(size, *args, **kwargs):
        sizes.append(size)
        return empty(size, *args, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    seconds = metrics.memcpy_seconds(8 * 2**30, torch.device("cpu"), max_bytes=2**20)
    assert sizes and max(sizes) <= 2**20
    assert 0 < seconds < 60  # 8 GiB at a copy rate of at least 140 MB/s


def test_the_recipe_builds_causal_conv1d_against_the_installed_torch():
    """causal-conv1d compiles on install; under pip's build isolation it would compile
    against whatever torch the index serves, not the pinned one in .venv."""
    with open(os.path.join(ROOT, "recipes", "qwen3_5_4b_gsm8k.sh")) as f:
        installs = [line for line in f if "pip install" in line and "causal-conv1d" in line]
    with open(os.path.join(ROOT, "recipes", "requirements-qwen3_5.txt")) as f:
        listed = [line for line in f if line.strip().startswith("causal-conv1d")]
    assert len(installs) == 1 and "--no-build-isolation" in installs[0] and not listed


def test_a_hub_model_on_cpu_is_checked_without_fetching_its_config():
    """The CPU float32 refusal of hybrid models reads a local folder's config only: a hub
    name is resolved without the network (here there is none)."""
    argv = ["--model", "Qwen/Qwen3.5-4B", "--dtype", "float32", "--learners", "2", "--out-dir", "/nonexistent/run"]
    cfg = resolve(parse_config(argv), 3, has_gpu=False)
    assert (cfg.model, cfg.dtype) == ("Qwen/Qwen3.5-4B", "float32")
