"""The sampler/learner mismatch of a real pretrained model in each precision, side by side:
SmolLM2-135M-Instruct (tests/plugins/smollm2.py) on GSM8K test prompts, on-policy.

    python benchmarks/mismatch.py [--prompts 16] [--samples 4] [--max-new-tokens 128]

For each of float16, bfloat16 and float32: the project's vLLM engine (sampler.Sampler)
samples the completions with their log-probs, and the learner's own log-prob function
(logprobs.token_logprobs, the chunked head, the attention the learner picks) scores the
same tokens with the same weights in the same dtype. Printed: |log p_learner - log
p_sampler| per token, mean and max, with the output projection in the model's dtype, in
float32 on the learner only, and in float32 on both sides (vLLM's head_dtype override);
and the seconds each side took. Each engine runs in a process of its own."""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "plugins"))


def learner_logprobs(model, completions, head_float32):
    """The learner's log-probs of each completion's tokens (one sequence at a time)."""
    import torch

    from logprobs import ChunkedTokenLogprobs, attention_kernel, final_hidden, token_logprobs

    out = []
    for c in completions:
        ids = torch.tensor([c["prompt_ids"] + c["token_ids"]])
        attention = torch.ones_like(ids)
        model.config._attn_implementation = attention_kernel("cpu", model.dtype, ids.shape[1], "sdpa")
        with torch.no_grad():
            if head_float32:
                hidden, head = final_hidden(model, ids, attention)
                flat = hidden[0, :-1].float()  # [T-1, H]
                logp, _ = ChunkedTokenLogprobs.apply(flat, head.weight.float(), None, ids[0, 1:], 1.0, 1024, False)
            else:
                logp = token_logprobs(model, ids, attention, 1.0, 1024, entropy=False)[0][0]
        p = len(c["prompt_ids"])
        out.append(logp[p - 1 :].tolist())
    return out


def one(args):
    """One engine: sample, then score on the learner's side; prints a JSON line."""
    import torch
    from transformers import AutoModelForCausalLM

    from data import load_prompts
    from job import load_tokenizer
    from rewards import parse_reward_spec
    from sampler import Sampler
    from smollm2 import smollm2_dir

    path = smollm2_dir()
    tokenizer = load_tokenizer(path)
    prompts = load_prompts(
        os.path.join(ROOT, "tests", "gsm8k", "test.jsonl"), "test", tokenizer, 256, parse_reward_spec("accuracy")
    )[: args.prompts]
    engine = Sampler(path, 256 + args.max_new_tokens, 0, args.dtype, kv_cache_gb=1.0, head_dtype=args.engine_head)
    t0 = time.time()
    completions = engine.sample([p["prompt_ids"] for p in prompts], args.samples, args.max_new_tokens, 1.0, (0, "m"))
    sample_s = time.time() - t0
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    heads = [True] if args.engine_head else [False] if args.dtype == "float32" else [False, True]
    for head_float32 in heads:
        t0 = time.time()
        learner = learner_logprobs(model, completions, head_float32)
        score_s = time.time() - t0
        diffs = [abs(a - b) for c, lp in zip(completions, learner) for a, b in zip(lp, c["sampler_logprobs"])]
        head = "both" if args.engine_head else ("learner" if head_float32 else "none")
        row = {"dtype": args.dtype, "float32_head": head, "tokens": len(diffs), "mean": sum(diffs) / len(diffs)}
        row.update(max=max(diffs), sample_s=sample_s, learner_s=score_s)
        print("ROW " + json.dumps(row), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)  # set: one engine, in this process
    parser.add_argument("--engine-head", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dtype:
        return one(args)
    rows = []
    for dtype in ("float16", "bfloat16", "float32"):
        for engine_head in [None, "float32"] if dtype != "float32" else [None]:
            cmd = [sys.executable, __file__, "--dtype", dtype, "--prompts", str(args.prompts)]
            cmd += ["--samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens)]
            cmd += ["--engine-head", engine_head] if engine_head else []
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            result = subprocess.run(cmd, capture_output=True, text=True, env=env)
            found = [json.loads(line[4:]) for line in result.stdout.splitlines() if line.startswith("ROW ")]
            if result.returncode or not found:
                print(f"{dtype} (engine head {engine_head}) failed:\n{result.stderr[-3000:]}")
                continue
            rows += found
            for r in found:
                print(
                    f"{r['dtype']:>9}  float32 head: {r['float32_head']:<7}  mismatch mean {r['mean']:.5f}  max {r['max']:.4f}"
                    f"  ({r['tokens']} tokens; sampling {r['sample_s']:.1f} s, learner {r['learner_s']:.1f} s)",
                    flush=True,
                )
    return rows


if __name__ == "__main__":
    main()
