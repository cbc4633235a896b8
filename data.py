"""Prompts: any dataset (a task's by its name, tasks/; local files; the hub), its rows
checked for what the rewards need, chat-template prompts, and a deterministic per-step
order and sharding."""

import json
import os
import random
from collections import Counter

import tasks
from console import warn
from rewards import parse_reward_spec

DEFAULT_REWARDS = "accuracy,format"


# ---------------------------------------------------------------- loading and checking rows

FILE_TYPES = (".jsonl", ".json", ".parquet")


def dataset_error(dataset):
    """Why --dataset cannot work, or None: a task without a dataset or whose file fails to
    load, a file name that is not there, or not of a type read here. Any other name is
    taken for a hub dataset, which only loading can check."""
    try:
        task = tasks.load(dataset)
    except ValueError as e:
        return str(e)
    if task is not None:
        return None if hasattr(task, "rows") or hasattr(task, "HUB_DATASET") else f"task {dataset!r} has no dataset"
    if os.path.isdir(dataset):
        return None
    if os.path.isfile(dataset):
        return None if dataset.endswith(FILE_TYPES) else f"{dataset} is not .jsonl, .json or .parquet"
    if dataset.endswith(FILE_TYPES) or dataset.startswith((".", "/", "~")):
        return f"no such file: {dataset}"
    return None


def read_rows(dataset, split):
    """Raw rows: a task's by its name (its rows(split), or its HUB_DATASET), a local
    .jsonl/.json/.parquet path, or any other hub dataset (or local dataset folder) by name,
    through datasets.load_dataset."""
    if (error := dataset_error(dataset)) is not None:
        raise SystemExit(f"--dataset: {error}")
    task = tasks.load(dataset)
    if task is not None and hasattr(task, "rows"):
        return task.rows(split)
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
    name, config = tasks.hub_dataset(dataset) or (dataset, None)
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
    system_prompt=None,
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
    that declares one scores (`fn.system_prompt`), never where the dataset is a task that
    sets its SYSTEM_PROMPT to None (the synthetic task's)."""
    reward_fns = parse_reward_spec(DEFAULT_REWARDS) if reward_fns is None else reward_fns
    source = f"{dataset} [{split}]"
    declared = [fn.system_prompt for _, fn, _ in reward_fns if getattr(fn, "system_prompt", None)]
    task = tasks.load(dataset)
    unprompted = task is not None and hasattr(task, "SYSTEM_PROMPT") and task.SYSTEM_PROMPT is None
    system_prompt = declared[0] if declared and not unprompted else None
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
