"""The whole loop on a real pretrained model, SmolLM2-135M-Instruct (tests/plugins/smollm2.py): a
byte-level BPE tokenizer with merges, a ChatML template with its own system prompt and an
end-of-turn special token, tied embeddings in a Llama, 30 layers. The tiny model checks the
algorithm; this one checks the machinery where real checkpoints break it."""

import json
import os
import types

import pytest
import torch

from conftest import GSM8K, rows, torchrun, transformers_vs_vllm

# Two ranks (a learner and a sampler), GSM8K rows, two short steps on-policy; the brevity
# reward differs within every group, so each step moves the weights (lr 1e-5, no warm-up),
# and a sync that failed to land would show at step 1.
RUN = "--learners 1 --steps 2 --prompts-per-step 4 --group-size 2 --max-new-tokens 24 --max-prompt-len 384".split()
RUN += "--lr 1e-5 --warmup-steps 0 --beta 0 --eval-every 0 --samples-every 1 --max-staleness 0".split()
RUN += ["--rewards", "accuracy,format,tests.plugins.task_rewards:brevity"]
# Short yes/no questions beside GSM8K's: the model ends them with its end-of-turn token
# well inside the budget, so the samples hold completions that end with it.
YES_NO = [{"question": f"Is {a} + {a} = {2 * a}? Reply with one word, yes or no.", "answer": "#### 1"} for a in (2, 3)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    with open(os.path.join(GSM8K, "test.jsonl")) as f:
        gsm8k = [json.loads(line) for line in f][:6]
    path = tmp_path_factory.mktemp("real") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in gsm8k + YES_NO))
    return str(path)


def run(smollm2, dataset, out, *flags):
    result = torchrun(2, "--model", smollm2, "--dataset", dataset, *RUN, *flags, "--out-dir", out, timeout=900)
    assert result.returncode == 0, result.stdout[-5000:]
    return [r for r in rows(out) if "loss" in r]


@pytest.fixture(scope="module")
def float32_run(smollm2, dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("real_f32") / "run"
    return out, run(smollm2, dataset, out, "--dtype", "float32")


def test_float32_sampler_equals_learner_after_each_sync(float32_run):
    out, metrics = float32_run
    assert [r["step"] for r in metrics] == [0, 1]
    print("float32 mismatch mean/max per step:", [(r["mismatch_mean"], r["mismatch_max"]) for r in metrics])
    for r in metrics:
        assert r["grad_norm"] > 0 and r["tokens_trained"] > 0
        # Float32 forwards of the same weights by two kernels' sums: on an AMX Xeon the mean
        # gap 8e-6-9e-6 and the max 2e-5-5e-5 (seeds 0-2); a CI processor once reached
        # 1.6e-3 on one token of its 192 (why that processor's sums part further is not
        # pinned down). A sampler that kept the old weights at step 1: mean 0.028, max 0.52.
        assert r["mismatch_mean"] < 1e-4 and r["mismatch_max"] < 1e-2, (r["mismatch_mean"], r["mismatch_max"])


def test_bf16_sampler_and_learner_stay_within_bf16s_precision(smollm2, dataset, tmp_path):
    """bf16 keeps 8 bits of mantissa: each product and sum is rounded at a relative 2^-9,
    and over 30 layers a logit of size ~20 carries an error of a few hundredths on each
    side, as learner and sampler round differently (transformers alone: each side is 0.030
    from float32 on average). So the mean gap of the two sides' log-probs is a few
    hundredths and single tokens, whose logits sit near another's, reach a few tenths:
    measured 0.040 mean and 0.37-0.47 max per step. The bounds are below one bf16 ulp of
    such a logit (0.125) for the mean and 1.5 nats for any token; a sync that failed or a
    head left in float32 on one side only would show as a mean far above the first."""
    metrics = run(smollm2, dataset, tmp_path / "run", "--dtype", "bfloat16")
    print("bf16 mismatch mean/max per step:", [(r["mismatch_mean"], r["mismatch_max"]) for r in metrics])
    assert [r["step"] for r in metrics] == [0, 1]
    for r in metrics:
        assert r["mismatch_mean"] < 0.1 and r["mismatch_max"] < 1.5, r


def test_prompt_ids_are_the_templates_rendering_and_the_end_of_turn_token_is_trained(smollm2, dataset, float32_run):
    """The ids the learner trained on, from samples.jsonl: each prompt is the chat
    template's own rendering of its row, the GSM8K instruction as the system message,
    tokenized once with its special tokens; a completion that ended its turn keeps the
    end-of-turn token in its ids and in the loss mask."""
    from transformers import AutoTokenizer

    from grpo import Rollout
    from learner import Learner
    from tasks.gsm8k import SYSTEM_PROMPT

    out, _ = float32_run
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == eot and tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    with open(dataset) as f:
        rendered = {}
        for r in map(json.loads, f):
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": r["question"]}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            rendered[text] = tokenizer(text, add_special_tokens=False)["input_ids"]
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert len(samples) == 8  # two whole groups of each step (metrics.sample_indices)
    for s in samples:
        text = tokenizer.decode(s["prompt_ids"])
        assert text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n")
        assert s["prompt_ids"] == rendered[text]  # KeyError: a prompt that no row renders to
        assert s["prompt_ids"].count(1) == 3 and s["prompt_ids"][-4:] == tokenizer.encode("<|im_start|>assistant\n")
    ended = [s for s in samples if not s["truncated"]]
    assert ended, "no completion ended its turn inside the budget"
    for s in ended:
        assert s["token_ids"][-1] == eot and eot not in s["token_ids"][:-1]
        assert tokenizer.decode(s["token_ids"], skip_special_tokens=True) == s["text"]
        learner = types.SimpleNamespace(pad_id=tokenizer.pad_token_id, device=torch.device("cpu"))
        rollout = Rollout(s["prompt_ids"], s["token_ids"], [0.0] * len(s["token_ids"]), s["text"], False)
        ids, _, mask, _, _ = Learner.collate(learner, [rollout])
        trained = ids[0, 1:][mask[0] > 0].tolist()  # the targets that carry loss
        assert trained == s["token_ids"] and trained[-1] == eot


def test_a_checkpoint_saves_and_loads_in_transformers_and_vllm(smollm2, float32_run):
    """The run's final folder: one tied matrix in the file, and the same weights whether
    transformers or vLLM loads them (vLLM's greedy log-probs against a transformers forward)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out, _ = float32_run
    final = out / "final"
    with safe_open(final / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied: stored once
    trained = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert trained.lm_head.weight.data_ptr() == trained.model.embed_tokens.weight.data_ptr()
    moved = max((a - b).abs().max().item() for a, b in zip(trained.parameters(), base.parameters()))
    assert moved > 1e-6  # the final folder holds the trained weights, not the start's
    gap = transformers_vs_vllm(
        final, "<|im_start|>user\nIs 2 + 2 = 4?<|im_end|>\n<|im_start|>assistant\nYes.<|im_end|>"
    )
    print(f"trained SmolLM2 log-probs, transformers vs vLLM: max abs diff {gap:.2e}")
    assert gap < 1e-4
