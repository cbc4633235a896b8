"""GRPO on plain torch.distributed: the config, the algorithm (group advantages, the
objectives and their aggregation, one optimizer step), the loop of each role, and main.

    torchrun --nproc_per_node 3 grpo.py --learners 2

Ranks 0..L-1 are learners (FSDP2 over their own group); the rest are samplers, each
with an in-process vLLM engine. Every step: learner 0 broadcasts weights to the
samplers, the samplers sample G completions per prompt and score them, the learners
take the rollouts, compute group advantages and take one optimizer step."""

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import checkpoint
import console
import lora
import metrics
from comm import (
    bucket_plan,
    control,
    cpu_has_bf16,
    die_with_parent,
    exchange,
    from_samplers,
    is_hybrid,
    make_group,
    placement,
    plan_bytes,
    receive_weights,
    send_weights,
    text_to_checkpoint,
    visible_gpus,
    weight_plan,
    wire_dtype,
)
from data import dataset_error, load_prompts, shard, step_indices
from rewards import check_failures, parse_reward_spec, score_batch
from tiny import build_tiny_model, tiny_model_dir

HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


@dataclass
class Config:
    model: str = "auto"  # 'tiny', a hub name or a local HF folder; auto: tiny without a GPU, else Qwen2.5-0.5B-Instruct
    dataset: str = "auto"  # 'synthetic', 'gsm8k' (the hub) or a .jsonl/.json/.parquet path; auto follows --model
    split: str = "train"
    learners: int = 1  # ranks 0..learners-1 train; the other ranks sample
    steps: int = -1  # optimizer steps; -1: 300 for the tiny model, 250 otherwise
    prompts_per_step: int = 64
    group_size: int = 0  # completions per prompt (G); 0: 4 for the tiny model (more prompts beat more samples), else 8
    max_new_tokens: int = 0  # 0: 24 for the tiny model, 512 otherwise
    max_prompt_len: int = 512
    temperature: float = 1.0
    lr: float = 0.0  # 0: 1e-3 for the tiny model, 1e-6 otherwise
    warmup_steps: int = 10  # linear learning-rate warm-up, then constant
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 8  # sequences per forward/backward on each learner, when not packing by tokens
    max_tokens_per_microbatch: int = -1  # padded tokens per micro-batch, length-sorted; -1: max(4096, max-prompt-len + max-new-tokens); 0: --micro-batch-size sequences
    logprob_chunk: int = 1024  # positions per output-projection chunk when taking log-probs (the [T, V] logits never exist whole); 0: dense
    max_staleness: int = 1  # 1: sample step k+1 while step k trains (the ratio corrects the lag); 0: on-policy
    objective: str = "clip"  # per-token objective: clip (PPO/GRPO) | cispo | sapo | my.module:fn (see OBJECTIVES)
    loss_type: str = "grpo"  # how per-token losses aggregate: grpo | bnpo | dr_grpo | dapo (see aggregate)
    epsilon: float = 0.2
    epsilon_high: float = 0.0  # 0: same as epsilon; larger is DAPO's clip-higher (CISPO: its IS weight's cap - 1)
    importance: str = "token"  # token | sequence (GSPO): the ratio every objective sees
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature for positive advantages
    sapo_tau_neg: float = 1.05  # ... and for negative ones (sharper: their off-policy tokens destabilise more)
    scale: str = "group"  # advantage scaling: group | batch | none
    beta: float = -1.0  # k3 KL to the initial policy, as DeepSeekMath; > 0 keeps a frozen, sharded reference; -1: 0.1 for the tiny model, else 0.04
    tis_cap: float = 0.0  # > 0: truncated importance sampling of the sampler/learner mismatch at this cap
    drop_uniform_groups: bool | None = None  # DAPO: drop groups of all-equal rewards; None: on for tiny only
    overlong: str = "none"  # completions cut at max-new-tokens: none | mask (out of the loss) | penalty (soft, DAPO)
    overlong_buffer: int = 0  # penalty ramp length in tokens; 0: max-new-tokens // 4
    rewards: str = "accuracy,format"  # weighted sum: 'accuracy=1,format=0.5,my.module:fn=2'; fn(completion, record)
    reward_timeout: float = 10.0  # seconds per user-reward call; a slower call scores 0 and is counted
    reward_workers: int = 1  # processes running user rewards (built-ins run in the sampler); more for CPU-heavy ones
    max_reward_errors: float = 0.5  # stop when more than this fraction of a step's completions had a reward fail
    prompt_field: str = "question"  # dataset column with the prompt: a string (the user message) or chat messages
    messages_field: str = "messages"  # column of chat messages [{role, content}]; where a row has it, it is the prompt
    dtype: str = "auto"  # compute dtype of learners and samplers: auto | bfloat16 | float32 (see precision)
    seed: int = 0
    out_dir: str = "runs/default"
    sampler_gpu_memory: float = 0.0  # vLLM's GPU memory fraction; 0: 0.8 of a GPU of its own, 0.3 beside a learner
    timeout_minutes: float = 30.0  # every process group's timeout: how long a rank waits for a stuck peer
    sampler_kv_cache_gb: float = 1.0  # vLLM's KV cache size (CPU only)
    sync_bucket_mb: float = 64.0
    gradient_checkpointing: bool = (
        False  # recompute blocks in the backward: ~1/15 of the activations, ~1/3 more compute
    )
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank on --lora-targets (the base stays frozen); 0: full
    lora_alpha: float = 0.0  # adapter scale alpha / rank; 0: 2 x rank
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # linear layers given adapters
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
        if f.type in (bool, bool | None):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name == "resume":
            parser.add_argument(flag, nargs="?", const="latest", default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    return Config(**vars(parser.parse_args(argv)))


# ---------------------------------------------------------------- the algorithm


@dataclass
class Rollout:
    """One sampled completion of one prompt, as it travels from a sampler to the learners."""

    prompt_ids: list  # the prompt's token ids
    token_ids: list  # the completion's token ids
    sampler_logprobs: list  # log-prob of each completion token under the sampler that drew it
    text: str
    truncated: bool  # cut at --max-new-tokens
    reward: float = 0.0
    parts: dict = field(default_factory=dict)  # each reward's unweighted value
    advantage: float = 0.0


def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    """r - mean of its group, divided by the group's std (unbiased), the batch's std, or
    nothing. Each prompt's G rewards are contiguous. A group of equal rewards gets 0."""
    groups = rewards.view(-1, group_size)  # [prompts, G]
    centered = groups - groups.mean(dim=1, keepdim=True)
    if scale == "group":
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / (rewards.std() + eps)
    return centered.flatten()


def importance_log_ratio(logp, sampler_logp, mask, importance):
    """log(pi / pi_sampler) per token, or GSPO's one ratio per sequence (the geometric
    mean of its token ratios) with the gradient still flowing through each token."""
    log_ratio = logp - sampler_logp  # [B, T]
    if importance == "sequence":
        seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
        log_ratio = seq.detach()[:, None] + logp - logp.detach()
    return log_ratio


# Objectives: (logp, sampler_logp, advantages, mask, cfg) -> (per-token loss [B, T], metrics).
# The loss need not be masked (aggregate masks it). Each metric is a sum over this
# batch's completion tokens and is reported per token under its own name.


def clip(logp, sampler_logp, advantages, mask, cfg):
    """PPO's clipped ratio, as GRPO uses it: -min(r A, clip(r, 1-eps, 1+eps_high) A)."""
    ratio = torch.exp(importance_log_ratio(logp, sampler_logp, mask, cfg.importance))  # [B, T]
    adv = advantages[:, None]  # [B, 1]
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - cfg.epsilon, 1 + cfg.epsilon_high) * adv)
    with torch.no_grad():
        live = mask > 0
        metrics = {
            "ratio_mean": (ratio * mask).sum(),
            "clip_low_frac": ((ratio < 1 - cfg.epsilon) & (adv < 0) & live).sum(),
            "clip_high_frac": ((ratio > 1 + cfg.epsilon_high) & (adv > 0) & live).sum(),
        }
    return per_token, metrics


def cispo(logp, sampler_logp, advantages, mask, cfg):
    """MiniMax-M1's CISPO: clip the importance weight, not the update, so every token
    keeps its gradient: -sg(min(r, 1 + eps_high)) A log pi. No lower bound, as in the
    paper; the loss's value is not meaningful, its gradient is."""
    ratio = torch.exp(importance_log_ratio(logp, sampler_logp, mask, cfg.importance))  # [B, T]
    weight = ratio.clamp(max=1 + cfg.epsilon_high).detach()
    per_token = -weight * advantages[:, None] * logp
    with torch.no_grad():
        metrics = {
            "ratio_mean": (ratio * mask).sum(),
            "clip_high_frac": ((ratio > 1 + cfg.epsilon_high) & (mask > 0)).sum(),
        }
    return per_token, metrics


def sapo(logp, sampler_logp, advantages, mask, cfg):
    """Qwen's SAPO: a soft gate in place of the hard clip, -(4 / tau) sigmoid(tau (r - 1)) A.
    Its gradient is r A 4 s (1 - s) grad log pi with s the sigmoid: exactly GRPO's at r = 1,
    fading smoothly as r leaves 1, faster for negative advantages (tau_neg > tau_pos)."""
    ratio = torch.exp(importance_log_ratio(logp, sampler_logp, mask, cfg.importance))  # [B, T]
    adv = advantages[:, None]  # [B, 1]
    tau = torch.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(ratio.dtype)  # [B, 1]
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    per_token = -gate * adv
    with torch.no_grad():
        s = torch.sigmoid(tau * (ratio - 1))
        metrics = {"ratio_mean": (ratio * mask).sum(), "gate_weight_mean": (4 * s * (1 - s) * mask).sum()}
    return per_token, metrics


OBJECTIVES = {"clip": clip, "cispo": cispo, "sapo": sapo}


def load_objective(name):
    """A built-in objective by name, or a user's by 'module:function'. Raises ValueError."""
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"unknown objective {name!r}: use one of {', '.join(OBJECTIVES)} or module:function")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load objective {name!r}: {e}")


def aggregate(per_token, mask, loss_type, num_sequences, num_tokens, max_new_tokens):
    """One number from masked per-token losses [B, T]. The counts are the whole optimizer
    step's, so the losses of a step's micro-batches on every learner sum to the loss of
    the whole batch, however it is split:
      grpo     mean over each sequence's tokens, then over the step's sequences
      bnpo     sum over tokens / the step's tokens
      dapo     the same: DAPO's token-level mean over the step (a per-micro-batch count
               would make the update depend on the split)
      dr_grpo  sum over tokens / (the step's sequences * max_new_tokens)"""
    if loss_type == "grpo":
        return (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_sequences
    if loss_type in ("bnpo", "dapo"):
        return per_token.sum() / num_tokens
    if loss_type == "dr_grpo":
        return per_token.sum() / (num_sequences * max_new_tokens)
    raise ValueError(f"unknown loss_type {loss_type!r}")


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def policy_loss(logp, sampler_logp, advantages, mask, cfg, ref_logp=None, num_sequences=None, num_tokens=None):
    """The loss of one micro-batch: the objective per token, plus beta * k3 KL to the
    reference, weighted and aggregated. logp [B, T] is the learner's (before this step's
    update) and sampler_logp the sampler's; num_sequences and num_tokens are the whole
    step's (default: this batch's). With --tis-cap, each token is weighted by
    min(pi_learner / pi_sampler, cap), detached (truncated importance sampling), and the
    objective's ratio is taken against the learner's own log-probs instead.
    Returns (loss, metric sums over this batch's tokens)."""
    weight = mask  # [B, T]
    if cfg.tis_cap > 0:
        weight = mask * torch.exp(logp.detach() - sampler_logp).clamp(max=cfg.tis_cap)
        sampler_logp = logp.detach()
    per_token, metrics = load_objective(cfg.objective)(logp, sampler_logp, advantages, mask, cfg)
    if cfg.beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3: unbiased, always >= 0
        per_token = per_token + cfg.beta * kl
        metrics["kl"] = (kl.detach() * mask).sum()
    counts = (num_sequences or logp.shape[0], num_tokens or mask.sum())
    loss = aggregate(per_token * weight, mask, cfg.loss_type, *counts, cfg.max_new_tokens)
    return loss, metrics


def overlong_penalty(length, max_new_tokens, buffer):
    """DAPO's soft length penalty: 0 up to max_new_tokens - buffer, then down to -1 at the limit."""
    return min(0.0, (max_new_tokens - buffer - length) / buffer) if buffer > 0 else 0.0


def train_step(cfg, learner, rollouts, rank, stop=None):
    """One optimizer step on the step's rollouts (every learner holds all of them): group
    advantages, the optional filters, this learner's shard in micro-batches, then clip
    and step. Returns (this learner's metric sums: counts and per-token sums, its
    maxima, the grad norm)."""
    G = cfg.group_size
    rewards = torch.tensor([c.reward for c in rollouts])  # [prompts * G]
    if cfg.overlong == "penalty":
        rewards += torch.tensor(
            [overlong_penalty(len(c.token_ids), cfg.max_new_tokens, cfg.overlong_buffer) for c in rollouts]
        )
    for c, a in zip(rollouts, group_advantages(rewards, G, cfg.scale).tolist()):
        c.advantage = a
    groups = [rollouts[i : i + G] for i in range(0, len(rollouts), G)]
    by_group = rewards.view(-1, G)  # [prompts, G]
    uniform = (by_group.max(dim=1).values == by_group.min(dim=1).values).tolist()
    if cfg.drop_uniform_groups:  # DAPO's dynamic sampling: such groups carry no signal
        groups = [g for g, u in zip(groups, uniform) if not u]
    batch = [c for g in groups for c in g if not (cfg.overlong == "mask" and c.truncated)]
    # Every learner runs the same number of micro-batches, since each forward is a
    # collective; a learner with fewer runs empty ones.
    per_rank = -(-len(batch) // cfg.learners)
    packs = [
        micro_batches(batch[r * per_rank : (r + 1) * per_rank], cfg.max_tokens_per_microbatch, cfg.micro_batch_size)
        for r in range(cfg.learners)
    ]
    mine = packs[rank] + [[]] * (max(1, max(map(len, packs))) - len(packs[rank]))
    step_counts = {"num_sequences": max(1, len(batch)), "num_tokens": max(1, sum(len(c.token_ids) for c in batch))}

    def loss_fn(logp, sampler_logp, advantages, mask, ref_logp):
        return policy_loss(logp, sampler_logp, advantages, mask, cfg, ref_logp, **step_counts)

    sums, token_sums, maxima = learner.forward_backward(mine, loss_fn, cfg.temperature, stop)
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
    return sums, token_sums, maxima, grad_norm


def sequence_length(c):
    return len(c.prompt_ids) + len(c.token_ids)


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


# ---------------------------------------------------------------- the two roles


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

    # Data first: a bad dataset stops the job before the engine loads. Rows are checked
    # for what the chosen rewards read.
    tokenizer = load_tokenizer(path)
    reward_fns = parse_reward_spec(cfg.rewards)
    fields = dict(prompt_field=cfg.prompt_field, messages_field=cfg.messages_field)
    prompts = (
        load_prompts(cfg.dataset, cfg.split, tokenizer, cfg.max_prompt_len, reward_fns, **fields) if cfg.steps else []
    )
    eval_prompts = []
    if cfg.eval_every or cfg.eval_only:
        eval_prompts = load_prompts(
            cfg.eval_dataset or cfg.dataset, "test", tokenizer, cfg.max_prompt_len, reward_fns, **fields
        )
        eval_prompts = eval_prompts[: cfg.eval_size or None]
    engine = Sampler(
        path, cfg.max_prompt_len + cfg.max_new_tokens, cfg.seed, cfg.dtype, gpu_memory, cfg.sampler_kv_cache_gb
    )
    # Ready, and what the learners need to cut the same bucket plan: the engine's dtypes.
    # The learners wait for this before they load their model, so on a shared GPU vLLM
    # sizes its cache before the learner allocates.
    exchange(rollout_pg, {"engine_dtype": engine.dtype, "kept_dtypes": engine.kept_dtypes})
    buckets = bucket_plan(
        weight_plan(path),
        lambda name: wire_dtype(name, engine.dtype, engine.kept_dtypes),
        int(cfg.sync_bucket_mb * 2**20),
    )
    if cfg.lora_rank:
        # Only the adapters travel: this sampler holds the base weights it started from
        # and merges them in before the engine's in-place reload, which then runs the
        # plain model at full speed, with no LoRA kernels.
        # The base under the trained model's names (a composite stores its text model under
        # others, and its vision tower, which the text-only engine lacks, is left out).
        stored = lora.load_base(path)
        names = text_to_checkpoint([n for n, _ in weight_plan(path)], stored)
        base = {n: stored[c] for n, c in names.items() if c in stored}
        buckets = bucket_plan(adapter_plan(path, cfg), lambda name: torch.float32, int(cfg.sync_bucket_mb * 2**20))

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
                    result = {"eval": evaluate(engine, eval_prompts[index::num_samplers], cfg, reward_fns, step)}
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
                completions = engine.sample(
                    [p["prompt_ids"] for p in batch], cfg.group_size, cfg.max_new_tokens, cfg.temperature, key
                )
                rollouts = [Rollout(**c) for c in completions]
                t2 = time.time()
                records = [batch[i // cfg.group_size] for i in range(len(rollouts))]
                totals, parts, counts = score_batch(
                    [c.text for c in rollouts], records, reward_fns, step, cfg.reward_timeout, cfg.reward_workers
                )
                # A broken reward must not train the model on zeros for hours: past the
                # fraction, this sampler stops, and with it the job.
                check_failures(counts, cfg.max_reward_errors, step)
        except checkpoint.Preempted:
            send({"stopped": True})  # and exits
        for c, total, p in zip(rollouts, totals, parts):
            c.reward, c.parts = total, p
        report = {"rollouts": rollouts, "weights_step": weights_step, "reward_counts": counts, "sample_s": t2 - t1}
        report.update(reward_s=time.time() - t2, peak_memory_mb=metrics.peak_memory_mb(device))
        send(report)
        if not syncs_before_sampling(cfg, step, first):
            weights_step = sync(step)


def evaluate(engine, prompts, cfg, reward_fns, step):
    """Greedy completions of this sampler's share of the held-out prompts: sums of every
    reward and of the lengths, so the learner can add up the samplers' shares."""
    completions = engine.sample([p["prompt_ids"] for p in prompts], 1, cfg.max_new_tokens, 0.0, (cfg.seed, "eval"))
    totals, parts, _ = score_batch(
        [c["text"] for c in completions], prompts, reward_fns, step, cfg.reward_timeout, cfg.reward_workers
    )
    sums = {name: sum(p[name] for p in parts) for name, _, _ in reward_fns}
    return {"n": len(prompts), "length": sum(len(c["token_ids"]) for c in completions), "reward": sum(totals), **sums}


def run_learner(cfg, path, rank, weight_pg, rollout_pg, device, weight_device):
    from learner import Learner  # transformers and FSDP: heavy, and only a learner needs them

    started = time.time()
    engine = from_samplers(rollout_pg)[0]  # the samplers are ready; their engine's dtypes
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
    first = checkpoint.start_step(cfg)
    if cfg.resume:
        checkpoint.load_checkpoint(learner, cfg.resume)
    buckets = bucket_plan(
        weight_plan(path),
        lambda name: wire_dtype(name, engine["engine_dtype"], engine["kept_dtypes"]),
        int(cfg.sync_bucket_mb * 2**20),
    )
    if cfg.lora_rank:  # adapters only, in float32: they are small (see run_sampler)
        buckets = bucket_plan(adapter_plan(path, cfg), lambda name: torch.float32, int(cfg.sync_bucket_mb * 2**20))
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
        evals = metrics.merge_evals(collect(step, row))
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
        t3 = time.time()
        try:  # a signal drops the step between two micro-batches, on every learner alike
            sums, token_sums, maxima, grad_norm = train_step(
                cfg, learner, rollouts, rank, stop=lambda: checkpoint.stop_agreed(device)
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
            if cfg.samples_every and step % cfg.samples_every == 0:
                for c in rollouts[:: cfg.group_size][:4]:
                    sample = {"step": step, "text": c.text, "reward": c.reward, **c.parts, "truncated": c.truncated}
                    # the ids as trained: a reader can check them against the tokenizer
                    sample.update(prompt_ids=c.prompt_ids, token_ids=c.token_ids)
                    samples_log.write(json.dumps(sample) + "\n")
                samples_log.flush()
            bar.update()
            bar.set_postfix_str(
                f"reward {row['reward_mean']:.3f}, acc {row['accuracy']:.2f}, {row['step_s']:.1f} s/step"
            )
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


def model_folder_error(model):
    """Why `model` cannot be a model folder, where it names one: anything but a hub name
    of the form 'namespace/name' must be a folder holding a config.json."""
    hub_name = model.count("/") == 1 and not model.startswith((".", "~")) and not os.path.exists(model)
    if not hub_name and not os.path.isfile(os.path.join(model, "config.json")):
        what = "a folder without a config.json" if os.path.isdir(model) else "no such folder"
        return f"{what} (a model is 'tiny', a local Hugging Face folder or a hub name 'namespace/name')"
    return None


def hub_model_error(model):
    """Why a hub name cannot be loaded (no network and not in the local cache, no such
    repository), in one line, or None. launch.sh's check asks once, before any rank starts."""
    import huggingface_hub  # light next to transformers; only launch.sh's check needs it

    try:
        huggingface_hub.hf_hub_download(model, "config.json", local_files_only=True)
        return None
    except Exception:  # not in the cache: the hub must know it
        pass
    try:
        huggingface_hub.model_info(model, timeout=10)
        return None
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"not in the local Hugging Face cache, and the hub cannot give it ({type(e).__name__}: {reason})"


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


# ---------------------------------------------------------------- flags and main

SCALES = ("group", "batch", "none")


def fail(message, every_rank=False):
    """One clear line and a non-zero exit, before anything heavy loads. Under torchrun
    every rank checks the same flags, so only local rank 0 says why (`every_rank`: a
    check whose answer differs between ranks)."""
    if every_rank or os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"grpo.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def precision(dtype, has_gpu, cpu_bf16):
    """The one compute dtype of a run, for both devices: 'auto' is bfloat16 where the
    hardware multiplies in bf16 natively (CUDA GPUs; CPUs with AVX512-BF16 or AMX), else
    float32. From it: FSDP2 keeps float32 master weights and AdamW state, computes in it
    and reduces gradients in float32; vLLM runs in it; each parameter travels in the
    dtype the engine keeps it in (comm.wire_dtype); log-probs and the loss are float32
    always (learner.token_logprobs)."""
    if dtype == "auto":
        return "bfloat16" if has_gpu or cpu_bf16 else "float32"
    return dtype


def resolve(cfg, world_size, has_gpu, cpu_bf16=False):
    """Fill the 'auto' fields and check every flag against the world, so a config that
    cannot work stops here with the flag's name, before any model loads."""

    if cfg.model == "auto":
        cfg.model = HUB_MODEL if has_gpu else "tiny"
    tiny = cfg.model == "tiny"
    if cfg.dataset == "auto":
        cfg.dataset = "synthetic" if tiny else "gsm8k"
    cfg.max_new_tokens = cfg.max_new_tokens or (24 if tiny else 512)
    cfg.group_size = cfg.group_size or (4 if tiny else 8)
    cfg.lr = cfg.lr or (1e-3 if tiny else 1e-6)
    cfg.steps = (300 if tiny else 250) if cfg.steps == -1 else cfg.steps
    # The tiny model's warm-up policy answers near-uniformly; at 0.04 the pull back to it
    # is too weak to stop a collapse onto one answer per operator (README, "The embedded
    # tiny model"), at 0.2 it holds the entropy up for 200 steps.
    cfg.beta = (0.1 if tiny else 0.04) if cfg.beta == -1 else cfg.beta
    # At chance (1 in 10) most of the tiny model's groups of 4 are all wrong and carry no
    # policy gradient; dropping them makes its steps ~1.7x shorter, so 300 steps and the
    # build fit in 10 minutes (README, "The embedded tiny model": per step, one seed
    # learned faster without them and one slower).
    if cfg.drop_uniform_groups is None:
        cfg.drop_uniform_groups = tiny
    cfg.epsilon_high = cfg.epsilon_high or cfg.epsilon
    cfg.overlong_buffer = cfg.overlong_buffer or cfg.max_new_tokens // 4
    if cfg.dtype not in ("auto", "bfloat16", "float32"):
        fail(f"--dtype must be one of auto, bfloat16, float32, got {cfg.dtype!r}")
    cfg.dtype = precision(cfg.dtype, has_gpu, cpu_bf16)
    if cfg.eval_only:
        cfg.steps = 0
    samplers = world_size - cfg.learners
    if cfg.learners < 1:
        fail(f"--learners must be at least 1, got {cfg.learners}")
    if samplers < 1:
        fail(
            f"--learners {cfg.learners} leaves no sampler rank in a world of {world_size}; use --learners {world_size - 1} or more ranks"
        )
    if cfg.group_size < 2:
        fail(f"--group-size must be at least 2 for group advantages, got {cfg.group_size}")
    if cfg.prompts_per_step < 1 or cfg.prompts_per_step % samplers:
        fail(f"--prompts-per-step {cfg.prompts_per_step} must be a positive multiple of the {samplers} sampler ranks")
    if (cfg.prompts_per_step * cfg.group_size) % cfg.learners:
        fail(
            f"--prompts-per-step x --group-size ({cfg.prompts_per_step * cfg.group_size}) must divide across the {cfg.learners} learners"
        )
    if cfg.max_staleness not in (0, 1):
        fail(
            f"--max-staleness must be 0 or 1, got {cfg.max_staleness}: rollouts travel over blocking collectives, so the samplers run at most one step ahead"
        )
    if cfg.max_tokens_per_microbatch == -1:  # the default: room for one whole sequence at least
        cfg.max_tokens_per_microbatch = max(4096, cfg.max_prompt_len + cfg.max_new_tokens)
    if cfg.max_tokens_per_microbatch and cfg.max_tokens_per_microbatch < cfg.max_prompt_len + cfg.max_new_tokens:
        fail(
            f"--max-tokens-per-microbatch {cfg.max_tokens_per_microbatch} cannot hold one sequence of --max-prompt-len + --max-new-tokens ({cfg.max_prompt_len + cfg.max_new_tokens}) tokens"
        )
    for name, value, low in [
        ("steps", cfg.steps, 0),
        ("micro-batch-size", cfg.micro_batch_size, 1),
        ("max-tokens-per-microbatch", cfg.max_tokens_per_microbatch, 0),
        ("logprob-chunk", cfg.logprob_chunk, 0),
        ("max-new-tokens", cfg.max_new_tokens, 1),
        ("max-prompt-len", cfg.max_prompt_len, 1),
    ]:
        if value < low:
            fail(f"--{name} must be at least {low}, got {value}")
    if cfg.temperature <= 0:
        fail(f"--temperature must be positive for sampling, got {cfg.temperature}")
    if cfg.lr < 0 or cfg.epsilon <= 0 or cfg.epsilon_high < cfg.epsilon:
        fail("--lr must be >= 0, --epsilon > 0 and --epsilon-high >= --epsilon")
    if cfg.beta < 0 or cfg.tis_cap < 0:
        fail("--beta and --tis-cap must be >= 0")
    if cfg.lora_rank < 0:
        fail(f"--lora-rank must be >= 0, got {cfg.lora_rank}")
    cfg.lora_alpha = cfg.lora_alpha or 2.0 * cfg.lora_rank
    if cfg.lora_rank and not [t for t in cfg.lora_targets.split(",") if t]:
        fail("--lora-targets must name at least one linear layer, e.g. q_proj,v_proj")
    if cfg.sapo_tau_pos <= 0 or cfg.sapo_tau_neg <= 0:
        fail("--sapo-tau-pos and --sapo-tau-neg must be positive")
    for name, value, allowed in [
        ("loss-type", cfg.loss_type, LOSS_TYPES),
        ("scale", cfg.scale, SCALES),
        ("importance", cfg.importance, ("token", "sequence")),
        ("overlong", cfg.overlong, ("none", "mask", "penalty")),
    ]:
        if value not in allowed:
            fail(f"--{name} must be one of {', '.join(allowed)}, got {value!r}")
    try:
        load_objective(cfg.objective)
    except ValueError as e:
        fail(f"--objective: {e}")
    for name, dataset in [("dataset", cfg.dataset), ("eval-dataset", cfg.eval_dataset)]:
        if dataset and (error := dataset_error(dataset)):
            fail(f"--{name}: {error}")
    if cfg.reward_timeout <= 0:
        fail(f"--reward-timeout must be > 0 seconds (a hung reward must not stall a sampler), got {cfg.reward_timeout}")
    if cfg.reward_workers < 1:
        fail(f"--reward-workers must be at least 1, got {cfg.reward_workers}")
    if not 0 <= cfg.max_reward_errors <= 1:
        fail(f"--max-reward-errors is a fraction in [0, 1], got {cfg.max_reward_errors}")
    if not cfg.prompt_field:
        fail("--prompt-field must name a dataset column")
    if not tiny and (error := model_folder_error(cfg.model)):
        fail(f"--model {cfg.model}: {error}")
    if not has_gpu and not tiny and cfg.dtype == "float32" and os.path.isdir(cfg.model) and is_hybrid(cfg.model):
        fail(
            "--dtype float32: vLLM's CPU kernel for this model's linear-attention layers runs only in bf16 ('CPU GDN attention requires BF16'); use --dtype bfloat16"
        )
    try:
        parse_reward_spec(cfg.rewards)
    except ValueError as e:
        fail(f"--rewards: {e}")
    if cfg.report_to and cfg.report_to not in ("wandb", "tensorboard"):
        fail(f"--report-to must be wandb or tensorboard, got {cfg.report_to!r}")
    if cfg.report_to and importlib.util.find_spec(cfg.report_to) is None:
        fail(f"--report-to {cfg.report_to}: the {cfg.report_to} package is not installed (pip install {cfg.report_to})")
    if cfg.resume:
        try:
            cfg.resume = checkpoint.find_checkpoint(cfg.resume, cfg.out_dir)
        except ValueError as e:
            fail(f"--resume: {e}")
    elif os.path.exists(os.path.join(cfg.out_dir, "metrics.jsonl")) and not cfg.overwrite and not cfg.eval_only:
        fail(f"--out-dir {cfg.out_dir} already holds a run: pass --resume to continue it or --overwrite to replace it")
    return cfg


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
        node = int(os.environ.get("GROUP_RANK", "0"))
        for local in range(local_world):
            try:
                placement(
                    node * local_world + local, local, local_world, world, cfg.learners, gpus, cfg.sampler_gpu_memory
                )
            except ValueError as e:
                fail(str(e))
        print(cfg.out_dir)
        return
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    try:
        place = placement(rank, local_rank, local_world, world, cfg.learners, gpus, cfg.sampler_gpu_memory)
    except ValueError as e:
        fail(str(e), every_rank=True)
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
                "--dtype bfloat16 on a CPU without AVX512-BF16 or AMX: bf16 is emulated here, several times slower than float32 (README, 'Precision')"
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


def parse_flags(argv):
    """parse_config, with argparse's usage and error (some fifty lines) cut to its one
    line of error, in fail()'s form; --help is unchanged."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_config(argv)
    except SystemExit as e:
        if e.code:
            fail(err.getvalue().strip().splitlines()[-1].partition("error: ")[2])
        raise


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


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
