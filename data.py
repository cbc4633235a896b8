"""Prompts: GSM8K and the embedded synthetic task, chat-template prompts, a
deterministic per-step order, and the tiny embedded model the CPU default trains."""

import json
import os
import random
import re
import shutil
from collections import Counter

SYSTEM_PROMPT = "Solve the problem. End your reply with a line '#### <answer>'."
HUB_GSM8K = "openai/gsm8k"


def parse_gsm8k_answer(text):
    """Gold number from a GSM8K answer ('... #### 1,234' -> '1234'), or None."""
    if not isinstance(text, str) or "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "").strip()
    if not re.fullmatch(r"-?\d+(?:\.\d+)?(?:/\d+)?", tail):
        return None
    return tail


# ---------------------------------------------------------------- the synthetic task

NAMES = ["Ann", "Bob", "Cat", "Dan", "Eve", "Finn", "Gus", "Ivy"]
THINGS = ["apples", "pens", "cards", "coins", "eggs", "books"]


# b is 1, 2 or 3 and the result a single digit: 48 (a, op, b) facts. b = 0 is left out:
# copying `a` was then right 29% of the time, and RL settled there.
PAIRS = {"+": [(a, b) for a in range(10) for b in (1, 2, 3) if a + b <= 9], "-": [(a, b) for a in range(10) for b in (1, 2, 3) if b <= a]}


def synthetic_problem(rng, result=None):
    """One GSM8K-shaped record: a short word problem whose sum or difference is a
    single digit, so a tiny character-level model can learn it by RL in minutes. `result`
    replaces the true result in the answer (the format warm-up uses random ones)."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    op = rng.choice("+-")
    a, b = rng.choice(PAIRS[op])
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


def read_rows(dataset, split):
    """Raw rows: 'synthetic', 'gsm8k' (the hub), or a local .jsonl/.json/.parquet path."""
    if dataset == "synthetic":
        return synthetic_dataset(split)
    if dataset in ("gsm8k", HUB_GSM8K):
        import datasets

        return list(datasets.load_dataset(HUB_GSM8K, "main", split=split))
    if not os.path.exists(dataset):
        raise SystemExit(f"--dataset: no such file or dataset name: {dataset}")
    if dataset.endswith(".jsonl"):
        with open(dataset) as f:
            return [_json_or_none(line) for line in f if line.strip()]
    if dataset.endswith(".json"):
        with open(dataset) as f:
            rows = json.load(f)
        return rows if isinstance(rows, list) else rows.get(split, [])
    if dataset.endswith(".parquet"):
        import datasets

        return list(datasets.load_dataset("parquet", data_files=dataset, split="train"))
    raise SystemExit(f"--dataset: {dataset} is not .jsonl, .json or .parquet")


def _json_or_none(line):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def clean_rows(rows, source):
    """Keep usable rows as {question, gold}; count the rest per cause and say so once."""
    kept, bad = [], Counter()
    for row in rows:
        if not isinstance(row, dict):
            bad["not a JSON object"] += 1
        elif "question" not in row or "answer" not in row:
            bad["missing question or answer field"] += 1
        elif not isinstance(row["question"], str) or not row["question"].strip():
            bad["empty question"] += 1
        elif (gold := parse_gsm8k_answer(row["answer"])) is None:
            bad["answer without a '#### <number>'"] += 1
        else:
            kept.append({"question": row["question"].strip(), "gold": gold})
    if bad:
        print(f"{source}: skipped {sum(bad.values())} bad rows: " + ", ".join(f"{n} {c}" for c, n in bad.items()))
    if not kept:
        if rows and all(isinstance(r, dict) for r in rows):
            missing = {"question", "answer"} - set(rows[0])
            if missing:
                raise SystemExit(f"{source}: no usable rows; field {sorted(missing)[0]!r} is missing")
        raise SystemExit(f"{source}: no usable rows")
    return kept


def build_prompts(records, tokenizer, max_prompt_len, source, system_prompt=SYSTEM_PROMPT):
    """Chat-template token ids per record; over-long prompts are dropped and counted once."""
    out, dropped = [], 0
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for r in records:
        messages = system + [{"role": "user", "content": r["question"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        if len(ids) > max_prompt_len:
            dropped += 1
            continue
        out.append({**r, "prompt_ids": list(ids)})
    if dropped:
        print(f"{source}: dropped {dropped} prompts longer than {max_prompt_len} tokens")
    if not out:
        raise SystemExit(f"{source}: every prompt is longer than --max-prompt-len {max_prompt_len}")
    return out


def load_prompts(dataset, split, tokenizer, max_prompt_len):
    source = f"{dataset} [{split}]"
    # The tiny model learns the answer format in its warm-up, not from instructions,
    # and the system prompt would be half the tokens it trains on.
    system_prompt = None if dataset == "synthetic" else SYSTEM_PROMPT
    return build_prompts(clean_rows(read_rows(dataset, split), source), tokenizer, max_prompt_len, source, system_prompt)


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


# ---------------------------------------------------------------- the tiny embedded model

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TINY_VERSION = 5  # bump when the tokenizer, the task or the warm-up changes
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_model_dir():
    root = os.environ.get("GRPO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "grpo"))
    tag = "-".join(str(v) for v in TINY.values())
    return os.path.join(root, f"tiny-qwen2-{tag}-v{TINY_VERSION}")


def build_tiny_tokenizer():
    """A character-level tokenizer: byte-level BPE with every byte in the vocabulary and
    no merges. It is the Qwen2 tokenizer's own pipeline, so transformers and vLLM,
    which pick the tokenizer class from the model type, load it unchanged."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + alphabet)}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(path, seed=0, warmup_steps=300):
    """A Qwen2 with a character vocabulary, saved where vLLM and transformers both load
    it. From random init it is first taught the answer format on synthetic problems
    whose results are random numbers: it then writes well-formed answers at chance
    accuracy, and GRPO has something to improve (its "pretraining"). Written to a
    temporary folder and renamed, so a crash never leaves half a model behind."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **TINY,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    format_warmup(model, tokenizer, warmup_steps, seed)
    tmp = f"{path}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def format_warmup(model, tokenizer, steps, seed, batch_size=64, lr=3e-3):
    """Supervised training on completions only, with random results in the answers."""
    import torch

    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 30) * (1 - s / steps))
    model.train()
    for _ in range(steps):
        rows = []
        for _ in range(batch_size):
            record = synthetic_problem(rng, result=rng.randint(0, 9))
            prompt = build_prompts([record], tokenizer, 10**6, "warm-up", system_prompt=None)[0]["prompt_ids"]
            completion = tokenizer(record["answer"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
            rows.append((prompt, completion))
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        for i, (p, c) in enumerate(rows):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
        loss = model(input_ids=ids, attention_mask=(labels != -100) | (torch.arange(width) < torch.tensor([len(p) for p, _ in rows])[:, None]), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    model.eval()
