"""The synthetic task: single-digit sums and differences worded as GSM8K-shaped word
problems, so that the embedded tiny model (tiny.py) learns them by RL in minutes; scored
by GSM8K's rewards, which it takes from tasks/gsm8k.py. Its prompts get no system message:
the tiny model learns the answer format in its warm-up, not from instructions, and the
instruction would be half the tokens it trains on."""

import random

from tasks import gsm8k

SYSTEM_PROMPT = None  # no system message (data.load_prompts)
REWARDS, METRICS = gsm8k.REWARDS, gsm8k.METRICS

NAMES = ["Ann", "Bob", "Cat", "Dan", "Eve", "Finn", "Gus", "Ivy"]
THINGS = ["apples", "pens", "cards", "coins", "eggs", "books"]


# b is 1, 2 or 3 and the result a single digit: 48 (a, op, b) facts. b = 0 is left out:
# copying `a` was then right 29% of the time, and RL settled there.
PAIRS = {
    "+": [(a, b) for a in range(10) for b in (1, 2, 3) if a + b <= 9],
    "-": [(a, b) for a in range(10) for b in (1, 2, 3) if b <= a],
}


def synthetic_problem(rng, result=None):
    """One GSM8K-shaped record: a short word problem whose sum or difference is a
    single digit, so a tiny character-level model can learn it by RL in minutes. `result`
    replaces the true result in the answer (the format warm-up uses random ones)."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    op = rng.choice("+-")
    a, b = rng.choice(PAIRS[op])
    return synthetic_fact(a, op, b, name, thing, result)


def synthetic_fact(a, op, b, name="Ann", thing="pens", result=None):
    """The record of one (a, op, b) fact, worded with `name` and `thing`."""
    if op == "+":
        question, true = f"{name} has {a} {thing} and gets {b} more. How many {thing} now?", a + b
    else:
        question, true = f"{name} has {a} {thing} and gives away {b}. How many {thing} now?", a - b
    r = true if result is None else result
    return {"question": question, "answer": f"{a}{op}{b}={r}\n#### {r}"}


def synthetic_dataset(split, n=None):
    """Deterministic records; the test split comes from a different seed."""
    seed, default_n = {"train": (1234, 4096), "test": (98765, 256)}[split]
    rng = random.Random(seed)
    return [synthetic_problem(rng) for _ in range(n or default_n)]


def rows(split):
    """--dataset synthetic: 4096 train records, 256 test ones."""
    return synthetic_dataset(split)
