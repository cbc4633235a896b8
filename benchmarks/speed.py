"""Speed of the default configuration, as ratios measured in one run of this script
(these machines are noisy, so compare ratios, not seconds):

  - step time with --max-staleness 0 and 1, and the ratio of the latter to
    max(sample, train), the best a one-step pipeline can do;
  - seconds per phase, the padded fraction of trained tokens with and without
    packing by token budget;
  - weight-sync time against one in-memory copy of the same bytes;
  - the sampler wrapper's tokens/s against a bare vllm.LLM.generate of the same
    requests in the same process;
  - sampled and trained tokens/s, and peak memory per role.

    python benchmarks/speed.py [--steps 30] [--model PATH_OR_HUB_NAME] [other grpo.py flags]
    python benchmarks/speed.py --precision [--steps 6]

Without --model it runs the tiny CPU default (or the GPU default on a GPU machine).
--precision compares bf16 with float32 on a random-init 22.8M Qwen2 (512 dims x 8 layers,
the tiny tokenizer) at 16 prompts x 8 x 128 new tokens: step, train and sample time, in
the same run, for 2 learners + 1 sampler and for 1 + 1.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SKIP = 3  # first steps left out of the medians: engine and allocator warm-up


def run(out, args):
    cmd = ["bash", "launch.sh", "--out-dir", out, "--eval-every", "0", "--samples-every", "0", *args]
    result = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        print(result.stdout[-4000:])
        sys.exit(f"{' '.join(cmd)} failed with exit code {result.returncode}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in rows if "loss" in r][SKIP:]


def median(rows, key):
    return statistics.median(r[key] for r in rows)


def sampler_against_bare_vllm(grpo_args, repeats=5):
    """Tokens/s of Sampler.sample and of LLM.generate on one step's requests, interleaved."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from comm import visible_gpus
    from config import cpu_has_bf16, parse_config, resolve
    from data import load_prompts
    from job import model_path
    from sampler import Sampler

    cfg = resolve(parse_config([*grpo_args, "--overwrite"]), 2, bool(visible_gpus()), cpu_has_bf16())
    engine = Sampler(
        model_path(cfg, 0),
        cfg.max_prompt_len + cfg.max_new_tokens,
        cfg.seed,
        cfg.dtype,
        cfg.sampler_gpu_memory or 0.3,
        cfg.sampler_kv_cache_gb,
    )
    prompts = [
        p["prompt_ids"]
        for p in load_prompts(cfg.dataset, cfg.split, engine.llm.get_tokenizer(), cfg.max_prompt_len)[
            : cfg.prompts_per_step
        ]
    ]
    G, max_tokens = cfg.group_size, cfg.max_new_tokens
    params = SamplingParams(n=G, max_tokens=max_tokens, temperature=cfg.temperature, logprobs=0)
    wrapped, bare = [], []
    for i in range(repeats + 1):
        t = time.perf_counter()
        tokens = sum(len(c["token_ids"]) for c in engine.sample(prompts, G, max_tokens, cfg.temperature, key=(i,)))
        wrapped.append(tokens / (time.perf_counter() - t))
        t = time.perf_counter()
        outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        bare.append(tokens / (time.perf_counter() - t))
    return statistics.median(wrapped[1:]), statistics.median(bare[1:])


def build_mid_model(path):
    """The 22.8M random-init Qwen2 of the precision comparison, with the tiny tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import tiny

    tokenizer = tiny.build_tiny_tokenizer()
    shape = dict(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2
    )
    config = Qwen2Config(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **shape
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def precision_comparison(steps, extra):
    """bf16 against float32, and 2 learners + 1 sampler against 1 + 1, in one run."""
    global SKIP
    SKIP = 1
    with tempfile.TemporaryDirectory() as tmp:
        model = build_mid_model(os.path.join(tmp, "mid"))
        shapes = [
            "--model",
            model,
            "--dataset",
            "synthetic",
            "--prompts-per-step",
            "16",
            "--group-size",
            "8",
            "--max-new-tokens",
            "128",
        ]
        shapes += ["--steps", str(steps), "--beta", "0", *extra]
        results = {}
        for dtype in ("float32", "bfloat16"):
            for nproc, learners in ((3, 2), (2, 1)):
                os.environ.update(NPROC=str(nproc), LEARNERS=str(learners))
                rows = run(os.path.join(tmp, f"{dtype}-{nproc}"), [*shapes, "--dtype", dtype])
                results[dtype, learners] = {k: median(rows, k) for k in ("step_s", "train_s", "sample_s")}
                print(
                    f"{dtype:9s} {learners} learner(s) + 1 sampler: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in results[dtype, learners].items()),
                    flush=True,
                )
    for learners in (2, 1):
        f32, b16 = results["float32", learners], results["bfloat16", learners]
        print(
            f"{learners}+1: bf16 speed-up: train {f32['train_s'] / b16['train_s']:.2f}x, sample {f32['sample_s'] / b16['sample_s']:.2f}x, step {f32['step_s'] / b16['step_s']:.2f}x"
        )
    best = min((2, 1), key=lambda n: results["bfloat16", n]["step_s"])
    print(
        f"SUMMARY bf16 train speed-up (2+1) {results['float32', 2]['train_s'] / results['bfloat16', 2]['train_s']:.2f}x (target >= 2.5) | faster bf16 layout: {best}+1"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", default="")
    parser.add_argument("--precision", action="store_true")
    args, extra = parser.parse_known_args()
    if args.precision:
        return precision_comparison(min(args.steps, 6), extra)
    common = ["--steps", str(args.steps), *(["--model", args.model] if args.model else []), *extra]
    with tempfile.TemporaryDirectory() as tmp:
        sync = run(os.path.join(tmp, "s0"), [*common, "--max-staleness", "0"])
        ahead = run(os.path.join(tmp, "s1"), [*common, "--max-staleness", "1"])
        unpacked = run(
            os.path.join(tmp, "fixed"), [*common, "--max-staleness", "1", "--max-tokens-per-microbatch", "0"]
        )
    step0, step1 = median(sync, "step_s"), median(ahead, "step_s")
    sample, train = median(ahead, "sample_s"), median(ahead, "train_s")
    print(f"step time: S=0 {step0:.3f} s, S=1 {step1:.3f} s, ratio S=1/S=0 {step1 / step0:.2f}")
    for name, rows in (("S=0", sync), ("S=1", ahead)):
        phases = ", ".join(
            f"{k[:-2]} {median(rows, k):.3f}" for k in ("sync_s", "sample_s", "reward_s", "wait_s", "train_s")
        )
        print(f"phases {name} (s, medians): {phases}")
    print(
        f"S=1 step / max(sample {sample:.3f}, train {train:.3f}) = {step1 / max(sample, train):.2f}  (target <= 1.15)"
    )
    padded, padded_fixed = median(ahead, "padded_frac"), median(unpacked, "padded_frac")
    print(
        f"padded fraction of trained tokens: packed {padded:.3f}, --micro-batch-size sequences {padded_fixed:.3f}  (target < 0.10)"
    )
    sync_s, memcpy_s = median(ahead, "sync_s"), median(ahead, "sync_memcpy_s")
    print(
        f"weight sync {sync_s * 1e3:.1f} ms, memcpy of the same bytes {memcpy_s * 1e3:.2f} ms, ratio {sync_s / memcpy_s:.1f}  (target <= 3)"
    )
    sampled = sum(r["tokens_sampled"] for r in ahead) / sum(r["sample_s"] for r in ahead)
    trained = sum(r["tokens_trained"] for r in ahead) / sum(r["train_s"] for r in ahead)
    print(
        f"tokens/s: sampled {sampled:.0f}, trained {trained:.0f}; end-to-end sampled tokens per step-second {sum(r['tokens_sampled'] for r in ahead) / sum(r['step_s'] for r in ahead):.0f}"
    )
    print(
        f"peak memory (MB): learner {max(r['peak_memory_mb_learner'] for r in ahead):.0f}, sampler {max(r['peak_memory_mb_sampler'] for r in ahead):.0f}"
    )
    wrapped, bare = sampler_against_bare_vllm(common)
    print(
        f"sampler {wrapped:.0f} tokens/s, bare vLLM {bare:.0f} tokens/s, ratio {wrapped / bare:.3f}  (target >= 0.95)"
    )
    print(
        f"SUMMARY S1/S0 {step1 / step0:.2f} | S1/max(sample,train) {step1 / max(sample, train):.2f} | padded {padded:.3f} (fixed {padded_fixed:.3f})"
        f" | sync/memcpy {sync_s / memcpy_s:.1f} | sampler/bare {wrapped / bare:.3f}"
    )


if __name__ == "__main__":
    main()
