"""Run by tests/test_episodes.py in a process of its own (vLLM leaves a default process
group and its memory behind in the process that holds it): three-turn episodes of
SmolLM2 on the real engine, with every engine call written down, saved as JSON.

    python tests/plugins/episodes_worker.py MODEL OUT.json"""

import dataclasses
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import envs  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from data import build_prompts  # noqa: E402
from episodes import run_episodes  # noqa: E402
from rewards import RewardPool  # noqa: E402
from sampler import Sampler  # noqa: E402

QUESTIONS = ["What is 12 times 7?", "Name a prime above 50.", "Spell 'cat' backwards.", "What is 3.5 + 1.25?"]


def main():
    model, out = sys.argv[1], sys.argv[2]
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = build_prompts([{"question": q} for q in QUESTIONS], tokenizer, 256, "test", system_prompt=None)
    engine = Sampler(model, 512, 0, "bfloat16", kv_cache_gb=0.5)
    calls, sample = [], engine.sample

    def recorded(prompt_ids, n, max_tokens, temperature, key):  # the real engine, its calls written down
        completions = sample(prompt_ids, n, max_tokens, temperature, key)
        calls.append(completions)
        return completions

    engine.sample = recorded
    cfg = types.SimpleNamespace(max_new_tokens=120, max_turns=3, reward_timeout=10.0, env="envs:follow_up")
    pool = RewardPool([cfg.env], 1, raw=True)
    try:
        episodes, counts = run_episodes(engine, prompts, 2, 1.0, (0, "t"), cfg, tokenizer, envs.follow_up, pool)
    finally:
        pool.close()
    with open(out, "w") as f:
        episodes = [dataclasses.asdict(e) for e in episodes]
        json.dump({"prompts": prompts, "calls": calls, "episodes": episodes, "counts": counts}, f)


if __name__ == "__main__":
    main()
