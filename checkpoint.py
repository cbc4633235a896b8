"""Surviving interruption: preemption signals, and finding, saving and loading the
checkpoints that make a resumed run the run it would have been."""

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist

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


def find_checkpoint(resume, out_dir):
    """The checkpoint folder to resume from, checked complete before anything loads.
    Raises ValueError with a one-line reason."""
    path = resume
    if path == "latest":
        marker = os.path.join(out_dir, "checkpoints", "latest")
        if not os.path.exists(marker):
            raise ValueError(f"no checkpoint to resume in {out_dir} ({marker} does not exist)")
        path = os.path.join(out_dir, "checkpoints", open(marker).read().strip())
    trainer = os.path.join(path, "trainer.json")
    try:
        with open(trainer) as f:
            json.load(f)["step"]
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path} is incomplete: trainer.json is missing")
    except (ValueError, KeyError) as e:
        raise ValueError(f"{trainer} is corrupt ({e})")
    for name in ("config.json", os.path.join("train_state", ".metadata")):
        if not os.path.exists(os.path.join(path, name)):
            raise ValueError(f"checkpoint {path} is incomplete: {name} is missing")
    return path


def start_step(cfg):
    """The first step this run takes: 0, or the resumed checkpoint's."""
    if not cfg.resume:
        return 0
    with open(os.path.join(cfg.resume, "trainer.json")) as f:
        return json.load(f)["step"]


def save_checkpoint(cfg, learner, step, metrics, tokenizer):
    """out_dir/checkpoints/step_<step>: the policy in Hugging Face format, the sharded
    training state, every learner's RNG state, and trainer.json (step, LR schedule,
    config, that step's metrics). Written under a temporary name and renamed when
    complete; `latest` moves only after that, so a kill at any moment leaves `latest` on
    a complete checkpoint. All learners call it; rank 0 holds the tokenizer."""
    root = os.path.join(cfg.out_dir, "checkpoints")
    rank = dist.get_rank()
    final, tmp = os.path.join(root, f"step_{step}"), os.path.join(root, f"step_{step}.tmp")
    started = time.time()
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
            json.dump({"step": step, "schedule": schedule, "config": dataclasses.asdict(cfg), "metrics": metrics}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(f"step_{step}\n")
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        kept = sorted(
            (d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp")), key=lambda d: int(d[5:])
        )
        for old in kept[: -cfg.keep_last] if cfg.keep_last else []:
            shutil.rmtree(os.path.join(root, old))
        console.log.info(f"checkpoint {final} saved in {time.time() - started:.2f} s")
    dist.barrier()


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
