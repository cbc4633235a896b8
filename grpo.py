"""GRPO, the algorithm. For each prompt, G completions o_1..o_G drawn by the sampler's
policy pi_old, with rewards r_i, and the loss the learners minimise:

    A_i    = (r_i - mean_j r_j) / (std_j r_j + eps)           the group's advantage
    rho_it = pi(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)     each token's ratio
    L      = -1/G sum_i 1/|o_i| sum_t [ min(rho_it A_i, clip(rho_it, 1-eps, 1+eps_high) A_i)
                                          - beta KL3(pi_ref || pi)_it ]

GRPO (Shao et al., 2024, DeepSeekMath), with the clipped ratio of PPO (Schulman et al.,
2017) taken against the sampler's own log-probs. The variants, each one function or one
flag, the same normalisation rules for all (aggregate):
    --loss-type dr_grpo     sum over tokens / (G x max tokens)           Dr. GRPO (Liu et al., 2025)
    --loss-type dapo, bnpo  one token-level mean over the step           DAPO (Yu et al., 2025)
    --epsilon-high          clip-higher: a wider upper clip              DAPO
    --drop-uniform-groups   dynamic sampling: groups of equal rewards out DAPO
    --overlong penalty      a soft penalty near --max-new-tokens         DAPO
    --importance sequence   one ratio per sequence, the tokens' geometric mean   GSPO (Zheng et al., 2025)
    --objective cispo       -sg(min(rho, 1 + eps_high)) A log pi         CISPO (MiniMax-M1, 2025)
    --objective sapo        a soft gate 4/tau sigmoid(tau (rho - 1)) in place of the clip   SAPO (Qwen, 2025)
    --mismatch tis          each token weighted by min(pi / pi_sampler, high)   TIS (Yao et al., 2025)
    --mismatch mask         tokens with pi / pi_sampler outside [low, high] out, the rest weighted by it
                                                                         IcePop (Ling, 2025); MIS
    --mismatch seq-mask     sequences whose geometric-mean ratio leaves [low, high] out   SkyRL, verl geo_rs
    --beta                  k3 estimate of KL to the initial policy      DeepSeekMath
    --teacher, --distill-coef   each token's advantage - coef (log pi - log pi_teacher)
                                                  on-policy distillation (GKD, Agarwal et al., 2024)

An objective is one function of (logp, sampler_logp, advantages, mask) and its own keyword
parameters (set with --objective-args name=value; epsilon, epsilon_high and importance come
from the flags of those names); aggregation, the KL and the mismatch correction are applied
around it, the same for every objective. The job that runs this (the two roles, the weight sync) is job.py."""

import functools
import inspect
from dataclasses import dataclass, field

import torch

from plugins import load_function


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
    model_mask: list | None = None  # per token_ids: 1 drawn by the model, 0 the environment's (episodes.py)
    turns: list | None = None  # the conversation as chat messages, when the sampler kept it
    keep_logprobs: bool = False  # the learner keeps its log-probs of this one (samples.jsonl's)
    learner_logprobs: list | None = None  # per token_ids, the learner's before its update, when kept

    def model_tokens(self):
        return len(self.token_ids) if self.model_mask is None else sum(self.model_mask)


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


# Objectives: (logp, sampler_logp, advantages, mask, *, own parameters) -> (per-token
# loss [B, T], stats); every tensor is [B, T] (advantages: each token's, the sequence's
# group advantage plus any per-token term such as distillation's). The loss need not be masked (aggregate masks it). Each stat is a
# sum over this batch's completion tokens and is reported per token under its own name
# (one named *_seqs counts sequences instead, and is reported per sequence).
# An objective may carry `check(**parameters) -> message or None`, asked once at start.


def clip(logp, sampler_logp, advantages, mask, *, epsilon=0.2, epsilon_high=0.2, importance="token"):
    """PPO's clipped ratio, as GRPO uses it: -min(r A, clip(r, 1-eps, 1+eps_high) A)."""
    ratio = torch.exp(importance_log_ratio(logp, sampler_logp, mask, importance))  # [B, T]
    adv = advantages  # [B, T]
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - epsilon, 1 + epsilon_high) * adv)
    with torch.no_grad():
        live = mask > 0
        stats = {
            "ratio_mean": (ratio * mask).sum(),
            "clip_low_frac": ((ratio < 1 - epsilon) & (adv < 0) & live).sum(),
            "clip_high_frac": ((ratio > 1 + epsilon_high) & (adv > 0) & live).sum(),
        }
    return per_token, stats


def cispo(logp, sampler_logp, advantages, mask, *, epsilon_high=0.2, importance="token"):
    """MiniMax-M1's CISPO: clip the importance weight, not the update, so every token
    keeps its gradient: -sg(min(r, 1 + eps_high)) A log pi. No lower bound, as in the
    paper; the loss's value is not meaningful, its gradient is."""
    ratio = torch.exp(importance_log_ratio(logp, sampler_logp, mask, importance))  # [B, T]
    weight = ratio.clamp(max=1 + epsilon_high).detach()
    per_token = -weight * advantages * logp
    with torch.no_grad():
        stats = {
            "ratio_mean": (ratio * mask).sum(),
            "clip_high_frac": ((ratio > 1 + epsilon_high) & (mask > 0)).sum(),
        }
    return per_token, stats


def sapo(logp, sampler_logp, advantages, mask, *, tau_pos=1.0, tau_neg=1.05, importance="token"):
    """Qwen's SAPO: a soft gate in place of the hard clip, -(4 / tau) sigmoid(tau (r - 1)) A.
    Its gradient is r A 4 s (1 - s) grad log pi with s the sigmoid: exactly GRPO's at r = 1,
    fading smoothly as r leaves 1, faster for negative advantages (tau_neg > tau_pos: their
    off-policy tokens destabilise more)."""
    ratio = torch.exp(importance_log_ratio(logp, sampler_logp, mask, importance))  # [B, T]
    adv = advantages  # [B, T]
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(ratio.dtype)  # [B, T]
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    per_token = -gate * adv
    with torch.no_grad():
        s = torch.sigmoid(tau * (ratio - 1))
        stats = {"ratio_mean": (ratio * mask).sum(), "gate_weight_mean": (4 * s * (1 - s) * mask).sum()}
    return per_token, stats


sapo.check = lambda tau_pos, tau_neg, **_: None if tau_pos > 0 and tau_neg > 0 else "tau_pos and tau_neg must be > 0"


OBJECTIVES = {"clip": clip, "cispo": cispo, "sapo": sapo}


SHARED_PARAMETERS = ("epsilon", "epsilon_high", "importance")  # flags that several objectives read


def bind_objective(cfg):
    """The run's objective with its parameters bound, once per run: each keyword parameter
    takes --objective-args' value, else the flag of the same name (epsilon, epsilon_high,
    importance), else its own default. Raises ValueError naming a bad parameter."""
    fn = load_function(cfg.objective, "objective", OBJECTIVES)
    params = {n: p for n, p in inspect.signature(fn).parameters.items() if p.kind == p.KEYWORD_ONLY}
    bound = {n: getattr(cfg, n) for n in params if n in SHARED_PARAMETERS}
    for item in filter(None, (a.strip() for a in cfg.objective_args.split(","))):
        name, _, value = item.partition("=")
        if name not in params:
            raise ValueError(
                f"{cfg.objective} has no parameter {name!r} (its parameters: {', '.join(params) or 'none'})"
            )
        default = params[name].default
        try:
            kind = float if default is inspect.Parameter.empty or default is None else type(default)
            bound[name] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
        except ValueError:
            raise ValueError(f"{cfg.objective}'s {name}={value!r} is not a {kind.__name__}")
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in bound]
    if missing:
        raise ValueError(f"{cfg.objective} needs --objective-args {missing[0]}=...")
    if hasattr(fn, "check") and (problem := fn.check(**{n: bound.get(n, p.default) for n, p in params.items()})):
        raise ValueError(f"{cfg.objective}: {problem}")
    return functools.partial(fn, **bound)


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


def mismatch_weight(logp, sampler_logp, mask, mode, low, high):
    """The training-inference mismatch correction: a detached weight per token [B, T] from
    the ratio of the learner's probability to the sampler's, which differ by numerics
    (bf16 kernels, another engine) even on-policy, and by one step with --max-staleness 1.
      tis       min(ratio, high)                                   TIS (Yao et al., 2025)
      mask      ratio inside [low, high], else 0                   IcePop (Ling team, 2025)
      seq-mask  1, or 0 for the whole sequence when the geometric mean of its ratios
                leaves [low, high]                                 SkyRL; verl's geo_rs
    A weight of 0 removes exactly that token's gradient; the normalisers still count it.
    Returns (weight, stats): the tokens and sequences the masks dropped."""
    log_ratio = (logp.detach() - sampler_logp) * mask  # [B, T]
    ratio = torch.exp(log_ratio)
    if mode == "tis":
        return mask * ratio.clamp(max=high), {}
    if mode == "mask":
        kept = mask * ((ratio >= low) & (ratio <= high))
        # where, not kept * ratio: a log ratio past float32's exp range (about 88) makes
        # ratio inf, and 0 * inf is NaN, which would skip the whole step for one token.
        weight = torch.where(kept.bool(), ratio, 0.0)
    elif mode == "seq-mask":
        geometric = torch.exp(log_ratio.sum(-1) / mask.sum(-1).clamp(min=1))  # [B]
        kept = weight = mask * ((geometric >= low) & (geometric <= high))[:, None]
    else:
        raise ValueError(f"unknown mismatch correction {mode!r}")
    dropped = mask - kept  # [B, T]
    return weight, {"mismatch_masked_tokens": dropped.sum(), "mismatch_masked_seqs": (dropped.sum(-1) > 0).sum()}


def policy_loss(
    logp,
    sampler_logp,
    advantages,
    mask,
    cfg,
    ref_logp=None,
    num_sequences=None,
    num_tokens=None,
    objective=None,
    teacher_logp=None,
):
    """The loss of one micro-batch: the objective per token, plus beta * k3 KL to the
    reference, weighted and aggregated. logp [B, T] is the learner's (before this step's
    update) and sampler_logp the sampler's; advantages [B] the group advantages;
    num_sequences and num_tokens are the whole step's (default: this batch's);
    `objective` is bind_objective's (default: bound here).
    With a teacher (on-policy distillation: GKD, Agarwal et al., 2024; Thinking Machines,
    2025), each sampled token's advantage gains distill_coef * (log pi_teacher - log pi),
    minus the per-token reverse KL, so the policy is pulled to the teacher's choices on
    its own samples; `teacher_kl` reports the KL's mean.
    With a --mismatch correction, each token is weighted by mismatch_weight, and the
    objective's ratio is taken against the learner's own log-probs instead of the
    sampler's (the decoupled form: the correction handles sampler vs learner, the clip
    the policy's own change). Returns (loss, stat sums over this batch's tokens)."""
    advantages = advantages[:, None].expand_as(logp)  # [B, T]: the sequence's, on each token
    extra_stats = {}
    if teacher_logp is not None:
        reverse_kl = logp.detach() - teacher_logp  # [B, T]: log pi - log pi_teacher, sampled tokens
        advantages = advantages - cfg.distill_coef * reverse_kl
        extra_stats["teacher_kl"] = (reverse_kl * mask).sum()
    weight = mask  # [B, T]
    if cfg.mismatch != "none":
        weight, mismatch_stats = mismatch_weight(
            logp, sampler_logp, mask, cfg.mismatch, cfg.mismatch_low, cfg.mismatch_high
        )
        extra_stats.update(mismatch_stats)
        sampler_logp = logp.detach()
    per_token, stats = (objective or bind_objective(cfg))(logp, sampler_logp, advantages, mask)
    stats.update(extra_stats)
    if cfg.beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3: unbiased, always >= 0
        per_token = per_token + cfg.beta * kl
        stats["kl"] = (kl.detach() * mask).sum()
    counts = (num_sequences or logp.shape[0], num_tokens or mask.sum())
    loss = aggregate(per_token * weight, mask, cfg.loss_type, *counts, cfg.max_new_tokens)
    return loss, stats


def overlong_penalty(length, max_new_tokens, buffer):
    """DAPO's soft length penalty: 0 up to max_new_tokens - buffer, then down to -1 at the limit."""
    return min(0.0, (max_new_tokens - buffer - length) / buffer) if buffer > 0 else 0.0


def train_step(cfg, learner, rollouts, rank, stop=None, objective=None, keep=()):
    """One optimizer step on the step's rollouts (every learner holds all of them): group
    advantages, the optional filters, this learner's shard in micro-batches, then clip
    and step. `stop()` may drop the step between micro-batches (Learner.forward_backward).
    `keep`: indices of rollouts (the same on every learner) that get the learner's
    per-token log-probs in learner_logprobs, for samples.jsonl (None where not trained).
    Returns (this learner's metric sums: counts and per-token sums, its maxima, the grad
    norm)."""
    objective = objective or bind_objective(cfg)
    for i in keep:
        rollouts[i].keep_logprobs = True
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
    mine = learner_share(batch, rank, cfg)
    counts = step_counts(batch)

    def loss_fn(logp, sampler_logp, advantages, mask, ref_logp, teacher_logp):
        return policy_loss(
            logp,
            sampler_logp,
            advantages,
            mask,
            cfg,
            ref_logp,
            **counts,
            objective=objective,
            teacher_logp=teacher_logp,
        )

    sums, token_sums, maxima = learner.forward_backward(mine, loss_fn, cfg.temperature, stop)
    if keep and cfg.learners > 1:
        share_kept_logprobs([rollouts[i] for i in keep], learner.device)
    if batch:
        grad_norm = learner.clip_grad_and_step(cfg.max_grad_norm)
    else:  # every group dropped: no step at all, on any learner (they all see the same batch)
        learner.optimizer.zero_grad(set_to_none=True)
        grad_norm = 0.0
    sums["groups_uniform"] = sum(uniform) if rank == 0 else 0
    sums["groups_dropped"] = sums["groups_uniform"] if cfg.drop_uniform_groups else 0
    sums.update(sequences_trained=sum(map(len, mine)), **padding_counts(mine))
    return sums, token_sums, maxima, grad_norm


def share_kept_logprobs(kept, device):
    """Every learner gets the kept rollouts' learner log-probs, which only the learner that
    trained each one computed: one all-reduce of a flat tensor whose layout all learners
    know (they hold the same rollouts), so it costs a collective only on logged steps."""
    lengths = [len(c.token_ids) for c in kept]
    flat = torch.zeros(sum(lengths) + len(kept), dtype=torch.float64)  # the values, then a flag per rollout
    start = 0
    for j, c in enumerate(kept):
        if c.learner_logprobs is not None:
            flat[start : start + lengths[j]] = torch.tensor(c.learner_logprobs, dtype=torch.float64)
            flat[sum(lengths) + j] = 1
        start += lengths[j]
    flat = flat.to(device)
    torch.distributed.all_reduce(flat)
    values, trained = flat[: sum(lengths)].tolist(), flat[sum(lengths) :].tolist()
    start = 0
    for j, c in enumerate(kept):
        c.learner_logprobs = values[start : start + lengths[j]] if trained[j] else None
        start += lengths[j]


def learner_share(batch, rank, cfg):
    """This learner's micro-batches of the step's batch. Every learner runs the same
    number of them, since each forward is a collective: one with fewer runs empty ones."""
    per_rank = -(-len(batch) // cfg.learners)
    packs = [
        micro_batches(batch[r * per_rank : (r + 1) * per_rank], cfg.max_tokens_per_microbatch, cfg.micro_batch_size)
        for r in range(cfg.learners)
    ]
    return packs[rank] + [[]] * (max(1, max(map(len, packs))) - len(packs[rank]))


def padding_counts(micro_batches):
    """The positions the learner computed on (each micro-batch padded to its longest) and
    how many of them were padding."""
    positions = sum(len(mb) * max(map(sequence_length, mb)) for mb in micro_batches if mb)
    return {"positions": positions, "padding": positions - sum(sequence_length(c) for mb in micro_batches for c in mb)}


def step_counts(batch):
    """The whole step's normalisers: its sequences, and the model's tokens in them (an
    episode's environment ids are not the policy's: they carry no loss and do not count)."""
    return {"num_sequences": max(1, len(batch)), "num_tokens": max(1, sum(c.model_tokens() for c in batch))}


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
