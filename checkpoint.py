"""Surviving interruption: preemption signals, and finding, saving and loading the
checkpoints that make a resumed run the run it would have been."""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.api as dcp_api

import console

PREEMPTED = 75  # exit status of every rank after a SIGTERM/SIGINT and a clean checkpoint
STOP = {"at": None, "abortable": False}  # when this rank was first signalled; inside abortable()


class Preempted(BaseException):
    """A stop signal cut this rank's step short. A BaseException, like KeyboardInterrupt, so
    that no `except Exception` on the way (a reward's, vLLM's) swallows it."""


def on_signal(signum, frame):
    """First SIGTERM/SIGINT: stop soon, whatever the step's length. Inside abortable() (a
    sampler's sampling, scoring or eval) the work ends here, with Preempted; elsewhere the
    flag is read at the next stopping point (a learner's next micro-batch or sync). A
    second signal a second or more later exits at once (torchrun forwards the signal that
    a terminal or a scheduler already sent the whole job, so an immediate repeat is the
    same one)."""
    if STOP["at"] is None:
        STOP["at"] = time.time()
        if STOP["abortable"]:
            raise Preempted
    elif time.time() - STOP["at"] > 1.0:
        os._exit(PREEMPTED)


@contextlib.contextmanager
def abortable():
    """Work that a stop signal may cut short at any point (Preempted is raised inside it),
    because nothing of it is kept: a sampler's requests, rewards or eval of one step."""
    STOP["abortable"] = True
    try:
        if STOP["at"] is not None:
            raise Preempted
        yield
    finally:
        STOP["abortable"] = False


def exit_preempted():
    """Exit PREEMPTED. Further signals are ignored from here: the exit tears down vLLM or
    the process groups, and a repeated SIGTERM meanwhile (torchrun's, once a first rank has
    exited) must not turn this rank's status into -15."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(PREEMPTED)


def stop_agreed(device):
    """Whether any learner was signalled: all of them stop at the same step."""
    flag = torch.tensor([float(STOP["at"] is not None)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


MANIFEST = "manifest.json"  # every file of a checkpoint and its size, written last


def checkpoint_error(path):
    """Why the checkpoint folder `path` cannot be resumed (missing, cut short, corrupt),
    or None. Sizes, not checksums: hashing a large model's optimizer state at every save
    would cost seconds per gigabyte; a file of the right size with flipped bytes is
    caught only where its loader checks it (trainer.json's JSON, safetensors' header)."""
    trainer = os.path.join(path, "trainer.json")
    try:
        with open(trainer) as f:
            json.load(f)["step"]
    except FileNotFoundError:
        return f"checkpoint {path} is incomplete: trainer.json is missing"
    except (ValueError, KeyError) as e:
        return f"{trainer} is corrupt ({e})"
    for name in ("config.json", os.path.join("train_state", ".metadata")):
        if not os.path.exists(os.path.join(path, name)):
            return f"checkpoint {path} is incomplete: {name} is missing"
    listed = os.path.join(path, MANIFEST)
    if not os.path.exists(listed):
        return None  # written before manifests: the checks above are all there is
    try:
        with open(listed) as f:
            sizes = json.load(f)
    except ValueError as e:
        return f"{listed} is corrupt ({e})"
    for name, size in sizes.items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return f"checkpoint {path} is incomplete: {name} is missing"
        if os.path.getsize(file) != size:
            return f"checkpoint {path} is broken: {name} has {os.path.getsize(file)} bytes of the {size} written"
    return None


def file_sizes(folder):
    """{path under folder: bytes} of every file in it: a checkpoint's manifest."""
    sizes = {}
    for root, _, files in os.walk(folder):
        for name in files:
            sizes[os.path.relpath(os.path.join(root, name), folder)] = os.path.getsize(os.path.join(root, name))
    return sizes


def find_checkpoint(resume, out_dir):
    """(the checkpoint folder to resume from, the reasons the newer ones were passed over),
    checked before anything loads. `latest` and `auto` take the newest complete checkpoint
    of out_dir, so a broken newest one falls back to the one before; `auto` with no
    checkpoint at all gives "", a fresh start. A folder given by path must be complete.
    Raises ValueError with a one-line reason."""
    if resume not in ("latest", "auto"):
        if error := checkpoint_error(resume):
            raise ValueError(error)
        return resume, []
    root = os.path.join(out_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    steps = sorted((int(n[5:]) for n in names if re.fullmatch(r"step_\d+", n)), reverse=True)
    skipped = []
    for step in steps:
        path = os.path.join(root, f"step_{step}")
        if (error := checkpoint_error(path)) is None:
            return path, skipped
        skipped.append(error)
    if skipped:  # never a fresh start over a run whose checkpoints are all broken
        raise ValueError(f"no complete checkpoint in {root}: {'; '.join(skipped)}")
    if resume == "auto":
        return "", []
    raise ValueError(f"no checkpoint to resume in {out_dir} ({root} holds none)")


def config_changes(saved, cfg, free):
    """The fields, other than those in `free`, in which cfg differs from a saved config
    (a checkpoint's or run.json's): ["lr: 1e-05 -> 2e-05", ...]."""
    now = dataclasses.asdict(cfg)
    return [f"{k}: {saved[k]!r} -> {v!r}" for k, v in now.items() if k not in free and k in saved and saved[k] != v]


def start_step(cfg):
    """The first step this run takes: 0, or the resumed checkpoint's."""
    if not cfg.resume:
        return 0
    with open(os.path.join(cfg.resume, "trainer.json")) as f:
        return json.load(f)["step"]


def save_checkpoint(cfg, learner, step, metrics, tokenizer):
    """out_dir/checkpoints/step_<step>: the policy in Hugging Face format, the sharded
    training state, every learner's RNG state, trainer.json (step, LR schedule, config,
    that step's metrics) and, last, the manifest of every file's size. Written under a
    temporary name and renamed when complete; `latest` moves only after that, so a kill
    at any moment leaves `latest` on a complete checkpoint. A save that fails (a full
    disk) removes its temporary folder and stops the run in one line, the previous
    checkpoint untouched: going on unsaved would let a week's run end with nothing to
    resume. All learners call it; rank 0 holds the tokenizer."""
    root = os.path.join(cfg.out_dir, "checkpoints")
    rank = dist.get_rank()
    final, tmp = os.path.join(root, f"step_{step}"), os.path.join(root, f"step_{step}.tmp")
    started = time.time()
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        learner.save(tmp, tokenizer)
        schedule = learner.save_state(os.path.join(tmp, "train_state"))
        torch.save(torch.get_rng_state(), os.path.join(tmp, f"rng_{rank}.pt"))
        dist.barrier()
        if rank == 0:
            with open(os.path.join(tmp, "trainer.json"), "w") as f:
                json.dump(
                    {"step": step, "schedule": schedule, "config": dataclasses.asdict(cfg), "metrics": metrics}, f
                )
            sizes = file_sizes(tmp)
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(sizes, f)
    except (Exception, dcp_api.CheckpointException) as e:  # the latter is a BaseException
        # torch.distributed.checkpoint wraps each rank's error in its own exception
        cause = [x for x, _ in e.failures.values()] if isinstance(e, dcp_api.CheckpointException) else [e]
        if any(isinstance(x, dist.DistError) or console.gloo_peer_error(x) for x in cause):
            raise  # a peer died mid-save: its failure, not this save's (console.Failures)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        marker = os.path.join(root, "latest")
        previous = os.path.join(root, open(marker).read().strip()) if os.path.exists(marker) else None
        kept = (
            f"the previous one, {previous}, is intact (--resume continues from it)"
            if previous
            else "no earlier checkpoint exists"
        )
        # A full disk is told by the space left, not by the error: torch's writers report
        # it as a RuntimeError about a zip position.
        if short := disk_short(previous, root):
            why = (
                f"no space left on device: {short[0] / 2**20:.1f} MB free, a checkpoint takes {short[1] / 2**20:.1f} MB"
            )
        else:
            why = save_error(cause[0] if cause else e)
        raise SystemExit(f"rank {rank}: checkpoint {final} not saved ({why}); {kept}")
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(f"step_{step}\n")
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        kept = sorted((d for d in os.listdir(root) if re.fullmatch(r"step_\d+", d)), key=lambda d: int(d[5:]))
        for old in kept[: -cfg.keep_last] if cfg.keep_last else []:
            shutil.rmtree(os.path.join(root, old))
        console.log.info(f"checkpoint {final} saved in {time.time() - started:.2f} s")
    dist.barrier()


def save_error(error):
    """A failed save's reason in a few words."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror.lower()
    return str(error).splitlines()[0]


def disk_short(previous, folder):
    """(free, needed) bytes where `folder`'s disk cannot hold one more checkpoint the size
    of `previous` (1 MB where there is none yet); None where it can."""
    need = sum(file_sizes(previous).values()) if previous else 2**20
    free = shutil.disk_usage(folder).free
    return (free, need) if free < need else None


def load_checkpoint(learner, path):
    """Restore what save_checkpoint wrote into the learner; a half-read state must never
    train on, so any failure stops the run with the reason."""
    try:
        with open(os.path.join(path, "trainer.json")) as f:
            trainer = json.load(f)
        learner.load_state(os.path.join(path, "train_state"), trainer["schedule"])
        rng = os.path.join(path, f"rng_{dist.get_rank()}.pt")
        if os.path.exists(rng):
            torch.set_rng_state(torch.load(rng))
    except Exception as e:
        raise SystemExit(f"--resume: cannot load {path}: {e}")
