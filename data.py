"""Prompts: any dataset (local files, the hub, the embedded synthetic task), its rows
checked for what the rewards need, chat-template prompts, and a deterministic per-step
order and sharding."""

import json
import os
import random
from collections import Counter

from console import warn
from gsm8k import HUB_DATASET, SYSTEM_PROMPT
from rewards import parse_reward_spec

DEFAULT_REWARDS = "accuracy,format"


# ---------------------------------------------------------------- the synthetic task

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


# ---------------------------------------------------------------- loading and checking rows

FILE_TYPES = (".jsonl", ".json", ".parquet")


def dataset_error(dataset):
    """Why --dataset cannot work, or None: a file name that is not there, or not of a type
    read here. Any other name is taken for a hub dataset, which only loading can check."""
    if dataset in ("synthetic", "gsm8k", HUB_DATASET[0]) or os.path.isdir(dataset):
        return None
    if os.path.isfile(dataset):
        return None if dataset.endswith(FILE_TYPES) else f"{dataset} is not .jsonl, .json or .parquet"
    if dataset.endswith(FILE_TYPES) or dataset.startswith((".", "/", "~")):
        return f"no such file: {dataset}"
    return None


def read_rows(dataset, split):
    """Raw rows: 'synthetic', 'gsm8k' (the hub), a local .jsonl/.json/.parquet path, or
    any other hub dataset (or local dataset folder) by name, through datasets.load_dataset."""
    if dataset == "synthetic":
        return synthetic_dataset(split)
    if (error := dataset_error(dataset)) is not None:
        raise SystemExit(f"--dataset: {error}")
    if dataset.endswith(".jsonl") and os.path.isfile(dataset):
        with open(dataset) as f:
            return [_json_or_none(line) for line in f if line.strip()]
    if dataset.endswith(".json") and os.path.isfile(dataset):
        with open(dataset) as f:
            rows = json.load(f)
        return rows if isinstance(rows, list) else rows.get(split, [])
    import datasets

    if dataset.endswith(".parquet") and os.path.isfile(dataset):
        return list(datasets.load_dataset("parquet", data_files=dataset, split="train"))
    name, config = HUB_DATASET if dataset in ("gsm8k", HUB_DATASET[0]) else (dataset, None)
    try:
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as e:  # not on the hub, no network, no such split: one line, not a traceback
        raise SystemExit(f"--dataset: cannot load {dataset!r} [{split}]: {type(e).__name__}: {e}")


def _json_or_none(line):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def chat(row, prompt_field="question", messages_field="messages"):
    """A row's prompt as chat messages: its messages column when it has one, else its prompt
    field, a string (the user's message) or itself a list of messages. None when unusable."""
    messages = row.get(messages_field)
    if messages is None:
        messages = row.get(prompt_field)
        if isinstance(messages, str):
            return [{"role": "user", "content": messages.strip()}] if messages.strip() else None
    if not isinstance(messages, list) or not messages:
        return None
    if not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        return None
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def clean_rows(rows, source, reward_fns=None, prompt_field="question", messages_field="messages"):
    """Keep the rows that make a prompt and hold what every reward needs (`fn.needs`
    columns, `fn.check`; default rewards: accuracy and format); count the rest per cause
    and say so once."""
    reward_fns = parse_reward_spec(DEFAULT_REWARDS) if reward_fns is None else reward_fns
    kept, bad = [], Counter()
    for row in rows:
        if not isinstance(row, dict):
            bad["not a JSON object"] += 1
        elif row.get(messages_field) is None and row.get(prompt_field) is None:
            bad[f"missing '{prompt_field}' field"] += 1
        elif chat(row, prompt_field, messages_field) is None:
            field = messages_field if row.get(messages_field) is not None else prompt_field
            bad[f"empty or malformed '{field}'"] += 1
        elif cause := _reward_cause(row, reward_fns):
            bad[cause] += 1
        else:
            kept.append(row)
    if bad:
        warn(f"{source}: skipped {sum(bad.values())} bad rows: " + ", ".join(f"{n} {c}" for c, n in bad.items()))
    if not kept:
        if rows and isinstance(rows[0], dict):
            needed = [c for _, fn, _ in reward_fns for c in getattr(fn, "needs", ())]
            missing = [c for c in ([] if messages_field in rows[0] else [prompt_field]) + needed if c not in rows[0]]
            if missing:
                raise SystemExit(f"{source}: no usable rows; field {missing[0]!r} is missing")
        raise SystemExit(f"{source}: no usable rows")
    return kept


def _reward_cause(row, reward_fns):
    """Why a row cannot be scored by the rewards, or None."""
    for name, fn, _ in reward_fns:
        for column in getattr(fn, "needs", ()):
            if row.get(column) is None:
                return f"missing '{column}' field (reward {name})"
        if hasattr(fn, "check") and (cause := fn.check(row)):
            return cause
    return None


def build_prompts(
    records,
    tokenizer,
    max_prompt_len,
    source,
    system_prompt=SYSTEM_PROMPT,
    prompt_field="question",
    messages_field="messages",
    tools=None,
):
    """Each record with its "prompt" (the last user message's text) and chat-template
    "prompt_ids"; the system prompt goes first unless the chat has its own. Over-long
    prompts are dropped and counted once. tools (tools.py's functions): their schemas go
    to the template, or into the system prompt where the template renders none."""
    out, dropped = [], 0
    schemas = None
    if tools:
        from tools import schema, tools_prompt

        schemas = [schema(fn) for fn in tools]
        probe = [{"role": "user", "content": "x"}]
        if tokenizer.apply_chat_template(probe, tools=schemas, tokenize=False) == tokenizer.apply_chat_template(
            probe, tokenize=False
        ):  # a template without tools
            system_prompt, schemas = "\n\n".join(filter(None, [system_prompt, tools_prompt(tools)])), None
    for r in records:
        messages = chat(r, prompt_field, messages_field)
        if system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}] + messages
        ids = tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        if len(ids) > max_prompt_len:
            dropped += 1
            continue
        prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        out.append({**r, "prompt": prompt, "prompt_ids": list(ids), "prompt_messages": messages})
    if dropped:
        warn(f"{source}: dropped {dropped} prompts longer than {max_prompt_len} tokens")
    if not out:
        raise SystemExit(f"{source}: every prompt is longer than --max-prompt-len {max_prompt_len}")
    return out


def load_prompts(
    dataset,
    split,
    tokenizer,
    max_prompt_len,
    reward_fns=None,
    prompt_field="question",
    messages_field="messages",
    tools=None,
):
    """The records to train or evaluate on: every column of each usable row, plus "prompt"
    and "prompt_ids". `reward_fns` (parse_reward_spec's; default accuracy and format)
    decide which rows are usable, and the system prompt: the instruction the first reward
    that declares one scores (`fn.system_prompt`; GSM8K's for its rewards), never for the
    synthetic task."""
    reward_fns = parse_reward_spec(DEFAULT_REWARDS) if reward_fns is None else reward_fns
    source = f"{dataset} [{split}]"
    # The tiny model learns the answer format in its warm-up, not from instructions,
    # and the system prompt would be half the tokens it trains on.
    declared = [fn.system_prompt for _, fn, _ in reward_fns if getattr(fn, "system_prompt", None)]
    system_prompt = declared[0] if declared and dataset != "synthetic" else None
    rows = clean_rows(read_rows(dataset, split), source, reward_fns, prompt_field, messages_field)
    return build_prompts(rows, tokenizer, max_prompt_len, source, system_prompt, prompt_field, messages_field, tools)


# ---------------------------------------------------------------- deterministic order


def step_indices(n_records, step, prompts_per_step, seed):
    """Record indices of one step's batch: a function of (seed, step) alone, so a resumed
    run sees what an uninterrupted one would. Each epoch is a fresh permutation."""
    perms, out = {}, []
    start = step * prompts_per_step
    for pos in range(start, start + prompts_per_step):
        epoch, i = divmod(pos, n_records)
        if epoch not in perms:
            perms[epoch] = list(range(n_records))
            random.Random(seed * 1_000_003 + epoch).shuffle(perms[epoch])
        out.append(perms[epoch][i])
    return out


def shard(items, rank, world):
    """Contiguous shard `rank` of `world`; len(items) must divide evenly."""
    per = len(items) // world
    return items[rank * per : (rank + 1) * per]
