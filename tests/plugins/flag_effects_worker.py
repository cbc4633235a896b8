"""Run by test_flag_effects.py in a process of its own (a one-rank gloo group, so the
test process never holds a default group beside vLLM's): one optimizer step of
train_step on the tiny model per case, each from the same initial weights, and the
updated weights, train_step's sums and the advantages it set saved to OUT/<case>.pt.
Plain SGD and no clipping, as in invariance_worker.py: Adam's first step would divide
away the normalisers these cases differ in."""

import os
import random
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from config import parse_config, resolve  # noqa: E402
from grpo import Rollout, train_step  # noqa: E402
from learner import Learner  # noqa: E402

G, MAX_NEW, VOCAB = 4, 12, 259


def group(rng, rewards, lengths):
    """One prompt's G rollouts with these rewards and completion lengths (a completion of
    MAX_NEW tokens was cut there)."""
    prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 10))]
    return [
        Rollout(
            prompt_ids=prompt,
            token_ids=[rng.randrange(3, VOCAB) for _ in range(n)],
            sampler_logprobs=[0.0] * n,  # near_policy sets them
            text="",
            truncated=n == MAX_NEW,
            reward=r,
        )
        for r, n in zip(rewards, lengths)
    ]


def cases():
    rng = random.Random(0)
    # Two groups of equal rewards (all right, all wrong) between two that carry signal.
    same1, mixed_a, same0, mixed_b = (
        group(rng, [1.0] * G, [5, 9, 3, 7]),
        group(rng, [1.0, 0.0, 0.0, 1.0], [4, 8, 6, 10]),
        group(rng, [0.0] * G, [6, 2, 11, 8]),
        group(rng, [0.0, 1.0, 1.0, 0.5], [9, 3, 5, 7]),
    )
    full, signal, uniform = same1 + mixed_a + same0 + mixed_b, mixed_a + mixed_b, same1 + same0
    # Two of each group's four completions cut at MAX_NEW tokens, with the same mean
    # reward as the two kept: with scale none the kept ones' advantages are the same in
    # pairs of their own (G = 2), so the step that masks the cut ones can be compared
    # with the step on the kept ones alone, without the flag.
    cut_a, cut_b = (
        group(rng, [1.0, 0.0, 0.0, 1.0], [MAX_NEW, 5, MAX_NEW, 7]),
        group(rng, [0.5, 0.0, 0.0, 0.5], [3, MAX_NEW, 9, MAX_NEW]),
    )
    cut, kept = cut_a + cut_b, [c for c in cut_a + cut_b if not c.truncated]
    drop, mask, pairs = (
        {"drop_uniform_groups": True},
        {"overlong": "mask", "scale": "none"},
        {"group_size": 2, "scale": "none"},
    )
    return {
        "drop-full": (drop, full),
        "plain-signal": ({}, signal),  # the batch without the groups the flag drops
        "plain-full": ({}, full),
        "drop-uniform": (drop, uniform),  # every group dropped: no step at all
        "mask-cut": (mask, cut),
        "plain-kept": (pairs, kept),  # the batch without the completions the flag masks
        "plain-cut": ({"scale": "none"}, cut),
    }


def near_policy(model_path, batches, seed=2):
    """Give every rollout sampler log-probs within 0.1 of the initial model's own, so each
    ratio starts near 1 and every sequence weighs alike in the gradient (random ones would
    let a few exploding ratios swamp the step)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    rng = random.Random(seed)
    for c in {id(c): c for rollouts in batches for c in rollouts}.values():
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        c.sampler_logprobs = [x + rng.uniform(-0.1, 0.1) for x in logp[len(c.prompt_ids) - 1 :].tolist()]


def main():
    model_path, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    todo = cases()
    near_policy(model_path, [rollouts for _, rollouts in todo.values()])
    for name, (overrides, rollouts) in todo.items():
        flags = {
            "model": model_path,
            "out_dir": out_dir,
            "group_size": G,
            "max_new_tokens": MAX_NEW,
            "max_prompt_len": 10,
            "max_grad_norm": 1e9,
            "beta": 0.0,
            **overrides,
        }
        flags["prompts_per_step"] = len(rollouts) // flags["group_size"]
        argv = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
        cfg = resolve(parse_config(argv), world_size=2, has_gpu=False)
        torch.manual_seed(0)
        learner = Learner(model_path, mesh, torch.device("cpu"), lr=0.0)
        learner.optimizer = torch.optim.SGD(learner.model.parameters(), lr=0.5)
        sums, _, _, grad_norm = train_step(cfg, learner, rollouts, 0)
        state = {n: learner.full_tensor(n, torch.float32).clone() for n in learner.named_params}
        result = {
            "state": state,
            "sums": sums,
            "grad_norm": grad_norm,
            "advantages": [c.advantage for c in rollouts],
            "lengths": [len(c.token_ids) for c in rollouts],
        }
        torch.save(result, os.path.join(out_dir, f"{name}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
