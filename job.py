"""The job, and the file torchrun runs: one torchrun world split into learner ranks (FSDP2,
grpo.py's loss) and sampler ranks (an in-process vLLM engine each); main places a rank
and runs its role.

    torchrun --nproc_per_node 3 job.py --learners 2      (or: bash launch.sh)

The step's protocol. Both roles issue these collectives in this order, so each role's loop
reads as this table (S is --max-staleness):

  | group    | sender -> receivers         | payload                                  | when                         |
  |----------|-----------------------------|------------------------------------------|------------------------------|
  | rollout  | samplers -> learners        | the engine's dtypes                      | once, before the learners load |
  | weights  | learner 0 -> samplers       | go (0) or stop (1)                       | each sync, first             |
  | weights  | learner 0 -> samplers       | the weights, in sync_plan's buckets      | each sync, after go          |
  | rollout  | samplers -> learners        | eval sums, or {"stopped"}                | after a sync, on eval steps  |
  | rollout  | samplers -> learners        | the step's rollouts, or {"stopped"}      | each step                    |
  | learners | learners <-> learners       | stop? (all-reduce), then FSDP's own      | each sync; each micro-batch  |

A sync sends the weights of step k. S=0: before step k is sampled. S=1: after the rollouts
of step k are exchanged, so that the samplers draw k+1 with them while the learners train
k; the first step and the final weights sync before, as at S=0. A stop (SIGTERM, SIGINT):
a sampler answers {"stopped"} in place of its report; learners drop their step between
micro-batches; either way learner 0 checkpoints the last complete step and sends stop (1)
at the next go/stop flag, which every rank then meets (checkpoint.py). Beside the table,
every rank beats into the job's store each second (watchdog.py): one silent for
--hang-seconds ends the job like a crash, and under launch.sh's RESTARTS torchrun then
restarts it from the newest checkpoint, its store keys under a prefix of its own."""

import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import checkpoint
import console
import lora
import metrics
import sandbox
import watchdog
from comm import (
    bucket_plan,
    control,
    exchange,
    from_samplers,
    make_group,
    placement,
    plan_bytes,
    receive_weights,
    send_weights,
    visible_gpus,
    wire_dtype,
)
from config import Config, check_placement, cpu_has_bf16, fail, parse_flags, resolve
from data import load_prompts, shard, step_indices
from episodes import run_episodes, start_env
from evals import evaluate, write_samples
from grpo import bind_objective, train_step
from models import weight_plan
from report import write_report_safely, write_run_info
from rewards import check_failures, parse_reward_spec, score_batch
from tiny import model_path
from tools import load_tools


@dataclass
class Link:
    """This rank's ends of the job's groups (the table above)."""

    rollout: object  # gloo, every rank: rollouts, evals and stops, samplers -> learners
    weights: object | None  # learner 0 and the samplers: go/stop and the weights; None on other learners
    device: torch.device  # where the weights travel: the GPU under NCCL, else the CPU


def syncs_before_sampling(cfg, step, first):
    """Whether the weights of `step` reach the samplers before they sample it. With
    --max-staleness 1 they arrive just after, so that the samplers draw step k+1 with
    step k's weights while the learners train step k; the first step of a run, and the
    final weights (for the last eval), always sync first."""
    return cfg.max_staleness == 0 or step in (first, cfg.steps)


def eval_due(cfg, step):
    return cfg.eval_only or (cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.steps))


# ---------------------------------------------------------------- a sampler


def run_sampler(cfg, path, index, num_samplers, link, device, gpu_memory):
    from sampler import Sampler  # vLLM: heavy, and only a sampler needs it

    # Data first: a bad dataset stops the job before the engine loads.
    tokenizer, reward_fns, prompts, eval_prompts = load_data(cfg, path, index)
    context = cfg.max_prompt_len + cfg.max_new_tokens
    engine = Sampler(path, context, cfg.seed, cfg.dtype, gpu_memory, cfg.sampler_kv_cache_gb, cfg.compile)
    # Ready, and what the learners need to cut the same bucket plan: the engine's dtypes.
    # The learners wait for this before they load their model, so on a shared GPU vLLM
    # sizes its cache before the learner allocates.
    exchange(link.rollout, {"engine_dtype": engine.dtype, "kept_dtypes": engine.kept_dtypes})
    buckets = sync_plan(cfg, path, engine.dtype, engine.kept_dtypes)
    base = lora.base_for_engine(path) if cfg.lora_rank else None
    env, env_pool = start_env(cfg)  # episodes: one turn, or several with the environment
    episodes = partial(run_episodes, engine, cfg=cfg, tokenizer=tokenizer, env=env, env_pool=env_pool)
    share = range(index, len(eval_prompts), num_samplers)
    evaluate_share = partial(evaluate, episodes, eval_prompts, share, cfg, reward_fns)
    first = checkpoint.start_step(cfg)
    weights_step = first
    # One step more than training: the last sync brings the final weights for the last eval.
    for step in range(first, cfg.steps + 1):
        before = syncs_before_sampling(cfg, step, first)
        if before:
            weights_step = load_step_weights(cfg, step, engine, link, buckets, base, evaluate_share)
        if step == cfg.steps:
            break
        batch = shard(
            [prompts[i] for i in step_indices(len(prompts), step, cfg.prompts_per_step, cfg.seed)], index, num_samplers
        )
        report = sample_step(cfg, step, batch, episodes, reward_fns, key=(cfg.seed, step, index))
        send_report(link, {**report, "weights_step": weights_step, "peak_memory_mb": metrics.peak_memory_mb(device)})
        if not before:
            weights_step = load_step_weights(cfg, step, engine, link, buckets, base, evaluate_share)


def load_data(cfg, path, index):
    """(tokenizer, rewards, training prompts, held-out prompts), the rows checked for the rewards."""
    tokenizer = load_tokenizer(path)
    reward_fns = parse_reward_spec(cfg.rewards)
    fields = dict(prompt_field=cfg.prompt_field, messages_field=cfg.messages_field)
    if cfg.tools:  # the prompts show the tools; the environment's workers read the list from GRPO_TOOLS
        fields["tools"] = load_tools(cfg.tools)
        os.environ["GRPO_TOOLS"] = cfg.tools
    if index == 0 and (
        "code_tests" in [n for n, _, _ in reward_fns] or "python" in cfg.tools.replace(" ", "").split(",")
    ):
        console.say(sandbox.mode()[1])  # which isolation the model's code runs under, once a job
    load = partial(
        load_prompts, tokenizer=tokenizer, max_prompt_len=cfg.max_prompt_len, reward_fns=reward_fns, **fields
    )
    prompts = load(cfg.dataset, cfg.split) if cfg.steps else []
    eval_prompts = []
    if cfg.eval_every or cfg.eval_only:
        eval_prompts = load(cfg.eval_dataset or cfg.dataset, "test")[: cfg.eval_size or None]
    return tokenizer, reward_fns, prompts, eval_prompts


def sample_step(cfg, step, batch, episodes, reward_fns, key):
    """This sampler's rollouts of one step, scored, with its counts and timings; or
    {"stopped": True} when a signal cut it short. `key` seeds every request."""
    t1 = time.time()
    try:
        # A stop signal ends this at once, mid-request or mid-reward: the step is
        # dropped and redone on --resume, where a long step would outlast the grace.
        with checkpoint.abortable():
            rollouts, env_counts = episodes(batch, cfg.group_size, cfg.temperature, key)
            t2 = time.time()
            # Rewards see the whole episode; the completion they score is its last answer.
            records = [{**batch[i // cfg.group_size], "turns": c.turns} for i, c in enumerate(rollouts)]
            totals, parts, counts = score_batch(
                [c.text for c in rollouts], records, reward_fns, step, cfg.reward_timeout, cfg.reward_workers
            )
            # A broken reward or environment must not train the model on zeros for hours:
            # past the fraction, this sampler stops, and with it the job.
            check_failures(counts, cfg.max_reward_errors, step)
            if cfg.env:
                check_failures(env_counts, cfg.max_reward_errors, step, "environment")
    except checkpoint.Preempted:
        return {"stopped": True}
    for c, total, p in zip(rollouts, totals, parts):
        c.reward, c.parts = total, p
    report = {"rollouts": rollouts, "reward_counts": counts, "sample_s": t2 - t1, "reward_s": time.time() - t2}
    return {**report, "env_counts": env_counts} if cfg.env else report


def send_report(link, report):
    """This sampler's part of an exchange. A signal that cut a sampler's work short
    (its report is {"stopped": True}) ends the run at this exchange for every rank:
    the learners checkpoint, then the samplers hear stop at the go/stop flag and exit."""
    if any(r and r.get("stopped") for r in exchange(link.rollout, report)):
        control(link.weights, 0, link.device)
        checkpoint.exit_preempted()


def load_step_weights(cfg, step, engine, link, buckets, base, evaluate_share):
    """Load the weights of `step` (or stop), then evaluate them when an eval is due. Returns `step`."""
    if control(link.weights, 0, link.device):
        checkpoint.exit_preempted()  # the learners saved a checkpoint and stop too
    weights = receive_weights(link.weights, buckets, link.device)
    if cfg.lora_rank:
        # Only the adapters travel: they are merged into the base weights this sampler
        # started from, so the engine's in-place reload runs the plain model at full speed.
        weights = lora.merged_weights(base, dict(weights), cfg.lora_alpha / cfg.lora_rank)
    engine.load_weights(weights)
    if eval_due(cfg, step):
        try:  # a collective never runs inside abortable(): all ranks must join it or none
            with checkpoint.abortable():
                result = {"eval": evaluate_share(step)}
        except checkpoint.Preempted:
            result = {"stopped": True}
        send_report(link, result)
    return step


# ---------------------------------------------------------------- a learner


@dataclass
class Trainer:
    """What a learner's phases share. Only rank 0 writes: its logs and bar are None elsewhere."""

    cfg: Config
    rank: int
    learner: object  # learner.Learner: the sharded policy and its optimizer
    link: Link
    buckets: list  # the weight sync's plan (sync_plan)
    timing: dict  # the sync's fixed figures: its megabytes and one in-memory copy's seconds
    tokenizer: object = None  # saved beside every checkpoint
    log: object = None  # metrics.jsonl
    samples_log: object = None  # samples.jsonl
    bar: object = None  # the console's progress bar
    reporter: object = None  # wandb or TensorBoard, with --report-to
    row: dict = field(default_factory=dict)  # the last complete step's metrics, saved with a checkpoint


def run_learner(cfg, path, rank, link, device):
    from learner import learner_from_config  # transformers and FSDP: heavy, and only a learner needs them

    started = time.time()
    engine_dtypes = from_samplers(link.rollout)[0]  # the samplers are ready; their engine's dtypes
    learner = learner_from_config(cfg, path, init_device_mesh(device.type, (cfg.learners,)), device, engine_dtypes)
    first = checkpoint.start_step(cfg)
    if cfg.resume:
        checkpoint.load_checkpoint(learner, cfg.resume)
    t = open_trainer(cfg, path, rank, learner, link, engine_dtypes, first)
    objective = bind_objective(cfg)  # its parameters resolved once per run
    skips, last = 0, time.time()
    for step in range(first, cfg.steps + 1):
        before = syncs_before_sampling(cfg, step, first)
        extra = sync_weights(t, step) if before else {}
        if step == cfg.steps:
            if "eval_length" in extra:
                write_row(t, {"step": step, **extra})
            break
        t1 = time.time()
        reports = collect(t, step)
        wait_s = time.time() - t1
        if not before:
            extra = sync_weights(t, step)
        rollouts = [c for r in reports for c in r["rollouts"]]
        keep = metrics.sample_indices(cfg, step, len(rollouts))  # samples.jsonl's, with the learner's log-probs
        row = train(
            t, step, rollouts, reports, objective, keep, wait_s, ahead=not syncs_before_sampling(cfg, step + 1, first)
        )
        row.update(extra, step_s=time.time() - last)
        last = time.time()
        # Every learner sees the same global norm, so all of them skip alike.
        skips = 0 if math.isfinite(row["grad_norm"]) else skips + 1
        row["skipped"] = int(skips > 0)
        t.row = row
        write_row(t, row, [(i, rollouts[i]) for i in keep])
        if skips:  # on the console from rank 0 only (every learner sees the same norm)
            console.warn(f"step {step}: non-finite grad norm, optimizer step skipped ({skips} in a row)")
            if skips >= cfg.max_skips:
                raise SystemExit(
                    f"rank {rank}: {skips} consecutive steps with a non-finite loss or grad norm (--max-skips {cfg.max_skips}); aborting"
                )
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            checkpoint.save_checkpoint(cfg, learner, step + 1, row, t.tokenizer)
    finish(t, started)


def open_trainer(cfg, path, rank, learner, link, engine_dtypes, first):
    """The sync's plan, and on rank 0 the run's outputs: its memory estimate, run.json,
    the logs (opened past `first`, the step a resumed run starts at) and the progress bar."""
    buckets = sync_plan(cfg, path, engine_dtypes["engine_dtype"], engine_dtypes["kept_dtypes"])
    timing = {"sync_memcpy_s": 0.0, "sync_mb": plan_bytes(buckets) / 2**20}
    t = Trainer(cfg, rank, learner, link, buckets, timing)
    if rank != 0:
        return t
    seq = cfg.max_prompt_len + cfg.max_new_tokens
    memory = learner.memory_line(
        cfg.learners, cfg.max_tokens_per_microbatch or cfg.micro_batch_size * seq, seq, cfg.gradient_checkpointing
    )
    (console.warn if "WARNING" in memory else console.log.info)(memory)  # on the console when it may not fit
    write_run_info(cfg, path)  # the config, the model folder and the machine, for report.html
    # The yardstick of the sync's speed: one in-memory copy of the same bytes.
    t.timing["sync_memcpy_s"] = metrics.memcpy_seconds(plan_bytes(buckets), link.device)
    t.tokenizer = load_tokenizer(path)
    t.log = metrics.open_log(os.path.join(cfg.out_dir, "metrics.jsonl"), first)
    t.samples_log = metrics.open_log(os.path.join(cfg.out_dir, "samples.jsonl"), first)
    t.bar = console.progress_bar(first, cfg.steps)
    t.reporter = metrics.open_reporter(cfg)
    return t


def sync_weights(t, step):
    """Send the weights of `step` (or, when signalled, checkpoint and stop), then
    collect the samplers' eval of them when one is due. Returns the sync's metrics."""
    if checkpoint.stop_agreed(t.learner.device):
        stop(t, step)
    t0 = time.time()
    if t.link.weights is not None:
        control(t.link.weights, 0, t.link.device)
    send_weights(t.link.weights, t.learner.full_tensor, t.buckets, t.link.device)
    timing = {"sync_s": time.time() - t0, **t.timing}
    if not eval_due(t.cfg, step):
        return timing
    t1 = time.time()
    reports = collect(t, step)
    evals = metrics.merge_evals(reports)
    if t.rank == 0:
        write_samples(t.cfg.out_dir, step, reports)
        write_report_safely(t.cfg.out_dir, console.warn)  # with this eval's samples
        console.say(metrics.eval_line(step, evals))
    return {**timing, "eval_s": time.time() - t1, **evals}


def collect(t, step):
    """The samplers' reports, or the stop of one that a signal cut short."""
    reports = from_samplers(t.link.rollout)
    if any(r.get("stopped") for r in reports):
        stop(t, step)
    return reports


def train(t, step, rollouts, reports, objective, keep, wait_s, ahead):
    """One optimizer step on the step's rollouts, reduced over the learners into the
    step's metrics row. A signal drops the step between two micro-batches, on every
    learner alike; `ahead`: the samplers are already sampling step + 1, whose report
    must be taken before they listen for the stop."""
    lr = t.learner.schedule.get_last_lr()[0]
    t3 = time.time()
    try:
        sums, token_sums, maxima, grad_norm = train_step(
            t.cfg,
            t.learner,
            rollouts,
            t.rank,
            stop=lambda: checkpoint.stop_agreed(t.learner.device),
            objective=objective,
            keep=keep,
        )
    except checkpoint.Preempted:
        if ahead:
            from_samplers(t.link.rollout)
        stop(t, step)
    maxima["peak_memory_mb"] = metrics.peak_memory_mb(t.learner.device)
    train_s = time.time() - t3
    (sums, token_sums), maxima = metrics.reduce_metrics([sums, token_sums], maxima, t.learner.device)
    return metrics.step_metrics(step, rollouts, reports, sums, token_sums, maxima, grad_norm, lr, wait_s, train_s)


def stop(t, step):
    """A signal reached a learner or a sampler: checkpoint the weights as they are,
    those that start `step` (a step cut short left them untouched), tell the samplers
    at their next go/stop flag, exit 75. --resume redoes `step`."""
    checkpoint.save_checkpoint(t.cfg, t.learner, step, t.row, t.tokenizer)
    if t.link.weights is not None:
        control(t.link.weights, 1, t.link.device)
    saved = os.path.join(t.cfg.out_dir, "checkpoints", f"step_{step}")
    console.preempted(
        t.cfg.out_dir,
        f"stopped by a signal after step {step}: checkpoint {saved} saved (--resume continues); exit {checkpoint.PREEMPTED}",
        t.rank == 0,
    )
    checkpoint.exit_preempted()


def write_row(t, row, samples=()):
    """Rank 0: the row into metrics.jsonl (and --report-to), the kept rollouts into
    samples.jsonl, and the progress bar one step on (a training row)."""
    if t.rank != 0:
        return
    t.log.write(json.dumps(row) + "\n")
    t.log.flush()
    if t.reporter:
        t.reporter(row)
    if samples:
        t.samples_log.writelines(json.dumps(metrics.sample_row(row["step"], i, c, t.cfg)) + "\n" for i, c in samples)
        t.samples_log.flush()
    if "reward_mean" in row:
        t.bar.update()
        t.bar.set_postfix_str(metrics.progress(row))


def finish(t, started):
    """The final policy, then on rank 0 the summary, the curves and the report."""
    if t.bar:
        t.bar.close()
    if t.cfg.steps:
        t.learner.save(os.path.join(t.cfg.out_dir, "final"), t.tokenizer)
    if t.rank != 0:
        return
    t.log.close()
    console.say(metrics.summary(t.cfg, os.path.join(t.cfg.out_dir, "metrics.jsonl"), time.time() - started))
    if curves := metrics.plot(t.cfg.out_dir):
        console.say(f"curves: {curves}")
    if page := write_report_safely(t.cfg.out_dir, console.warn):
        console.say(f"report: {page}")


# ---------------------------------------------------------------- both roles


def sync_plan(cfg, path, engine_dtype, kept_dtypes):
    """The buckets of one weight sync, which learner 0 and every sampler compute alike, so
    that only flat data travels: every parameter in the dtype the engine keeps it in, or
    with LoRA the adapters alone, in float32 (they are small)."""
    bucket_bytes = int(cfg.sync_bucket_mb * 2**20)
    if cfg.lora_rank:
        plan = lora.model_adapter_plan(path, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets.split(","))
        return bucket_plan(plan, lambda name: torch.float32, bucket_bytes)
    return bucket_plan(weight_plan(path), lambda name: wire_dtype(name, engine_dtype, kept_dtypes), bucket_bytes)


def load_tokenizer(path):
    from transformers import AutoTokenizer  # heavy: not for launch.sh's check or plot

    return AutoTokenizer.from_pretrained(path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        if len(argv) != 2:
            fail("usage: python job.py plot <out_dir>")
        print(metrics.plot(argv[1]) or "")
        return
    # `job.py check FLAGS`: what launch.sh runs before torchrun, with this node's
    # torchrun variables (WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK) and no store: every
    # flag check and every local rank's placement, so that a config that cannot work is
    # refused once, in one line, before any rank starts. Prints the run's folder.
    check = argv[:1] == ["check"]
    cfg = parse_flags(argv[1:] if check else argv)
    if "WORLD_SIZE" not in os.environ:
        fail("run under torchrun, e.g. `torchrun --nproc_per_node 3 job.py --learners 2`, or `bash launch.sh`")
    world, local_world = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    gpus = visible_gpus()
    cfg = resolve(cfg, world, bool(gpus), cpu_has_bf16(), network=check)
    if check:
        check_placement(cfg, world, local_world, int(os.environ.get("GROUP_RANK", "0")), gpus)
        print(cfg.out_dir)
        return
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    place, device = place_rank(cfg, rank, local_rank, local_world, world, gpus)
    os.makedirs(cfg.out_dir, exist_ok=True)
    role = "learner" if place.learner else "sampler"
    restart = watchdog.attempt()  # > 0: torchrun restarted the job after a fault (launch.sh's RESTARTS)
    # From here on this rank's output goes to its log, unless GRPO_VERBOSE=1.
    console.setup(
        cfg.out_dir, rank, role, rank in (0, cfg.learners), append=bool(cfg.resume) or restart > 0, restart=restart
    )
    if rank == 0:
        console.say(console.start_line(cfg, world, local_world, gpus))
        if cfg.dtype == "bfloat16" and not gpus and not cpu_has_bf16():
            console.warn(
                "--dtype bfloat16 on a CPU without AVX512-BF16 or AMX: bf16 is emulated here, several times slower than float32 (README, 'Precision and memory')"
            )
    torch.manual_seed(cfg.seed)
    signal.signal(signal.SIGTERM, checkpoint.on_signal)
    signal.signal(signal.SIGINT, checkpoint.on_signal)
    console.die_with_parent()
    with console.Failures(
        cfg.out_dir, rank, role, quiet_exits=(checkpoint.PREEMPTED,), peer_errors=(dist.DistError,)
    ) as failures:
        timeout = timedelta(minutes=cfg.timeout_minutes)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        failures.store = watchdog.attempt_store(store, restart)
        watchdog.start(rank, world, cfg.learners, cfg.hang_seconds)
        if restart and rank == 0:
            console.clear_marks(cfg.out_dir)  # the attempt before's: launch.sh reads the last attempt's
            console.say(
                watchdog.restart_line(store, restart, world, cfg.learners, cfg.out_dir, checkpoint.start_step(cfg))
            )
        run_role(cfg, rank, local_rank, world, place, device, failures.store, timeout)


def place_rank(cfg, rank, local_rank, local_world, world, gpus):
    """This rank's placement (comm.placement) and its torch device: on a GPU, each rank
    sees only its own, as cuda:0 (vLLM always takes cuda:0)."""
    try:
        cores = len(os.sched_getaffinity(0))
        place = placement(rank, local_rank, local_world, world, cfg.learners, gpus, cfg.sampler_gpu_memory, cores)
    except ValueError as e:
        fail(str(e), every_rank=True)
    torch.set_num_threads(place.threads or torch.get_num_threads())  # CPU-only: comm.cpu_threads
    if place.gpu is None:
        return place, torch.device("cpu")
    os.environ["CUDA_VISIBLE_DEVICES"] = place.gpu
    torch.cuda.set_device(torch.device("cuda", 0))
    return place, torch.device("cuda", 0)


def run_role(cfg, rank, local_rank, world, place, device, store, timeout):
    """The groups of the protocol table on the job's store, then this rank's loop."""
    path = model_path(cfg.model, local_rank)
    link = Link(
        rollout=make_group(store, "rollout", rank, world, "gloo", timeout),
        weights=None,
        device=device if place.weight_backend == "nccl" else torch.device("cpu"),
    )
    if rank == 0 or not place.learner:
        weight_rank = 0 if rank == 0 else rank - cfg.learners + 1
        link.weights = make_group(
            store, "weights", weight_rank, world - cfg.learners + 1, place.weight_backend, timeout
        )
    if place.learner:
        learner_store = dist.PrefixStore("learner", store)
        dist.init_process_group(
            place.learner_backend, store=learner_store, rank=rank, world_size=cfg.learners, timeout=timeout
        )
        run_learner(cfg, path, rank, link, device)
        dist.destroy_process_group()
    else:
        # device: its GPU, whose memory it reports, even where weights arrive through host memory
        run_sampler(cfg, path, rank - cfg.learners, world - cfg.learners, link, device, place.sampler_gpu_memory)
    # The groups made on the store are shut down here, not left to their destructors
    # (torch warns of an NCCL group destroyed without it at exit).
    for pg in (link.weights, link.rollout):
        if pg is not None:
            pg.shutdown()


if __name__ == "__main__":  # `torchrun ... job.py FLAGS`
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
