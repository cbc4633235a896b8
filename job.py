"""The job: one torchrun world split into learner ranks (FSDP2, grpo.py's loss) and sampler
ranks (an in-process vLLM engine each), and main, which places a rank and runs its role.

    torchrun --nproc_per_node 3 grpo.py --learners 2      (or: bash launch.sh)

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
at the next go/stop flag, which every rank then meets (checkpoint.py)."""

import json
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import checkpoint
import console
import lora
import metrics
import sandbox
from comm import (
    bucket_plan,
    control,
    die_with_parent,
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
from config import check_placement, cpu_has_bf16, fail, hub_model_error, parse_flags, resolve
from data import load_prompts, shard, step_indices
from episodes import check_env_failures, run_episodes, start_env
from evals import evaluate, write_samples
from grpo import Rollout, bind_objective, train_step
from models import text_to_checkpoint, weight_plan
from report import write_report_safely, write_run_info
from rewards import check_failures, parse_reward_spec, score_batch
from tiny import build_tiny_model, tiny_model_dir
from tools import load_tools


def syncs_before_sampling(cfg, step, first):
    """Whether the weights of `step` reach the samplers before they sample it. With
    --max-staleness 1 they arrive just after, so that the samplers draw step k+1 with
    step k's weights while the learners train step k; the first step of a run, and the
    final weights (for the last eval), always sync first."""
    return cfg.max_staleness == 0 or step in (first, cfg.steps)


def eval_due(cfg, step):
    return cfg.eval_only or (cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.steps))


def run_sampler(cfg, path, index, num_samplers, weight_pg, rollout_pg, device, weight_device, gpu_memory):
    from sampler import Sampler  # vLLM: heavy, and only a sampler needs it

    # Data first: a bad dataset stops the job before the engine loads (rows checked for the rewards).
    tokenizer = load_tokenizer(path)
    reward_fns = parse_reward_spec(cfg.rewards)
    fields = dict(prompt_field=cfg.prompt_field, messages_field=cfg.messages_field)
    if cfg.tools:  # the prompts show the tools; the environment's workers read the list from GRPO_TOOLS
        fields["tools"] = load_tools(cfg.tools)
        os.environ["GRPO_TOOLS"] = cfg.tools
    if index == 0 and (
        "code_tests" in [name for name, _, _ in reward_fns] or "python" in [t.strip() for t in cfg.tools.split(",")]
    ):
        console.say(sandbox.mode()[1])  # which isolation the model's code runs under, once a job
    prompts = (
        load_prompts(cfg.dataset, cfg.split, tokenizer, cfg.max_prompt_len, reward_fns, **fields) if cfg.steps else []
    )
    eval_prompts = []
    if cfg.eval_every or cfg.eval_only:
        eval_prompts = load_prompts(
            cfg.eval_dataset or cfg.dataset, "test", tokenizer, cfg.max_prompt_len, reward_fns, **fields
        )
        eval_prompts = eval_prompts[: cfg.eval_size or None]
    context = cfg.max_prompt_len + cfg.max_new_tokens
    engine = Sampler(path, context, cfg.seed, cfg.dtype, gpu_memory, cfg.sampler_kv_cache_gb, cfg.compile)
    # Ready, and what the learners need to cut the same bucket plan: the engine's dtypes.
    # The learners wait for this before they load their model, so on a shared GPU vLLM
    # sizes its cache before the learner allocates.
    exchange(rollout_pg, {"engine_dtype": engine.dtype, "kept_dtypes": engine.kept_dtypes})
    buckets = sync_plan(cfg, path, engine.dtype, engine.kept_dtypes)
    if cfg.lora_rank:
        # Only the adapters travel: this sampler holds the base weights it started from
        # and merges them in before the engine's in-place reload, which then runs the
        # plain model at full speed, with no LoRA kernels.
        # The base under the trained model's names (a composite stores its text model under
        # others, and its vision tower, which the text-only engine lacks, is left out).
        stored = lora.load_base(path)
        names = text_to_checkpoint([n for n, _ in weight_plan(path)], stored)
        base = {n: stored[c] for n, c in names.items() if c in stored}

    env, env_pool = start_env(cfg)  # episodes: one turn, or several with the environment

    def episodes(batch, n, temperature, key):
        return run_episodes(engine, batch, n, cfg, temperature, key, tokenizer, env, env_pool)

    def send(report):
        """This sampler's part of an exchange. A signal that cut a sampler's work short
        (its report is {"stopped": True}) ends the run at this exchange for every rank:
        the learners checkpoint, then the samplers hear stop at the go/stop flag and exit."""
        if any(r and r.get("stopped") for r in exchange(rollout_pg, report)):
            control(weight_pg, 0, weight_device)
            checkpoint.exit_preempted()

    def sync(step):
        """Load the weights of `step` (or stop), then evaluate them when an eval is due."""
        if control(weight_pg, 0, weight_device):
            checkpoint.exit_preempted()  # the learners saved a checkpoint and stop too
        weights = receive_weights(weight_pg, buckets, weight_device)
        if cfg.lora_rank:
            weights = lora.merged_weights(base, dict(weights), cfg.lora_alpha / cfg.lora_rank)
        engine.load_weights(weights)
        if eval_due(cfg, step):
            try:  # a collective never runs inside abortable(): all ranks must join it or none
                with checkpoint.abortable():
                    share = range(index, len(eval_prompts), num_samplers)
                    result = {"eval": evaluate(episodes, eval_prompts, share, cfg, reward_fns, step)}
            except checkpoint.Preempted:
                result = {"stopped": True}
            send(result)
        return step

    first = checkpoint.start_step(cfg)
    weights_step = first
    # One step more than training: the last sync brings the final weights for the last eval.
    for step in range(first, cfg.steps + 1):
        if syncs_before_sampling(cfg, step, first):
            weights_step = sync(step)
        if step == cfg.steps:
            break
        t1 = time.time()
        batch = shard(
            [prompts[i] for i in step_indices(len(prompts), step, cfg.prompts_per_step, cfg.seed)], index, num_samplers
        )
        key = (cfg.seed, step, index)  # seeds every request of this step on this sampler
        try:
            # A stop signal ends this at once, mid-request or mid-reward: the step is
            # dropped and redone on --resume, where a long step would outlast the grace.
            with checkpoint.abortable():
                completions, env_counts = episodes(batch, cfg.group_size, cfg.temperature, key)
                rollouts = [Rollout(**c) for c in completions]
                t2 = time.time()
                # Rewards see the whole episode; the completion they score is its last answer.
                records = [{**batch[i // cfg.group_size], "turns": c.turns} for i, c in enumerate(rollouts)]
                totals, parts, counts = score_batch(
                    [c.text for c in rollouts], records, reward_fns, step, cfg.reward_timeout, cfg.reward_workers
                )
                # A broken reward must not train the model on zeros for hours: past the
                # fraction, this sampler stops, and with it the job.
                check_failures(counts, cfg.max_reward_errors, step)
                check_env_failures(env_counts, len(rollouts), cfg.max_reward_errors, step)
        except checkpoint.Preempted:
            send({"stopped": True})  # and exits
        for c, total, p in zip(rollouts, totals, parts):
            c.reward, c.parts = total, p
        report = {"rollouts": rollouts, "weights_step": weights_step, "reward_counts": counts, "sample_s": t2 - t1}
        if cfg.env:
            report["env_counts"] = env_counts
        report.update(reward_s=time.time() - t2, peak_memory_mb=metrics.peak_memory_mb(device))
        send(report)
        if not syncs_before_sampling(cfg, step, first):
            weights_step = sync(step)


def run_learner(cfg, path, rank, weight_pg, rollout_pg, device, weight_device):
    from learner import Learner  # transformers and FSDP: heavy, and only a learner needs them

    started = time.time()
    engine_dtypes = from_samplers(rollout_pg)[0]  # the samplers are ready; their engine's dtypes
    mesh = init_device_mesh(device.type, (cfg.learners,))
    adapters = (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets.split(",")) if cfg.lora_rank else None
    learner = Learner(
        path,
        mesh,
        device,
        cfg.lr,
        cfg.weight_decay,
        cfg.gradient_checkpointing,
        reference=cfg.beta > 0,
        warmup_steps=cfg.warmup_steps,
        compute_dtype=getattr(torch, cfg.dtype),
        lora=adapters,
        logprob_chunk=cfg.logprob_chunk,
        teacher=cfg.teacher,
        compile=cfg.compile,
        kept_dtypes=engine_dtypes["kept_dtypes"],
    )
    if rank == 0:  # in the log; on the console too when it may not fit
        memory = learner.memory_line(
            cfg.learners,
            cfg.max_tokens_per_microbatch or cfg.micro_batch_size * (cfg.max_prompt_len + cfg.max_new_tokens),
            cfg.max_prompt_len + cfg.max_new_tokens,
            cfg.gradient_checkpointing,
        )
        (console.warn if "WARNING" in memory else console.log.info)(memory)
    tokenizer = load_tokenizer(path) if rank == 0 else None  # saved beside every checkpoint
    if rank == 0:
        write_run_info(cfg, path)  # the config, the model folder and the machine, for report.html
    objective = bind_objective(cfg)  # its parameters resolved once per run
    first = checkpoint.start_step(cfg)
    if cfg.resume:
        checkpoint.load_checkpoint(learner, cfg.resume)
    buckets = sync_plan(cfg, path, engine_dtypes["engine_dtype"], engine_dtypes["kept_dtypes"])
    sync_mb = plan_bytes(buckets) / 2**20
    # Only rank 0 writes metrics, so only it measures the yardstick.
    memcpy_s = metrics.memcpy_seconds(plan_bytes(buckets), weight_device) if rank == 0 else 0.0
    log = metrics.open_log(os.path.join(cfg.out_dir, "metrics.jsonl"), first) if rank == 0 else None
    samples_log = metrics.open_log(os.path.join(cfg.out_dir, "samples.jsonl"), first) if rank == 0 else None
    bar = tqdm(
        initial=first, total=cfg.steps, desc="grpo", disable=rank != 0, file=console.stream(), bar_format=console.BAR
    )
    report = metrics.open_reporter(cfg) if rank == 0 else None

    def write_row(row):
        log.write(json.dumps(row) + "\n")
        log.flush()
        if report:
            report(row)

    def stop(step, row):
        """A signal reached a learner or a sampler: checkpoint the weights as they are,
        those that start `step` (a step cut short left them untouched), tell the samplers
        at their next go/stop flag, exit 75. --resume redoes `step`."""
        checkpoint.save_checkpoint(cfg, learner, step, row, tokenizer)
        if weight_pg is not None:
            control(weight_pg, 1, weight_device)
        saved = os.path.join(cfg.out_dir, "checkpoints", f"step_{step}")
        console.preempted(
            cfg.out_dir,
            f"stopped by a signal after step {step}: checkpoint {saved} saved (--resume continues); exit {checkpoint.PREEMPTED}",
            rank == 0,
        )
        checkpoint.exit_preempted()

    def collect(step, row):
        """The samplers' reports, or the stop of one that a signal cut short."""
        reports = from_samplers(rollout_pg)
        if any(r.get("stopped") for r in reports):
            stop(step, row)
        return reports

    def sync(step, row):
        """Send the weights of `step` (or, when signalled, checkpoint and stop), then
        collect the samplers' eval of them when one is due."""
        if checkpoint.stop_agreed(device):
            stop(step, row)
        t0 = time.time()
        if weight_pg is not None:
            control(weight_pg, 0, weight_device)
        send_weights(weight_pg, learner.full_tensor, buckets, weight_device)
        timing = {"sync_s": time.time() - t0, "sync_memcpy_s": memcpy_s, "sync_mb": sync_mb}
        if not eval_due(cfg, step):
            return timing
        t1 = time.time()
        reports = collect(step, row)
        evals = metrics.merge_evals(reports)
        if rank == 0:
            write_samples(cfg.out_dir, step, reports)
            write_report_safely(cfg.out_dir, console.warn)  # with this eval's samples
        if rank == 0:
            console.say(metrics.eval_line(step, evals))
        return {**timing, "eval_s": time.time() - t1, **evals}

    skips, row, last = 0, {}, time.time()
    for step in range(first, cfg.steps + 1):
        before = syncs_before_sampling(cfg, step, first)
        extra = sync(step, row) if before else {}
        if step == cfg.steps:
            if rank == 0 and "eval_length" in extra:
                write_row({"step": step, **extra})
            break
        t1 = time.time()
        reports = collect(step, row)
        t2 = time.time()
        if not before:
            extra = sync(step, row)
        rollouts = [c for r in reports for c in r["rollouts"]]
        lr = learner.schedule.get_last_lr()[0]
        keep = metrics.sample_indices(cfg, step, len(rollouts))  # samples.jsonl's, with the learner's log-probs
        t3 = time.time()
        try:  # a signal drops the step between two micro-batches, on every learner alike
            sums, token_sums, maxima, grad_norm = train_step(
                cfg,
                learner,
                rollouts,
                rank,
                stop=lambda: checkpoint.stop_agreed(device),
                objective=objective,
                keep=keep,
            )
        except checkpoint.Preempted:
            if not syncs_before_sampling(cfg, step + 1, first):
                from_samplers(rollout_pg)  # one step ahead, the samplers send step + 1 before they listen
            stop(step, row)
        maxima["peak_memory_mb"] = metrics.peak_memory_mb(device)
        t4 = time.time()
        (sums, token_sums), maxima = metrics.reduce_metrics([sums, token_sums], maxima, device)
        row = {
            **metrics.step_metrics(step, rollouts, reports, sums, token_sums, maxima, grad_norm, lr, t2 - t1, t4 - t3),
            **extra,
            "step_s": time.time() - last,
        }
        last = time.time()
        # Every learner sees the same global norm, so all of them skip alike.
        skips = 0 if math.isfinite(grad_norm) else skips + 1
        row["skipped"] = int(skips > 0)
        if rank == 0:
            write_row(row)
            if keep:
                samples_log.writelines(json.dumps(metrics.sample_row(step, i, rollouts[i], cfg)) + "\n" for i in keep)
                samples_log.flush()
            bar.update()
            bar.set_postfix_str(metrics.progress(row))
        if skips:  # on the console from rank 0 only (every learner sees the same norm)
            console.warn(f"step {step}: non-finite grad norm, optimizer step skipped ({skips} in a row)")
            if skips >= cfg.max_skips:
                raise SystemExit(
                    f"rank {rank}: {skips} consecutive steps with a non-finite loss or grad norm (--max-skips {cfg.max_skips}); aborting"
                )
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            checkpoint.save_checkpoint(cfg, learner, step + 1, row, tokenizer)
    bar.close()
    if cfg.steps:
        learner.save(os.path.join(cfg.out_dir, "final"), tokenizer)
    if rank == 0:
        log.close()
        console.say(metrics.summary(cfg, os.path.join(cfg.out_dir, "metrics.jsonl"), time.time() - started))
        curves = metrics.plot(cfg.out_dir)
        if curves:
            console.say(f"curves: {curves}")
        if page := write_report_safely(cfg.out_dir, console.warn):
            console.say(f"report: {page}")


def sync_plan(cfg, path, engine_dtype, kept_dtypes):
    """The buckets of one weight sync, which learner 0 and every sampler compute alike, so
    that only flat data travels: every parameter in the dtype the engine keeps it in, or
    with LoRA the adapters alone, in float32 (they are small)."""
    bucket_bytes = int(cfg.sync_bucket_mb * 2**20)
    if cfg.lora_rank:
        return bucket_plan(adapter_plan(path, cfg), lambda name: torch.float32, bucket_bytes)
    return bucket_plan(weight_plan(path), lambda name: wire_dtype(name, engine_dtype, kept_dtypes), bucket_bytes)


def adapter_plan(path, cfg):
    """(name, shape) of the LoRA adapters of the model at path: what an adapter sync sends."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: not for launch.sh's check or plot

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        lora.add_adapters(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets.split(","))
    return lora.adapter_plan([(n, p.shape) for n, p in model.named_parameters()])


def load_tokenizer(path):
    from transformers import AutoTokenizer  # heavy: not for launch.sh's check or plot

    return AutoTokenizer.from_pretrained(path)


def model_path(cfg, local_rank):
    """The model folder; the tiny model is built once per machine by local rank 0."""
    if cfg.model != "tiny":
        return cfg.model

    path = tiny_model_dir()
    if not os.path.exists(path):
        if local_rank == 0:
            build_tiny_model(path)
        while not os.path.exists(path):
            time.sleep(0.2)
    return path


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        if len(argv) != 2:
            fail("usage: python grpo.py plot <out_dir>")
        print(metrics.plot(argv[1]) or "")
        return
    # `grpo.py check FLAGS`: what launch.sh runs before torchrun, with this node's
    # torchrun variables (WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK) and no store: every
    # flag check and every local rank's placement, so that a config that cannot work is
    # refused once, in one line, before any rank starts. Prints the run's folder.
    check = argv[:1] == ["check"]
    argv = argv[1:] if check else argv
    cfg = parse_flags(argv)
    if "WORLD_SIZE" not in os.environ:
        fail("run under torchrun, e.g. `torchrun --nproc_per_node 3 grpo.py --learners 2`, or `bash launch.sh`")
    world, local_world = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    gpus = visible_gpus()
    cpu_bf16 = cpu_has_bf16()
    cfg = resolve(cfg, world, bool(gpus), cpu_bf16)
    if check:
        if cfg.model != "tiny" and not os.path.isdir(cfg.model) and (error := hub_model_error(cfg.model)):
            fail(f"--model {cfg.model}: {error}")
        check_placement(cfg, world, local_world, int(os.environ.get("GROUP_RANK", "0")), gpus)
        print(cfg.out_dir)
        return
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    try:
        cores = len(os.sched_getaffinity(0))
        place = placement(rank, local_rank, local_world, world, cfg.learners, gpus, cfg.sampler_gpu_memory, cores)
    except ValueError as e:
        fail(str(e), every_rank=True)
    torch.set_num_threads(place.threads or torch.get_num_threads())  # CPU-only: comm.cpu_threads
    device = torch.device("cpu")
    if place.gpu is not None:
        # Each rank sees only its own GPU, as cuda:0 (vLLM always takes cuda:0).
        os.environ["CUDA_VISIBLE_DEVICES"] = place.gpu
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    weight_device = device if place.weight_backend == "nccl" else torch.device("cpu")
    os.makedirs(cfg.out_dir, exist_ok=True)
    role = "learner" if place.learner else "sampler"
    # From here on this rank's output goes to its log, unless GRPO_VERBOSE=1.
    console.setup(cfg.out_dir, rank, role, warnings_here=rank in (0, cfg.learners), append=bool(cfg.resume))
    if rank == 0:
        console.say(start_line(cfg, world, local_world, gpus))
        if cfg.dtype == "bfloat16" and not gpus and not cpu_bf16:
            console.warn(
                "--dtype bfloat16 on a CPU without AVX512-BF16 or AMX: bf16 is emulated here, several times slower than float32 (README, 'Precision and memory')"
            )
    torch.manual_seed(cfg.seed)
    signal.signal(signal.SIGTERM, checkpoint.on_signal)
    signal.signal(signal.SIGINT, checkpoint.on_signal)
    die_with_parent()

    with console.Failures(
        cfg.out_dir, rank, role, quiet_exits=(checkpoint.PREEMPTED,), peer_errors=(dist.DistError,)
    ) as failures:
        timeout = timedelta(minutes=cfg.timeout_minutes)
        failures.store = store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        path = model_path(cfg, local_rank)
        rollout_pg = make_group(store, "rollout", rank, world, "gloo", timeout)
        weight_rank = 0 if rank == 0 else rank - cfg.learners + 1
        weight_pg = None
        if rank == 0 or not place.learner:
            weight_pg = make_group(
                store, "weights", weight_rank, world - cfg.learners + 1, place.weight_backend, timeout
            )
        if place.learner:
            learner_store = dist.PrefixStore("learner", store)
            dist.init_process_group(
                place.learner_backend, store=learner_store, rank=rank, world_size=cfg.learners, timeout=timeout
            )
            run_learner(cfg, path, rank, weight_pg, rollout_pg, device, weight_device)
            dist.destroy_process_group()
        else:
            run_sampler(
                cfg,
                path,
                rank - cfg.learners,
                world - cfg.learners,
                weight_pg,
                rollout_pg,
                device,  # its GPU, whose memory it reports, even where weights arrive through host memory
                weight_device,
                place.sampler_gpu_memory,
            )
        # The groups made on the store are shut down here, not left to their destructors
        # (torch warns of an NCCL group destroyed without it at exit).
        for pg in (weight_pg, rollout_pg):
            if pg is not None:
                pg.shutdown()


def start_line(cfg, world, local_world, gpus):
    """Rank 0's first console line: what runs where, and where the logs go."""

    def n(count, word):
        return f"{count} {word}{'s' * (count != 1)}"

    where = f"{n(len(gpus), 'GPU')} ({','.join(gpus)})" if gpus else "CPU (no NVIDIA GPU found)"
    if world > local_world:
        where = f"{world // local_world} nodes x {where}"
    what = "eval only" if cfg.eval_only else n(cfg.steps, "step")
    logs = (
        f"{console.VERBOSE}=1: every rank's output here"
        if console.verbose()
        else f"logs in {console.logs_dir(cfg.out_dir)}/"
    )
    return f"grpo: {cfg.model} on {cfg.dataset}, {what}; {n(cfg.learners, 'learner')} + {n(world - cfg.learners, 'sampler')} on {where}; {logs}"
