"""The embedded tiny model the CPU default trains: a Qwen2 with a character-level
tokenizer, built once per machine, and its supervised format warm-up (its
"pretraining"), so that GRPO starts from well-formed answers at chance accuracy."""

import os
import random
import shutil
import time

from data import build_prompts
from tasks.synthetic import synthetic_problem

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


def model_path(model, local_rank):
    """The folder of --model; the tiny model is built once per machine, by local rank 0,
    while the other ranks wait for it."""
    if model != "tiny":
        return model
    path = tiny_model_dir()
    if not os.path.exists(path):
        if local_rank == 0:
            build_tiny_model(path)
        while not os.path.exists(path):
            time.sleep(0.2)
    return path


def build_tiny_tokenizer():
    """A character-level tokenizer: byte-level BPE with every byte in the vocabulary and
    no merges. It is the Qwen2 tokenizer's own pipeline, so transformers and vLLM,
    which pick the tokenizer class from the model type, load it unchanged."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + alphabet)}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(path, seed=0, warmup_steps=300, progress=True):
    """A Qwen2 with a character vocabulary, saved where vLLM and transformers both load
    it. From random init it is first taught the answer format on synthetic problems
    whose results are random numbers: it then writes well-formed answers at chance
    accuracy, and GRPO has something to improve (its "pretraining"). Written to a
    temporary folder and renamed, so a crash never leaves half a model behind.
    `progress`: say so on the console, with a bar over the warm-up."""
    import torch
    from tqdm import tqdm
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    import console

    if progress:
        console.say(
            f"first run: building the tiny model into {path}, with its {warmup_steps}-step format warm-up (about 100 s on 2 cores, once)"
        )

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
    with tqdm(
        total=warmup_steps,
        desc="tiny model warm-up",
        file=console.stream(),
        disable=not progress,
        bar_format=console.BAR,
    ) as bar:
        format_warmup(
            model,
            tokenizer,
            warmup_steps,
            seed,
            on_step=lambda loss: (bar.update(), bar.set_postfix_str(f"loss {loss:.3f}")),
        )
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


def format_warmup(model, tokenizer, steps, seed, batch_size=64, lr=3e-3, on_step=None):
    """Supervised training on completions only, with random results in the answers;
    on_step(loss) after each step."""

    def row(rng):
        record = synthetic_problem(rng, result=rng.randint(0, 9))
        prompt = build_prompts([record], tokenizer, 10**6, "warm-up", system_prompt=None)[0]["prompt_ids"]
        completion = tokenizer(record["answer"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        return prompt + completion, [0] * len(prompt) + [1] * len(completion)

    supervised(model, row, steps, seed, batch_size, lr, tokenizer.pad_token_id, on_step)


def supervised(model, make_row, steps, seed, batch_size, lr, pad_id, on_step=None):
    """A warm-up: `steps` AdamW steps of next-token loss on batches of make_row(rng) ->
    (ids, learn), averaged over the tokens where learn is 1; on_step(loss) after each."""
    import torch

    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 30) * (1 - s / steps))
    model.train()
    for _ in range(steps):
        rows = [make_row(rng) for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((batch_size, width), pad_id)  # [B, T]
        labels = torch.full((batch_size, width), -100)  # [B, T]: -100 is no loss
        for i, (row, learn) in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            labels[i, : len(row)] = torch.tensor([t if m else -100 for t, m in zip(row, learn)])
        attention = torch.arange(width) < torch.tensor([len(row) for row, _ in rows])[:, None]
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if on_step:
            on_step(loss.item())
    model.eval()
