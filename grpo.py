"""GRPO on plain torch.distributed: the config, the role split, group advantages, the
policy loss, and the main loop of each role.

    torchrun --nproc_per_node 3 grpo.py --learners 2

Ranks 0..L-1 are learners (FSDP2 over their own group); the rest are samplers, each
with an in-process vLLM engine. Every step: learner 0 broadcasts weights to the
samplers, the samplers sample G completions per prompt and score them, the learners
take the rollouts, compute group advantages and take one optimizer step."""

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")
HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
PREEMPTED = 75  # exit status of every rank after a SIGTERM/SIGINT and a clean checkpoint


@dataclass
class Config:
    model: str = "auto"  # 'tiny', a hub name or a local HF folder; auto: tiny without a GPU, else Qwen2.5-0.5B-Instruct
    dataset: str = "auto"  # 'synthetic', 'gsm8k' (the hub) or a .jsonl/.json/.parquet path; auto follows --model
    split: str = "train"
    learners: int = 1  # ranks 0..learners-1 train; the other ranks sample
    steps: int = 250
    prompts_per_step: int = 64
    group_size: int = 0  # completions per prompt (G); 0: 4 for the tiny model (more prompts beat more samples there), 8 otherwise
    max_new_tokens: int = 0  # 0: 24 for the tiny model, 512 otherwise
    max_prompt_len: int = 512
    temperature: float = 1.0
    lr: float = 0.0  # 0: 1e-3 for the tiny model, 1e-6 otherwise
    warmup_steps: int = 10  # linear learning-rate warm-up, then constant
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 8  # sequences per forward/backward on each learner, when not packing by tokens
    max_tokens_per_microbatch: int = 4096  # pack length-sorted sequences into micro-batches of at most this many padded tokens; 0: --micro-batch-size sequences
    max_staleness: int = 1  # 1: sample step k+1 while step k trains (the ratio corrects for the lag); 0: each step with its own weights
    loss_type: str = "grpo"  # grpo | bnpo | dr_grpo | dapo
    epsilon: float = 0.2
    epsilon_high: float = 0.0  # 0: same as epsilon; larger is DAPO's clip-higher
    importance: str = "token"  # token | sequence (GSPO)
    scale: str = "group"  # advantage scaling: group | batch | none
    beta: float = 0.04  # KL to the initial policy (k3), as DeepSeekMath's GRPO; > 0 keeps a frozen, sharded reference copy
    tis_cap: float = 0.0  # > 0: truncated importance sampling of the sampler/learner mismatch at this cap
    drop_uniform_groups: bool = False  # DAPO dynamic sampling: drop groups whose rewards are all equal
    overlong: str = "none"  # completions cut at max-new-tokens: none | mask (out of the loss) | penalty (soft, DAPO)
    overlong_buffer: int = 0  # penalty ramp length in tokens; 0: max-new-tokens // 4
    rewards: str = "accuracy,format"  # weighted sum: 'accuracy=1,format=0.5,my.module:fn=2'
    seed: int = 0
    out_dir: str = "runs/default"
    sampler_gpu_memory: float = 0.3  # vLLM's GPU memory fraction (GPU only)
    sampler_kv_cache_gb: float = 1.0  # vLLM's KV cache size (CPU only)
    sync_bucket_mb: float = 64.0
    gradient_checkpointing: bool = False
    eval_every: int = 50  # greedy held-out eval every K steps, and at the start and end; 0: never
    eval_dataset: str = ""  # held-out set (its 'test' split); empty: --dataset's
    eval_size: int = 256  # held-out prompts per eval; 0: the whole test split
    eval_only: bool = False  # evaluate --model and exit
    samples_every: int = 10  # write a few completions to samples.jsonl every K steps; 0: never
    save_every: int = 0  # checkpoint every N steps (and on preemption); 0: only on preemption
    keep_last: int = 0  # keep the newest K checkpoints; 0: keep all
    resume: str = ""  # '--resume' continues from out_dir's latest checkpoint, '--resume PATH' from that one
    overwrite: bool = False  # replace a run already in out_dir
    max_skips: int = 3  # abort after this many consecutive steps with a non-finite grad norm
    report_to: str = ""  # 'wandb' or 'tensorboard': also send every metrics row there (the package must be installed)


def parse_config(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool or f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name == "resume":
            parser.add_argument(flag, nargs="?", const="latest", default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    return Config(**vars(parser.parse_args(argv)))


def fail(message):
    """One clear line and a non-zero exit, before anything heavy loads."""
    print(f"grpo.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def resolve(cfg, world_size, has_gpu):
    """Fill the 'auto' fields and check every flag against the world, so a config that
    cannot work stops here with the flag's name, before any model loads."""
    from rewards import parse_reward_spec

    if cfg.model == "auto":
        cfg.model = HUB_MODEL if has_gpu else "tiny"
    tiny = cfg.model == "tiny"
    if cfg.dataset == "auto":
        cfg.dataset = "synthetic" if tiny else "gsm8k"
    cfg.max_new_tokens = cfg.max_new_tokens or (24 if tiny else 512)
    cfg.group_size = cfg.group_size or (4 if tiny else 8)
    cfg.lr = cfg.lr or (1e-3 if tiny else 1e-6)
    cfg.epsilon_high = cfg.epsilon_high or cfg.epsilon
    cfg.overlong_buffer = cfg.overlong_buffer or cfg.max_new_tokens // 4
    if cfg.eval_only:
        cfg.steps = 0
    samplers = world_size - cfg.learners
    if cfg.learners < 1:
        fail(f"--learners must be at least 1, got {cfg.learners}")
    if samplers < 1:
        fail(f"--learners {cfg.learners} leaves no sampler rank in a world of {world_size}; use --learners {world_size - 1} or more ranks")
    if cfg.group_size < 2:
        fail(f"--group-size must be at least 2 for group advantages, got {cfg.group_size}")
    if cfg.prompts_per_step < 1 or cfg.prompts_per_step % samplers:
        fail(f"--prompts-per-step {cfg.prompts_per_step} must be a positive multiple of the {samplers} sampler ranks")
    if (cfg.prompts_per_step * cfg.group_size) % cfg.learners:
        fail(f"--prompts-per-step x --group-size ({cfg.prompts_per_step * cfg.group_size}) must divide across the {cfg.learners} learners")
    if cfg.max_staleness not in (0, 1):
        fail(f"--max-staleness must be 0 or 1, got {cfg.max_staleness}: rollouts travel over blocking collectives, so the samplers run at most one step ahead")
    if cfg.max_tokens_per_microbatch and cfg.max_tokens_per_microbatch < cfg.max_prompt_len + cfg.max_new_tokens:
        fail(f"--max-tokens-per-microbatch {cfg.max_tokens_per_microbatch} cannot hold one sequence of --max-prompt-len + --max-new-tokens ({cfg.max_prompt_len + cfg.max_new_tokens}) tokens")
    for name, value, low in [("steps", cfg.steps, 0), ("micro-batch-size", cfg.micro_batch_size, 1), ("max-tokens-per-microbatch", cfg.max_tokens_per_microbatch, 0), ("max-new-tokens", cfg.max_new_tokens, 1), ("max-prompt-len", cfg.max_prompt_len, 1)]:
        if value < low:
            fail(f"--{name} must be at least {low}, got {value}")
    if cfg.temperature <= 0:
        fail(f"--temperature must be positive for sampling, got {cfg.temperature}")
    if cfg.lr < 0 or cfg.epsilon <= 0 or cfg.epsilon_high < cfg.epsilon:
        fail("--lr must be >= 0, --epsilon > 0 and --epsilon-high >= --epsilon")
    if cfg.beta < 0 or cfg.tis_cap < 0:
        fail("--beta and --tis-cap must be >= 0")
    for name, value, allowed in [("loss-type", cfg.loss_type, LOSS_TYPES), ("scale", cfg.scale, SCALES), ("importance", cfg.importance, ("token", "sequence")), ("overlong", cfg.overlong, ("none", "mask", "penalty"))]:
        if value not in allowed:
            fail(f"--{name} must be one of {', '.join(allowed)}, got {value!r}")
    if cfg.dataset not in ("synthetic", "gsm8k", "openai/gsm8k") and not os.path.exists(cfg.dataset):
        fail(f"--dataset: no such file: {cfg.dataset}")
    if not tiny and "/" not in cfg.model and not os.path.isdir(cfg.model):
        fail(f"--model: no such folder or hub name: {cfg.model}")
    try:
        parse_reward_spec(cfg.rewards)
    except ValueError as e:
        fail(f"--rewards: {e}")
    if cfg.report_to and cfg.report_to not in ("wandb", "tensorboard"):
        fail(f"--report-to must be wandb or tensorboard, got {cfg.report_to!r}")
    if cfg.report_to and importlib.util.find_spec(cfg.report_to) is None:
        fail(f"--report-to {cfg.report_to}: the {cfg.report_to} package is not installed (pip install {cfg.report_to})")
    if cfg.resume:
        cfg.resume = find_checkpoint(cfg)
    elif os.path.exists(os.path.join(cfg.out_dir, "metrics.jsonl")) and not cfg.overwrite and not cfg.eval_only:
        fail(f"--out-dir {cfg.out_dir} already holds a run: pass --resume to continue it or --overwrite to replace it")
    return cfg


def find_checkpoint(cfg):
    """The checkpoint folder to resume from, checked complete before anything loads."""
    path = cfg.resume
    if path == "latest":
        marker = os.path.join(cfg.out_dir, "checkpoints", "latest")
        if not os.path.exists(marker):
            fail(f"--resume: no checkpoint to resume in {cfg.out_dir} ({marker} does not exist)")
        path = os.path.join(cfg.out_dir, "checkpoints", open(marker).read().strip())
    trainer = os.path.join(path, "trainer.json")
    try:
        with open(trainer) as f:
            json.load(f)["step"]
    except FileNotFoundError:
        fail(f"--resume: checkpoint {path} is incomplete: trainer.json is missing")
    except (ValueError, KeyError) as e:
        fail(f"--resume: {trainer} is corrupt ({e})")
    for name in ("config.json", os.path.join("train_state", ".metadata")):
        if not os.path.exists(os.path.join(path, name)):
            fail(f"--resume: checkpoint {path} is incomplete: {name} is missing")
    return path


# ---------------------------------------------------------------- the algorithm


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    """r - mean of its group, divided by the group's std (unbiased), the batch's std, or
    nothing. Each prompt's G rewards are contiguous. A group of equal rewards gets 0."""
    groups = rewards.view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if scale == "group":
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / (rewards.std() + eps)
    return centered.flatten()


def policy_loss(logp, old_logp, advantages, mask, loss_type="grpo", epsilon=0.2, epsilon_high=None, importance="token", max_new_tokens=None, num_sequences=None, num_tokens=None, ref_logp=None, beta=0.0, tis_cap=0.0):
    """Clipped-ratio loss of one batch: -min(r*A, clip(r, 1-eps, 1+eps_high)*A) per token,
    plus beta * k3(ref, logp), aggregated by loss_type:
      grpo     mean over each sequence's tokens, then over sequences
      bnpo     sum over tokens / tokens
      dapo     the same sum / tokens: here both normalise by the whole step's tokens, since
               a per-micro-batch count would make the update depend on the split
      dr_grpo  sum over tokens / (sequences * max_new_tokens)
    logp is the learner's (before this step's update) and old_logp the sampler's.
    num_sequences and num_tokens are the whole optimizer step's counts (default: this
    batch's), so the losses of a step's micro-batches on every learner sum to the loss
    of the whole batch. tis_cap > 0 takes the ratio against the learner's own log-probs
    and weights each token by min(pi_learner / pi_sampler, cap), detached (truncated
    importance sampling). Returns (loss, sums of metrics)."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    weight = mask
    if tis_cap > 0:
        weight = mask * torch.exp(logp.detach() - old_logp).clamp(max=tis_cap)
        old_logp = logp.detach()
    log_ratio = logp - old_logp
    if importance == "sequence":
        # GSPO: one ratio per sequence (geometric mean of the token ratios), with the
        # gradient still flowing through each token's log-prob.
        seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_ratio = seq.detach()[:, None] + logp - logp.detach()
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - epsilon, 1 + eps_high) * adv)
    if beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3: unbiased, always >= 0
        per_token = per_token + beta * kl
    per_token = per_token * weight
    num_sequences = num_sequences or logp.shape[0]
    num_tokens = num_tokens or mask.sum()
    if loss_type == "grpo":
        loss = (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_sequences
    elif loss_type in ("bnpo", "dapo"):
        loss = per_token.sum() / num_tokens
    elif loss_type == "dr_grpo":
        loss = per_token.sum() / (num_sequences * max_new_tokens)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    with torch.no_grad():
        metrics = {
            "loss": loss.detach(),
            "tokens": mask.sum(),
            "ratio_sum": (ratio * mask).sum(),
            "clip_low_tokens": ((ratio < 1 - epsilon) & (adv < 0) & (mask > 0)).sum(),
            "clip_high_tokens": ((ratio > 1 + eps_high) & (adv > 0) & (mask > 0)).sum(),
        }
        if beta > 0:
            metrics["kl_sum"] = (kl * mask).sum()
    return loss, metrics


def overlong_penalty(length, max_new_tokens, buffer):
    """DAPO's soft length penalty: 0 up to max_new_tokens - buffer, then down to -1 at the limit."""
    return min(0.0, (max_new_tokens - buffer - length) / buffer) if buffer > 0 else 0.0


def train_step(cfg, learner, rollouts, rank):
    """One optimizer step on the step's rollouts (every learner holds all of them): group
    advantages, the optional filters, this learner's shard in micro-batches, then
    clip and step. Returns (this learner's metric sums, grad norm)."""
    G = cfg.group_size
    rewards = torch.tensor([c["reward"] for c in rollouts])
    if cfg.overlong == "penalty":
        rewards += torch.tensor([overlong_penalty(len(c["token_ids"]), cfg.max_new_tokens, cfg.overlong_buffer) for c in rollouts])
    for c, a in zip(rollouts, group_advantages(rewards, G, cfg.scale).tolist()):
        c["advantage"] = a
    groups = [rollouts[i : i + G] for i in range(0, len(rollouts), G)]
    by_group = rewards.view(-1, G)
    uniform = (by_group.max(dim=1).values == by_group.min(dim=1).values).tolist()
    if cfg.drop_uniform_groups:  # DAPO's dynamic sampling: such groups carry no signal
        groups = [g for g, u in zip(groups, uniform) if not u]
    batch = [c for g in groups for c in g if not (cfg.overlong == "mask" and c["truncated"])]
    # Every learner runs the same number of micro-batches, since each forward is a
    # collective; a learner with fewer runs empty ones.
    per_rank = -(-len(batch) // cfg.learners)
    packs = [micro_batches(batch[r * per_rank : (r + 1) * per_rank], cfg.max_tokens_per_microbatch, cfg.micro_batch_size) for r in range(cfg.learners)]
    mine = packs[rank] + [[]] * (max(1, max(map(len, packs))) - len(packs[rank]))
    loss_fn = partial(
        policy_loss,
        loss_type=cfg.loss_type,
        epsilon=cfg.epsilon,
        epsilon_high=cfg.epsilon_high,
        importance=cfg.importance,
        max_new_tokens=cfg.max_new_tokens,
        num_sequences=max(1, len(batch)),
        num_tokens=max(1, sum(len(c["token_ids"]) for c in batch)),
        beta=cfg.beta,
        tis_cap=cfg.tis_cap,
    )
    sums = learner.forward_backward(mine, loss_fn, cfg.temperature)
    if batch:
        grad_norm = learner.clip_grad_and_step(cfg.max_grad_norm)
    else:  # every group dropped: no step at all, on any learner (they all see the same batch)
        learner.optimizer.zero_grad(set_to_none=True)
        grad_norm = 0.0
    sums["groups_uniform"] = sum(uniform) if rank == 0 else 0
    sums["groups_dropped"] = sums["groups_uniform"] if cfg.drop_uniform_groups else 0
    sums["sequences_trained"] = sum(map(len, mine))
    sums["positions"] = sum(len(mb) * max(map(sequence_length, mb)) for mb in mine if mb)
    sums["padding"] = sums["positions"] - sum(sequence_length(c) for mb in mine for c in mb)
    return sums, grad_norm


def sequence_length(c):
    return len(c["prompt_ids"]) + len(c["token_ids"])


def micro_batches(rollouts, max_tokens, max_sequences):
    """Split one learner's rollouts, sorted by length so that neighbours pad little,
    into micro-batches of at most max_tokens once padded to their longest (or of
    max_sequences each when max_tokens is 0). The losses are normalised by whole-step
    counts, so the split changes nothing but speed and memory."""
    out = []
    for c in sorted(rollouts, key=sequence_length):
        rows = len(out[-1]) + 1 if out else 1
        fits = rows * sequence_length(c) <= max_tokens if max_tokens else rows <= max_sequences
        if not out or not fits:
            out.append([])
        out[-1].append(c)
    return out


# ---------------------------------------------------------------- processes and groups


def gpu_count():
    # Read from the driver, not torch.cuda: touching CUDA here would fix the visible
    # devices before a sampler can narrow them.
    path = "/proc/driver/nvidia/gpus"
    return len(os.listdir(path)) if os.path.isdir(path) else 0


def make_group(store, name, rank, size, device):
    """A process group built directly on the store, for ranks that share no default group."""
    prefix = dist.PrefixStore(name, store)
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(prefix, rank, size)
    return dist.ProcessGroupGloo(prefix, rank, size, timedelta(minutes=30))


def exchange(pg, obj):
    """All-gather one picklable object per rank over a gloo group; returns them all."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(pg.size())]
    pg.allgather([sizes], [torch.tensor([data.numel()])]).wait()
    width = int(max(sizes))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.empty(width, dtype=torch.uint8) for _ in range(pg.size())]
    pg.allgather([out], [padded]).wait()
    return [pickle.loads(o[: int(s)].numpy().tobytes()) for o, s in zip(out, sizes)]


def from_samplers(pg):
    """A learner's side of an exchange: what each sampler sent."""
    return [r for r in exchange(pg, None) if r is not None]


def model_path(cfg, local_rank):
    """The model folder; the tiny model is built once per machine by local rank 0."""
    if cfg.model != "tiny":
        return cfg.model
    from data import build_tiny_model, tiny_model_dir

    path = tiny_model_dir()
    if not os.path.exists(path):
        if local_rank == 0:
            build_tiny_model(path)
        while not os.path.exists(path):
            time.sleep(0.2)
    return path


def weight_plan(path):
    """(name, shape) of every parameter in Hugging Face order: what the learner sends."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return [(name, p.shape) for name, p in model.named_parameters()]


def bucket_plan(plan, element_size, bucket_bytes):
    """The weight plan cut into consecutive buckets of about bucket_bytes. Learner 0 and
    the samplers both compute it, so only the flat data travels."""
    buckets, size = [[]], 0
    for name, shape in plan:
        if size >= bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, shape))
        size += shape.numel() * element_size
    return buckets


def syncs_before_sampling(cfg, step, first):
    """Whether the weights of `step` reach the samplers before they sample it. With
    --max-staleness 1 they arrive just after, so that the samplers draw step k+1 with
    step k's weights while the learners train step k; the first step of a run, and the
    final weights (for the last eval), always sync first."""
    return cfg.max_staleness == 0 or step in (first, cfg.steps)


# ---------------------------------------------------------------- the two roles


def run_sampler(cfg, path, index, num_samplers, weight_pg, rollout_pg, device):
    from data import load_prompts, shard, step_indices
    from rewards import parse_reward_spec, score
    from sampler import Sampler, receive_weights

    # Data first: a bad dataset stops the job before the engine loads.
    tokenizer = _tokenizer(path)
    prompts = load_prompts(cfg.dataset, cfg.split, tokenizer, cfg.max_prompt_len) if cfg.steps else []
    eval_prompts = load_prompts(cfg.eval_dataset or cfg.dataset, "test", tokenizer, cfg.max_prompt_len)[: cfg.eval_size or None] if cfg.eval_every or cfg.eval_only else []
    engine = Sampler(path, cfg.max_prompt_len + cfg.max_new_tokens, cfg.seed, gpu_memory_utilization=cfg.sampler_gpu_memory, kv_cache_gb=cfg.sampler_kv_cache_gb)
    reward_fns = parse_reward_spec(cfg.rewards)
    buckets = bucket_plan(weight_plan(path), engine.dtype.itemsize, int(cfg.sync_bucket_mb * 2**20))

    def sync(step):
        """Load the weights of `step` (or stop), then evaluate them when an eval is due."""
        if control(weight_pg, 0, device):
            sys.exit(PREEMPTED)  # the learners saved a checkpoint and stop too
        engine.load_weights(receive_weights(weight_pg, buckets, engine.dtype, device))
        if eval_due(cfg, step):
            exchange(rollout_pg, {"eval": evaluate(engine, eval_prompts[index::num_samplers], cfg, reward_fns)})
        return step

    first = start_step(cfg)
    weights_step = first
    # One step more than training: the last sync brings the final weights for the last eval.
    for step in range(first, cfg.steps + 1):
        if syncs_before_sampling(cfg, step, first):
            weights_step = sync(step)
        if step == cfg.steps:
            break
        t1 = time.time()
        batch = shard([prompts[i] for i in step_indices(len(prompts), step, cfg.prompts_per_step, cfg.seed)], index, num_samplers)
        seed = (cfg.seed * 1_000_003 + step) * 1009 + index
        completions = engine.sample([p["prompt_ids"] for p in batch], cfg.group_size, cfg.max_new_tokens, cfg.temperature, seed)
        t2 = time.time()
        for i, c in enumerate(completions):
            c["reward"], c["parts"] = score(c["text"], batch[i // cfg.group_size]["gold"], reward_fns)
        report = {"rollouts": completions, "weights_step": weights_step, "sample_s": t2 - t1, "reward_s": time.time() - t2, "peak_memory_mb": peak_memory_mb(device)}
        exchange(rollout_pg, report)
        if not syncs_before_sampling(cfg, step, first):
            weights_step = sync(step)


def start_step(cfg):
    if not cfg.resume:
        return 0
    with open(os.path.join(cfg.resume, "trainer.json")) as f:
        return json.load(f)["step"]


def control(pg, stop, device):
    """Learner 0 tells the samplers, before each step, whether to go on (0) or stop (1)."""
    flag = torch.tensor([int(stop)], dtype=torch.int64, device=device)
    pg.broadcast(flag, 0).wait()
    return bool(flag.item())


def eval_due(cfg, step):
    return cfg.eval_only or (cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.steps))


def evaluate(engine, prompts, cfg, reward_fns):
    """Greedy completions of this sampler's share of the held-out prompts: sums, so the
    learner can add up the samplers' shares."""
    from rewards import score

    completions = engine.sample([p["prompt_ids"] for p in prompts], 1, cfg.max_new_tokens, 0.0, cfg.seed)
    parts = [score(c["text"], p["gold"], reward_fns)[1] for c, p in zip(completions, prompts)]
    return {
        "n": len(prompts),
        "accuracy": sum(p.get("accuracy", 0.0) for p in parts),
        "format": sum(p.get("format", 0.0) for p in parts),
        "length": sum(len(c["token_ids"]) for c in completions),
    }


def merge_evals(reports):
    """One eval from the samplers' shares (each sampler sends one after every due sync)."""
    evals = [r["eval"] for r in reports]
    n = max(1, sum(e["n"] for e in evals))
    return {f"eval_{k}": sum(e[k] for e in evals) / n for k in ("accuracy", "format", "length")}


def run_learner(cfg, path, rank, weight_pg, rollout_pg, device, weight_device):
    from torch.distributed.device_mesh import init_device_mesh
    from tqdm import tqdm

    from learner import Learner

    started = time.time()
    mesh = init_device_mesh(device.type, (cfg.learners,))
    learner = Learner(path, mesh, device, cfg.lr, cfg.weight_decay, cfg.gradient_checkpointing, reference=cfg.beta > 0, warmup_steps=cfg.warmup_steps)
    tokenizer = _tokenizer(path) if rank == 0 else None  # saved beside every checkpoint
    first = start_step(cfg)
    if cfg.resume:
        resume_learner(cfg, learner, rank)
    sync_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    buckets = bucket_plan(weight_plan(path), sync_dtype.itemsize, int(cfg.sync_bucket_mb * 2**20))
    # Only rank 0 writes metrics, so only it measures the yardstick.
    memcpy_s = memcpy_seconds(sum(shape.numel() for b in buckets for _, shape in b) * sync_dtype.itemsize, weight_device) if rank == 0 else 0.0
    log = open_log(os.path.join(cfg.out_dir, "metrics.jsonl"), first) if rank == 0 else None
    samples_log = open_log(os.path.join(cfg.out_dir, "samples.jsonl"), first) if rank == 0 else None
    bar = tqdm(initial=first, total=cfg.steps, desc="grpo", disable=rank != 0)
    report = open_reporter(cfg) if rank == 0 else None

    def write_row(row):
        log.write(json.dumps(row) + "\n")
        log.flush()
        if report:
            report(row)

    def sync(step, row):
        """Send the weights of `step` (or, when signalled, checkpoint and stop), then
        collect the samplers' eval of them when one is due."""
        if stop_agreed():
            save_checkpoint(cfg, learner, step, row, tokenizer)
            if weight_pg is not None:
                control(weight_pg, 1, weight_device)
            print(f"rank {rank}: stopped by a signal after step {step}; checkpoint saved; exit {PREEMPTED}", file=sys.stderr)
            sys.exit(PREEMPTED)
        t0 = time.time()
        if weight_pg is not None:
            control(weight_pg, 0, weight_device)
        learner.send_weights(weight_pg, buckets, sync_dtype, weight_device)
        timing = {"sync_s": time.time() - t0, "sync_memcpy_s": memcpy_s}
        if not eval_due(cfg, step):
            return timing
        t1 = time.time()
        evals = merge_evals(from_samplers(rollout_pg))
        return {**timing, "eval_s": time.time() - t1, **evals}

    skips, row, last = 0, {}, time.time()
    for step in range(first, cfg.steps + 1):
        before = syncs_before_sampling(cfg, step, first)
        extra = sync(step, row) if before else {}
        if step == cfg.steps:
            if rank == 0 and "eval_accuracy" in extra:
                write_row({"step": step, **extra})
            break
        t1 = time.time()
        reports = from_samplers(rollout_pg)
        t2 = time.time()
        if not before:
            extra = sync(step, row)
        rollouts = [c for r in reports for c in r["rollouts"]]
        lr = learner.schedule.get_last_lr()[0]
        t3 = time.time()
        sums, grad_norm = train_step(cfg, learner, rollouts, rank)
        sums["peak_memory_mb_max"] = peak_memory_mb(device)
        t4 = time.time()
        sums = reduce_metrics(sums)
        row = {**step_metrics(step, rollouts, reports, sums, grad_norm, lr, t2 - t1, t4 - t3), **extra, "step_s": time.time() - last}
        last = time.time()
        # Every learner sees the same global norm, so all of them skip alike.
        skips = 0 if math.isfinite(grad_norm) else skips + 1
        row["skipped"] = int(skips > 0)
        if rank == 0:
            write_row(row)
            if cfg.samples_every and step % cfg.samples_every == 0:
                for c in rollouts[:: cfg.group_size][:4]:
                    samples_log.write(json.dumps({"step": step, "text": c["text"], "reward": c["reward"], **c["parts"]}) + "\n")
                samples_log.flush()
            bar.update()
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.2f}")
        if skips:
            print(f"step {step}: non-finite grad norm, optimizer step skipped ({skips} in a row)", file=sys.stderr)
            if skips >= cfg.max_skips:
                raise SystemExit(f"rank {rank}: {skips} consecutive steps with a non-finite loss or grad norm (--max-skips {cfg.max_skips}); aborting")
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            save_checkpoint(cfg, learner, step + 1, row, tokenizer)
    bar.close()
    if cfg.steps:
        learner.save(os.path.join(cfg.out_dir, "final"), tokenizer)
    if rank == 0:
        log.close()
        print(summary(cfg, os.path.join(cfg.out_dir, "metrics.jsonl"), time.time() - started))
        curves = plot(cfg.out_dir)
        if curves:
            print(f"curves: {curves}")


def open_reporter(cfg):
    """A function that forwards one metrics row to wandb or TensorBoard, or None."""
    if cfg.report_to == "wandb":
        import wandb

        run = wandb.init(project="grpo", dir=cfg.out_dir, config=dataclasses.asdict(cfg))
        return lambda row: run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    if cfg.report_to == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(cfg.out_dir)

        def report(row):
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    writer.add_scalar(k, v, row["step"])
            writer.flush()

        return report
    return None


def open_log(path, first_step):
    """A JSON-lines log opened for appending, without the rows of steps >= first_step
    (which a resumed run writes again)."""
    rows = []
    if first_step and os.path.exists(path):
        rows = [line for line in open(path) if json.loads(line)["step"] < first_step]
    with open(path, "w") as f:
        f.writelines(rows)
    return open(path, "a")


# ---------------------------------------------------------------- checkpoints and signals


def save_checkpoint(cfg, learner, step, row, tokenizer):
    from learner import save_checkpoint as save

    info = {"config": dataclasses.asdict(cfg), "metrics": row}
    save(learner, os.path.join(cfg.out_dir, "checkpoints"), step, info, cfg.keep_last, tokenizer)


def resume_learner(cfg, learner, rank):
    from learner import load_checkpoint

    try:
        load_checkpoint(learner, cfg.resume)
    except Exception as e:  # a half-read state must never train on
        raise SystemExit(f"--resume: cannot load {cfg.resume}: {e}")


STOP = {"at": None}


def on_signal(signum, frame):
    """First SIGTERM/SIGINT: finish the step, checkpoint, exit PREEMPTED. A second one a
    second or more later exits at once (torchrun forwards the signal that a terminal
    already sent the whole process group, so an immediate repeat is the same one)."""
    if STOP["at"] is None:
        STOP["at"] = time.time()
    elif time.time() - STOP["at"] > 1.0:
        os._exit(PREEMPTED)


def stop_agreed():
    """Whether any learner was signalled: all of them stop at the same step."""
    flag = torch.tensor([float(STOP["at"] is not None)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def summary(cfg, metrics_path, wall_s):
    rows = [json.loads(line) for line in open(metrics_path)]
    train = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    lines = [f"run finished: {len(train)} steps in {wall_s:.0f} s; metrics in {metrics_path}, policy in {os.path.join(cfg.out_dir, 'final')}"]
    if evals:
        lines.append(f"eval accuracy: {evals[0]['eval_accuracy']:.3f} at step {evals[0]['step']} -> {evals[-1]['eval_accuracy']:.3f} at step {evals[-1]['step']}")
    if train:
        seconds = sum(r["step_s"] for r in train)
        tokens = sum(r["tokens_sampled"] for r in train)
        lines.append(f"train reward {train[0]['reward_mean']:.3f} -> {train[-1]['reward_mean']:.3f}; {seconds:.0f} s in steps; {tokens / max(1e-9, sum(r['sample_s'] for r in train)):.0f} sampled tokens/s")
    return "\n".join(lines)


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def peak_memory_mb(device):
    """This process's peak: CUDA memory allocated on a GPU, resident memory otherwise."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


def memcpy_seconds(num_bytes, device, repeats=5):
    """The best time of one in-memory copy of num_bytes: the yardstick for a weight sync."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


def reduce_metrics(sums):
    """Sum the learners' metric sums; take the max of the maxima."""
    maxima = sorted(k for k in sums if k.endswith("_max"))
    names = sorted(k for k in sums if k not in maxima)
    total = torch.tensor([sums[k] for k in names], dtype=torch.float64)
    peak = torch.tensor([sums[k] for k in maxima], dtype=torch.float64)
    dist.all_reduce(total)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {**dict(zip(names, total.tolist())), **dict(zip(maxima, peak.tolist()))}


def step_metrics(step, rollouts, reports, sums, grad_norm, lr, wait_s, train_s):
    rewards = torch.tensor([c["reward"] for c in rollouts])
    lengths = torch.tensor([len(c["token_ids"]) for c in rollouts], dtype=torch.float32)
    parts = {name: sum(c["parts"][name] for c in rollouts) / len(rollouts) for name in rollouts[0]["parts"]}
    tokens = max(1.0, sums["tokens"])
    return {
        "step": step,
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item(),
        "accuracy": parts.get("accuracy", 0.0),
        "format": parts.get("format", 0.0),
        **{f"reward_{k}": v for k, v in parts.items() if k not in ("accuracy", "format")},
        "completion_len": lengths.mean().item(),
        "completion_len_max": lengths.max().item(),
        "truncated_frac": sum(c["truncated"] for c in rollouts) / len(rollouts),
        "loss": sums["loss"],
        "grad_norm": grad_norm,
        "lr": lr,
        "ratio_mean": sums["ratio_sum"] / tokens,
        "clip_low_frac": sums["clip_low_tokens"] / tokens,
        "clip_high_frac": sums["clip_high_tokens"] / tokens,
        "mismatch_mean": sums["mismatch_sum"] / tokens,
        "mismatch_max": sums["mismatch_max"],
        "entropy": sums["entropy_sum"] / tokens,
        **({"kl": sums["kl_sum"] / tokens} if "kl_sum" in sums else {}),
        "groups_uniform": int(sums["groups_uniform"]),
        "groups_dropped": int(sums["groups_dropped"]),
        "sequences_trained": int(sums["sequences_trained"]),
        "tokens_sampled": int(lengths.sum()),
        "tokens_trained": int(sums["tokens"]),
        "padded_frac": sums["padding"] / max(1.0, sums["positions"]),
        "staleness": step - min(r["weights_step"] for r in reports),
        "samplers": len(reports),
        "peak_memory_mb_learner": sums["peak_memory_mb_max"],
        "peak_memory_mb_sampler": max(r["peak_memory_mb"] for r in reports),
        "sample_s": max(r["sample_s"] for r in reports),
        "reward_s": max(r["reward_s"] for r in reports),
        "wait_s": wait_s,
        "train_s": train_s,
    }


def plot(out_dir):
    """curves.png from metrics.jsonl: reward and accuracies, and seconds per phase."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no curves.png")
        return None
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    train = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in train]
    left.plot(steps, [r["reward_mean"] for r in train], label="reward")
    left.plot(steps, [r["accuracy"] for r in train], label="train accuracy")
    left.plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-", label="eval accuracy")
    left.set_xlabel("step")
    left.legend()
    for phase in ("sync_s", "sample_s", "reward_s", "wait_s", "train_s"):
        right.plot(steps, [r[phase] for r in train], label=phase)
    right.set_xlabel("step")
    right.set_ylabel("seconds")
    right.legend()
    path = os.path.join(out_dir, "curves.png")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def die_with_parent():
    """torchrun starts each rank in a session of its own, so killing torchrun outright
    (kill -9, an OOM kill) would leave the ranks running on their own. Linux can tie a
    process's life to its parent's."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: a killed torchrun may leave ranks behind


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        if len(argv) != 2:
            fail("usage: python grpo.py plot <out_dir>")
        print(plot(argv[1]) or "")
        return
    cfg = parse_config(argv)
    if "WORLD_SIZE" not in os.environ:
        fail("run under torchrun, e.g. `torchrun --nproc_per_node 3 grpo.py --learners 2`, or `bash launch.sh`")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    gpus = gpu_count()
    cfg = resolve(cfg, world, gpus > 0)
    is_learner = rank < cfg.learners
    if gpus and not is_learner:
        # vLLM runs on cuda:0 of what it sees, so a sampler sees only its own GPU.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))).split(",")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[local_rank % len(visible)]
    device = torch.device("cuda", local_rank % gpus if is_learner else 0) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    # NCCL cannot put two ranks of one group on one GPU: when ranks share GPUs, the
    # weights travel over gloo through host memory instead.
    weight_device = device if gpus and local_world <= gpus else torch.device("cpu")
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    die_with_parent()

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(minutes=30))
    path = model_path(cfg, local_rank)
    rollout_pg = make_group(store, "rollout", rank, world, torch.device("cpu"))
    weight_rank = 0 if rank == 0 else rank - cfg.learners + 1
    weight_pg = make_group(store, "weights", weight_rank, world - cfg.learners + 1, weight_device) if rank == 0 or not is_learner else None
    if is_learner:
        dist.init_process_group("nccl" if gpus else "gloo", store=dist.PrefixStore("learner", store), rank=rank, world_size=cfg.learners, timeout=timedelta(minutes=30))
        run_learner(cfg, path, rank, weight_pg, rollout_pg, device, weight_device)
        dist.destroy_process_group()
    else:
        run_sampler(cfg, path, rank - cfg.learners, world - cfg.learners, weight_pg, rollout_pg, weight_device)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
