"""A user's objective, loaded by `--objective user_objective:reinforce` in the tests: the
shape README's "Adding an objective" shows."""

import torch


def reinforce(logp, sampler_logp, advantages, mask, cfg):
    """Plain REINFORCE with group advantages: -A log pi per token, no ratio."""
    per_token = -advantages[:, None] * logp  # [B, T]
    return per_token, {"ratio_mean": (torch.exp(logp - sampler_logp).detach() * mask).sum()}
