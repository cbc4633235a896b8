"""Held-out evaluation: greedy, or N samples per prompt at a temperature, with the numbers
a paper reports from them. For each prompt with n samples of which c are correct:

    pass@1    mean accuracy over the n samples (eval_pass_at_1)
    pass@k    1 - C(n - c, k) / C(n, k): the chance that k of the n drawn without
              replacement hold a correct one; unbiased (Chen et al., 2021, Codex), unlike
              1 - (1 - c/n)^k (eval_pass_at_k, for k = 2, 4, 8, ... and n)
    maj@n     the answer most samples give is correct (self-consistency, Wang et al.,
              2023); samples without an answer do not vote (eval_maj_at_n)

A sample is correct when the task's accuracy reward (the first of --rewards that declares
the answer it reads, `fn.answer`) gives it 1. Each eval also goes to evals/step_<k>.jsonl,
a line per sample."""

import json
import os
from collections import Counter

from rewards import score_batch


def pass_at_k(n, c, k):
    """The unbiased pass@k of one prompt with c correct samples out of n, as a product
    (the binomials overflow a float for large n)."""
    if n - c < k:
        return 1.0
    p = 1.0
    for i in range(n - c + 1, n + 1):
        p *= 1.0 - k / i
    return 1.0 - p


def majority_correct(answers, correct):
    """Whether the most common non-None answer is a correct one (ties: the first seen)."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    top = votes.most_common(1)[0][0]
    return any(ok for a, ok in zip(answers, correct) if a == top)


def ks(n):
    """The k of pass@k reported for n samples: the powers of 2 from 2 below n, and n."""
    out, k = [], 2
    while k < n:
        out.append(k)
        k *= 2
    return out + [n] if n > 1 else []


def accuracy_reward(reward_fns):
    """(name, fn) of the first reward that declares the answer it reads, or None."""
    return next(((name, fn) for name, fn, _ in reward_fns if hasattr(fn, "answer")), None)


def evaluate(episodes, eval_prompts, share, cfg, reward_fns, step):
    """This sampler's share of the held-out prompts (their indices), run as episodes (the
    sampler's `episodes`: one turn, or the environment's): sums over prompts of
    each reward's mean over its samples, of the length, and of pass@k and maj@n when
    there are several samples, so that the learner can add up the samplers' shares; and
    every sample, for evals/."""
    n, prompts = cfg.eval_samples, [eval_prompts[i] for i in share]
    completions, _ = episodes(prompts, n, cfg.eval_temperature, (cfg.seed, "eval"))
    records = [{**prompts[i // n], "turns": c.turns} for i, c in enumerate(completions)]
    texts = [c.text for c in completions]
    totals, parts, _ = score_batch(texts, records, reward_fns, step, cfg.reward_timeout, cfg.reward_workers)
    out = {"n": len(prompts), "length": sum(len(c.token_ids) for c in completions) / n, "reward": sum(totals) / n}
    out.update({name: sum(p[name] for p in parts) / n for name, _, _ in reward_fns})
    accuracy = accuracy_reward(reward_fns)
    answers = [accuracy[1].answer(t) for t in texts] if accuracy else [None] * len(texts)
    if n > 1 and accuracy:
        correct = [p[accuracy[0]] >= 1.0 for p in parts]
        by_prompt = [range(i * n, (i + 1) * n) for i in range(len(prompts))]
        out["pass_at_1"] = sum(correct) / n
        for k in ks(n):
            out[f"pass_at_{k}"] = sum(pass_at_k(n, sum(correct[j] for j in js), k) for js in by_prompt)
        out[f"maj_at_{n}"] = sum(
            majority_correct([answers[j] for j in js], [correct[j] for j in js]) for js in by_prompt
        )
    out["samples"] = [
        {"index": share[i // n], "sample": i % n, "prompt": records[i]["prompt"], "completion": t}
        | {"answer": None if a is None else str(a), "reward": r, **p}
        | {"token_ids": completions[i].token_ids}  # the report shows them token by token
        | ({"turns": records[i]["turns"], "model_mask": completions[i].model_mask} if cfg.env else {})
        for i, (t, a, r, p) in enumerate(zip(texts, answers, totals, parts))
    ]
    return out


def write_samples(out_dir, step, reports):
    """evals/step_<step>.jsonl: every sample of the samplers' shares, in prompt order."""
    samples = sorted((s for r in reports for s in r["eval"]["samples"]), key=lambda s: (s["index"], s["sample"]))
    os.makedirs(os.path.join(out_dir, "evals"), exist_ok=True)
    with open(os.path.join(out_dir, "evals", f"step_{step}.jsonl"), "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
