"""tasks/reverse.py:  bash launch.sh --dataset reverse --rewards reversed"""

import random

METRICS = ("reversed",)  # logged as itself, not as reward_reversed


def rows(split):  # the dataset: 200 words to train on, 50 held out
    rng = random.Random(split)
    words = ["".join(rng.choices("abcdefgh", k=rng.randint(3, 6))) for _ in range(200 if split == "train" else 50)]
    return [{"question": f"Spell {w} backwards.", "word": w} for w in words]


def reversed_word(completion, record):
    return float(completion.strip() == record["word"][::-1])


reversed_word.needs, reversed_word.system_prompt = ("word",), "Reply with the word backwards, nothing else."
REWARDS = {"reversed": reversed_word}
