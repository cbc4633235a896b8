"""Run under torchrun by test_algorithm.py: one optimizer step of train_step per loss
configuration and micro-batch size on a fixed batch, full weights saved by rank 0.
Plain SGD and no clipping, so any error in how losses are normalised shows in the
weights (Adam's first step would divide it away)."""

import copy
import os
import random
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import lora  # noqa: E402
from config import parse_config, resolve  # noqa: E402
from grpo import Rollout, train_step  # noqa: E402
from learner import Learner  # noqa: E402

CONFIGS = {
    "grpo": {},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {"loss_type": "dapo", "epsilon_high": 0.28, "drop_uniform_groups": True, "overlong": "mask"},
    "gspo": {"importance": "sequence", "scale": "batch"},
    "kl_tis": {"beta": 0.1, "tis_cap": 2.0, "overlong": "penalty", "overlong_buffer": 4},
    # The tiny model gives these random tokens about 1e-3 of the sampler's made-up
    # probability: bands that keep some tokens and sequences and drop others.
    "icepop": {"mismatch": "mask", "mismatch_low": 0.002, "mismatch_high": 2.0, "loss_type": "dapo"},
    "seq_mask": {"mismatch": "seq-mask", "mismatch_low": 0.002, "mismatch_high": 2.0},
    "cispo": {"objective": "cispo", "epsilon_high": 2.0, "loss_type": "bnpo"},
    "sapo": {"objective": "sapo", "importance": "sequence"},
    "lora": {"lora_rank": 4, "lora_alpha": 8.0, "beta": 0.1},  # the KL reference is the adapters switched off
    # Episodes: environment ids inside the completions (model_mask 0) with log-probs that
    # no sampler would give (+5): they carry no loss, so "episodes_env0", the same
    # rollouts with 0 there, must step the same.
    "episodes": {"loss_type": "dapo", "beta": 0.1, "env_logprob": 5.0},
    "episodes_env0": {"loss_type": "dapo", "beta": 0.1, "env_logprob": 0.0},
}


def with_environment(rollouts, env_logprob):
    """Each completion of 4 or more ids gets its middle third marked as the environment's."""
    for c in rollouts:
        n = len(c.token_ids)
        c.model_mask = [0 if n >= 4 and n // 3 <= t < 2 * n // 3 else 1 for t in range(n)]
        c.sampler_logprobs = [lp if m else env_logprob for lp, m in zip(c.sampler_logprobs, c.model_mask)]
    return rollouts


# Micro-batches of 1, 2 or all sequences, or packed to a token budget (sequences here
# are 4 to 22 tokens long).
SPLITS = {
    "seq1": {"micro_batch_size": 1, "max_tokens_per_microbatch": 0},
    "seq2": {"micro_batch_size": 2, "max_tokens_per_microbatch": 0},
    "seq32": {"micro_batch_size": 32, "max_tokens_per_microbatch": 0},
    "tok30": {"max_tokens_per_microbatch": 30},
    "tok4096": {"max_tokens_per_microbatch": 4096},
}


def fixed_rollouts(vocab, prompts=8, group_size=4, max_new_tokens=12):
    rng = random.Random(0)
    rollouts = []
    for p in range(prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 10))]
        uniform = p == 0  # one group whose rewards are all equal
        for _ in range(group_size):
            n = rng.randint(1, max_new_tokens)
            rollouts.append(
                Rollout(
                    prompt_ids=prompt,
                    token_ids=[rng.randrange(3, vocab) for _ in range(n)],
                    sampler_logprobs=[rng.uniform(-7.0, -4.0) for _ in range(n)],
                    text="",
                    reward=1.0 if uniform else float(rng.randint(0, 2)),
                    truncated=n == max_new_tokens,
                )
            )
    return rollouts


def main():
    model_path, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rollouts = fixed_rollouts(vocab=259)
    for name, overrides in CONFIGS.items():
        overrides = dict(overrides)
        env_logprob = overrides.pop("env_logprob", None)
        for split, sizes in SPLITS.items():
            flags = {
                "model": model_path,
                "out_dir": out_dir,
                "learners": world,
                "prompts_per_step": 8,
                "group_size": 4,
                "max_new_tokens": 12,
                "max_prompt_len": 10,
                "max_grad_norm": 1e9,
                "beta": 0.0,
                **sizes,
                **overrides,
            }
            argv = [
                f"--{k.replace('_', '-')}={v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}"
                for k, v in flags.items()
            ]
            cfg = resolve(parse_config(argv), world_size=world + 1, has_gpu=False)
            torch.manual_seed(0)
            adapters = (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets.split(",")) if cfg.lora_rank else None
            learner = Learner(model_path, mesh, torch.device("cpu"), lr=0.0, reference=cfg.beta > 0, lora=adapters)
            learner.optimizer = torch.optim.SGD([p for p in learner.model.parameters() if p.requires_grad], lr=0.5)
            batch = copy.deepcopy(rollouts)
            if env_logprob is not None:
                batch = with_environment(batch, env_logprob)
            sums, token_sums, _, grad_norm = train_step(cfg, learner, batch, rank)
            state = {n: learner.full_tensor(n, torch.float32).clone() for n in learner.named_params}
            if cfg.lora_rank:  # the merged policy, in Hugging Face names: what the samplers run
                base = {lora.base_name(n): t for n, t in state.items() if not n.endswith(("lora_A", "lora_B"))}
                state = dict(lora.merged_weights(base, state, cfg.lora_alpha / cfg.lora_rank))
            if rank == 0:
                torch.save(
                    {"state": state, "grad_norm": grad_norm, "sums": {**sums, **token_sums}},
                    os.path.join(out_dir, f"{name}-{split}-L{world}.pt"),
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
