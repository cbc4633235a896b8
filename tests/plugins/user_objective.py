"""A user's objective, loaded by `--objective user_objective:reinforce` in the tests: the
shape README's "Extending" shows."""

import torch


def reinforce(logp, sampler_logp, advantages, mask):
    """Plain REINFORCE with group advantages: -A log pi per token, no ratio."""
    per_token = -advantages * logp  # [B, T]
    return per_token, {"ratio_mean": (torch.exp(logp - sampler_logp).detach() * mask).sum()}


def slow_clip(logp, sampler_logp, advantages, mask, *, epsilon=0.2, epsilon_high=0.2, importance="token"):
    """The clipped objective, 2 s slower per micro-batch once the file GRPO_TEST_SLOW_LEARNER
    names + '.go' exists (it touches the file itself then): a learner step made minutes long."""
    import os
    import time

    from grpo import clip

    marker = os.environ.get("GRPO_TEST_SLOW_LEARNER", "")
    if marker and os.path.exists(marker + ".go"):
        open(marker, "a").close()
        time.sleep(2)
    return clip(logp, sampler_logp, advantages, mask, epsilon=epsilon, epsilon_high=epsilon_high, importance=importance)


def scaled_reinforce(logp, sampler_logp, advantages, mask, *, scale=1.0):
    """REINFORCE times a parameter of its own, set with --objective-args scale=2."""
    return -scale * advantages * logp, {}


scaled_reinforce.check = lambda scale: None if scale > 0 else "scale must be > 0"
