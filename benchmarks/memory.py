"""Learner memory and step time with dense and chunked log-probs, in one run.

Each mode runs in a process of its own, so that their peaks are separate: one learner
(FSDP2 over a world of 1) takes --steps GRPO steps (grpo.train_step, KL to a reference
included) on one micro-batch of --tokens positions. It prints, for each mode, the peak
learner memory (resident set on CPU, max_memory_allocated on a GPU), the step time
(median after the first step), then their ratios, and the largest difference between
the two modes' log-probs and their first steps' grad norms, and the start-up estimate
(metrics.estimate_learner_memory) beside each peak.

    python benchmarks/memory.py                       # CPU: random Qwen2, 152k vocab
    python benchmarks/memory.py --model Qwen/Qwen2.5-1.5B-Instruct --dtype bfloat16

Without --model it builds a random-init Qwen2 with the tiny tokenizer and a
--vocab-size embedding (vLLM and transformers both accept a vocabulary larger than the
tokenizer's). Targets: chunked peak at most 30% of dense at 152k and 4096 tokens, step
time within 10% of dense, log-prob difference below 1e-6 (float32).
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF folder or hub name; empty: a random Qwen2 built here")
    p.add_argument("--vocab-size", type=int, default=152064)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096, help="positions in the one micro-batch")
    p.add_argument("--seq-len", type=int, default=512, help="each sequence's length; tokens // seq-len sequences")
    p.add_argument("--chunk", type=int, default=1024, help="--logprob-chunk of the chunked mode")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="learner compute dtype")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--beta", type=float, default=0.04, help="KL weight; 0: no reference model")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--path", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_model(path, vocab_size, hidden_size, layers):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    heads = max(2, hidden_size // 32)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def rollouts(vocab, tokens, seq_len, seed=0):
    """tokens // seq_len sequences of seq_len (prompt + completion) positions, one group."""
    from grpo import Rollout

    rng = random.Random(seed)
    n = max(2, tokens // seq_len)
    prompt = [rng.randrange(3, vocab) for _ in range(min(64, seq_len // 4))]
    out = []
    for i in range(n):
        m = seq_len - len(prompt)
        out.append(
            Rollout(
                prompt_ids=prompt,
                token_ids=[rng.randrange(3, vocab) for _ in range(m)],
                sampler_logprobs=[rng.uniform(-12.0, -9.0) for _ in range(m)],
                text="",
                truncated=False,
                reward=float(i % 2),
            )
        )
    return out


def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def worker(args):
    """One mode, one process: the learner, --steps steps, then the figures as one JSON line."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import metrics
    from comm import free_port
    from config import Config
    from grpo import train_step
    from learner import Learner

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    mesh = init_device_mesh(device.type, (1,))
    baseline = rss_mb()
    chunk = args.chunk if args.worker == "chunked" else 0
    dtype = getattr(torch, args.dtype)
    learner = Learner(
        args.path,
        mesh,
        device,
        lr=1e-5,
        gradient_checkpointing=args.gradient_checkpointing,
        reference=args.beta > 0,
        compute_dtype=dtype,
        logprob_chunk=chunk,
    )
    config = learner.model.config
    vocab = config.get_text_config().vocab_size
    batch = rollouts(vocab, args.tokens, args.seq_len)
    G = len(batch)
    cfg = Config(
        learners=1,
        prompts_per_step=1,
        group_size=G,
        max_new_tokens=args.seq_len,
        max_prompt_len=args.seq_len,
        temperature=args.temperature,
        beta=args.beta,
        epsilon_high=0.2,
        max_tokens_per_microbatch=args.tokens,
        micro_batch_size=G,
    )
    estimate = metrics.estimate_learner_memory(
        learner.model,
        learners=1,
        tokens=args.tokens,
        device=device,
        compute_dtype=dtype,
        reference=args.beta > 0,
        logprob_chunk=chunk,
        gradient_checkpointing=args.gradient_checkpointing,
        seq_len=args.seq_len,
    )

    def logprobs():
        ids, attention, *_ = learner.collate(batch)
        with torch.no_grad():
            return learner.token_logprobs(learner.model, ids, attention, args.temperature)[0].float().cpu()

    before = logprobs()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, cpu_times, norms = [], [], []
    for _ in range(args.steps):
        t, c = time.perf_counter(), time.process_time()
        norms.append(train_step(cfg, learner, copy.deepcopy(batch), 0)[-1])
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        cpu_times.append(time.process_time() - c)
    peak = metrics.peak_memory_mb(device)
    torch.save({"logp": before}, args.out + ".pt")
    row = {
        "mode": args.worker,
        "grad_norm": norms[0],
        "peak_mb": peak,
        "baseline_mb": 0.0 if cuda else baseline,
        "step_s": statistics.median(times[1:] or times),
        "times": times,
        "cpu_s": statistics.median(cpu_times[1:] or cpu_times),
        "estimate_mb": estimate["total"] / 2**20,
        "estimate": {k: v / 2**20 for k, v in estimate.items()},
    }
    with open(args.out + ".json", "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args)
    import torch

    tmp = tempfile.mkdtemp(prefix="grpo-memory-")
    path = args.model
    if not path:
        path = os.path.join(tmp, "model")
        build_model(path, args.vocab_size, args.hidden_size, args.layers)
    print(
        f"model {args.model or f'random Qwen2 {args.hidden_size} wide, {args.layers} layers, vocab {args.vocab_size}'}; {args.tokens} positions per micro-batch ({args.tokens // args.seq_len} x {args.seq_len}); dtype {args.dtype}; chunk {args.chunk}; beta {args.beta}; {args.steps} steps"
    )
    rows = {}
    forwarded = [a for a in (sys.argv[1:] if argv is None else argv)]
    for mode in ("dense", "chunked"):
        out = os.path.join(tmp, mode)
        cmd = [sys.executable, os.path.abspath(__file__), *forwarded, "--worker", mode, "--path", path, "--out", out]
        result = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            print(result.stdout[-4000:])
            sys.exit(f"the {mode} worker failed with exit code {result.returncode}")
        rows[mode] = json.load(open(out + ".json"))
        rows[mode].update(torch.load(out + ".pt"))
    unit = "RSS" if rows["dense"]["baseline_mb"] else "max_memory_allocated"
    for mode, r in rows.items():
        above = (
            f", {r['peak_mb'] - r['baseline_mb']:.0f} MB above the {r['baseline_mb']:.0f} MB before the learner"
            if r["baseline_mb"]
            else ""
        )
        print(
            f"{mode:8s} peak {r['peak_mb']:.0f} MB ({unit}){above}; estimate {r['estimate_mb']:.0f} MB; step {r['step_s']:.2f} s (steps {', '.join(f'{t:.2f}' for t in r['times'])}; CPU time {r['cpu_s']:.2f} s)"
        )
    d, c = rows["dense"], rows["chunked"]
    ratio = c["peak_mb"] / d["peak_mb"]
    above = (c["peak_mb"] - c["baseline_mb"]) / max(1.0, d["peak_mb"] - d["baseline_mb"])
    time_ratio = c["step_s"] / d["step_s"]
    cpu_ratio = c["cpu_s"] / d["cpu_s"]
    diff = (d["logp"] - c["logp"]).abs().max().item()
    norm_diff = abs(d["grad_norm"] - c["grad_norm"]) / max(1e-30, abs(d["grad_norm"]))
    print(
        f"chunked / dense: peak {ratio:.3f} (above baseline {above:.3f}; target <= 0.30), step time {time_ratio:.3f} (target <= 1.10; CPU time of the process {cpu_ratio:.3f})"
    )
    print(
        f"largest log-prob difference {diff:.2e} (target < 1e-6); first step's grad norm {d['grad_norm']:.6g} dense, {c['grad_norm']:.6g} chunked (relative difference {norm_diff:.1e})"
    )


if __name__ == "__main__":
    main()
