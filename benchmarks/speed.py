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

    python benchmarks/speed.py [--steps 30] [--model PATH_OR_HUB_NAME] [other job.py flags]
    python benchmarks/speed.py --precision [--steps 6]
    python benchmarks/speed.py --limit [--steps 10] [--learners 2]

Without --model it runs the tiny CPU default (or the GPU default on a GPU machine).
--precision compares bf16 with float32 on a random-init 22.8M Qwen2 (512 dims x 8 layers,
the tiny tokenizer) at 16 prompts x 8 x 128 new tokens: step, train and sample time, in
the same run, for 2 learners + 1 sampler and for 1 + 1.
--limit measures the learner against the machine on that 22.8M model in the run's compute
dtype: the FLOP/s the model's own matrix shapes reach on these cores (FLOP-weighted over
the forward and both backward products of every Linear, 4096 rows), what one learner alone
reaches on one thread, eager and with --compile, and where its time goes (forward,
backward, optimizer; matmuls, attention, compiled kernels, other ops, and time outside ops,
from torch's profiler), the train phase of real runs (2 learners + 1 sampler eager and
compiled, 1 + 1 compiled; or --learners N both ways) as a fraction of the same cores' rate,
where each step's core-seconds went (the learners', the sampler's, idle: from /proc) and the
train phase against the share of the cores the sampler leaves, and the sampler's tokens/s
against a bare vllm.LLM.generate of the same requests.
Trained FLOPs: 6 x parameters x padded positions, plus attention's 12 x layers x hidden x
width per position (the full square, as the kernels compute it).
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
    """launch.sh with these flags: its metric rows after the first SKIP, each with
    cpu_by_rank, the CPU-seconds each rank's processes (vLLM's children included) spent
    since the row before, read from /proc as the rows appear (Linux; {} elsewhere)."""
    cmd = ["bash", "launch.sh", "--out-dir", out, "--eval-every", "0", "--samples-every", "0", *args]
    metrics, cpu_at_row = os.path.join(out, "metrics.jsonl"), []
    with open(out + ".log", "w") as log:
        job = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        while job.poll() is None:
            written = 0
            if os.path.exists(metrics):
                with open(metrics) as f:
                    written = sum(1 for _ in f)
            if written < len(cpu_at_row):  # a stale file that --overwrite then removed
                cpu_at_row.clear()
            while len(cpu_at_row) < written:
                cpu_at_row.append(cpu_seconds_by_rank(job.pid))
            time.sleep(0.1)
    if job.returncode != 0:
        print(open(out + ".log").read()[-4000:])
        sys.exit(f"{' '.join(cmd)} failed with exit code {job.returncode}")
    rows = [json.loads(line) for line in open(metrics)]
    for i, row in enumerate(rows[1 : len(cpu_at_row)], 1):
        row["cpu_by_rank"] = {k: v - cpu_at_row[i - 1].get(k, 0.0) for k, v in cpu_at_row[i].items()}
    return [r for r in rows if "loss" in r][SKIP:]


def cpu_seconds_by_rank(root):
    """User + system CPU-seconds of the processes under `root` that have a RANK in their
    environment (torchrun's ranks and their children), summed by rank."""
    if not os.path.isdir("/proc"):
        return {}
    parent, ticks = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        except OSError:
            continue
        parent[pid], ticks[pid] = fields[1], int(fields[11]) + int(fields[12])
    by_rank = {}
    for pid in ticks:
        up = pid
        while up in parent and up != str(root):
            up = parent[up]
        if up != str(root):
            continue
        try:  # only the job's few processes: their environment, read as it is now
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"RANK" in env:
            rank = int(env[b"RANK"])
            by_rank[rank] = by_rank.get(rank, 0.0) + ticks[pid] / os.sysconf("SC_CLK_TCK")
    return by_rank


def median(rows, key):
    return statistics.median(r[key] for r in rows)


def sampler_against_bare_vllm(grpo_args, repeats=5):
    """Tokens/s of Sampler.sample and of LLM.generate on one step's requests, interleaved."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from comm import visible_gpus
    from config import cpu_has_bf16, parse_config, resolve
    from data import load_prompts
    from sampler import Sampler
    from tiny import model_path

    cfg = resolve(parse_config([*grpo_args, "--overwrite"]), 2, bool(visible_gpus()), cpu_has_bf16())
    engine = Sampler(
        model_path(cfg.model, 0),
        cfg.max_prompt_len + cfg.max_new_tokens,
        cfg.seed,
        cfg.dtype,
        cfg.sampler_gpu_memory or 0.3,
        cfg.sampler_kv_cache_gb,
        cfg.compile,
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


def matmul_rate(model, dtype, threads, rows=4096, repeats=10, rounds=5):
    """FLOP/s of the model's Linear shapes in dtype on `threads` threads: for each weight
    [out, in], x @ W^T, the input's gradient g @ W and the weight's g^T @ x, weighted by
    their FLOPs (all FLOPs over all seconds). Each shape's time is the fastest of `rounds`
    rounds: the machine's limit, which a noisy neighbour only ever lowers."""
    import torch

    torch.set_num_threads(threads)
    shapes = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shapes[tuple(m.weight.shape)] = shapes.get(tuple(m.weight.shape), 0) + 1
    flops = seconds = 0.0
    for (out, inp), count in shapes.items():
        x, w, g = (torch.randn(*shape).to(dtype) for shape in ((rows, inp), (out, inp), (rows, out)))
        products = (lambda: x @ w.t(), lambda: g @ w, lambda: g.t() @ x)
        for p in products:
            p()
        fastest = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(repeats):
                for p in products:
                    p()
            fastest = min(fastest, time.perf_counter() - t)
        seconds += count * fastest / repeats
        flops += count * 3 * 2 * rows * inp * out
    return flops / seconds


def train_flops(config, parameters, positions, width):
    """6 x parameters x positions, plus attention's scores and weighted sum (forward 4 x
    hidden x width per position and layer, backward twice that)."""
    return 6 * parameters * positions + 12 * config.num_hidden_layers * config.hidden_size * width * positions


def learner_alone(model_path, dtype, sequences, prompt_len, new_tokens, budget, threads=1, compile=False):
    """One learner on `threads` threads, a world of one: train_step on `sequences` rollouts
    of prompt_len + new_tokens ids, packed into micro-batches of `budget` positions, profiled
    (after two unprofiled steps: the allocator, and with compile=True, its graphs). Returns
    (seconds, FLOPs, {phase: s}, {kind: s})."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from comm import free_port
    from config import parse_config, resolve
    from grpo import Rollout, train_step
    from learner import Learner

    before = torch.get_num_threads()  # restored at the end: --limit's sampler comparison runs after
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    flags = ["--model", model_path, "--beta", "0", "--group-size", "8", "--max-new-tokens", str(new_tokens)]
    flags += ["--out-dir", os.path.join(os.path.dirname(model_path), "alone"), "--overwrite"]
    cfg = resolve(parse_config([*flags, "--max-tokens-per-microbatch", str(budget)]), 2, False, True)
    cfg.learners = 1
    mesh = init_device_mesh("cpu", (1,))
    learner = Learner(model_path, mesh, torch.device("cpu"), lr=1e-5, compute_dtype=dtype, compile=compile)
    rng = torch.Generator().manual_seed(0)
    rollouts = [
        Rollout(
            prompt_ids=torch.randint(3, 250, (prompt_len,), generator=rng).tolist(),
            token_ids=torch.randint(3, 250, (new_tokens,), generator=rng).tolist(),
            sampler_logprobs=[-5.5] * new_tokens,
            text="",
            truncated=False,
            reward=float(i % 3 == 0),
        )
        for i in range(sequences)
    ]
    for _ in range(2):  # warm-up: allocator, kernels, compiled graphs
        train_step(cfg, learner, rollouts, 0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        train_step(cfg, learner, rollouts, 0)
        seconds = time.perf_counter() - t
    dist.destroy_process_group()
    torch.set_num_threads(before)
    events = prof.key_averages()
    phases = {e.key: e.cpu_time_total / 1e6 for e in events if e.key in ("forward", "backward", "optimizer")}
    kinds = {"matmul": 0.0, "attention": 0.0, "collectives": 0.0, "compiled kernels": 0.0, "other ops": 0.0}
    for e in events:
        if "CompiledFxGraph" in e.key:  # the fused elementwise kernels torch.compile wrote
            kinds["compiled kernels"] += e.self_cpu_time_total / 1e6
        if e.key in ("forward", "backward", "optimizer") or not e.key.startswith(("aten::", "c10d::", "gloo")):
            continue
        name = e.key.lower()
        kind = "matmul" if any(k in name for k in ("::mm", "::addmm", "::bmm")) else "other ops"
        kind = "attention" if any(k in name for k in ("scaled_dot_product", "softmax")) else kind
        kind = "collectives" if any(k in name for k in ("c10d", "gloo", "all_gather", "reduce_scatter")) else kind
        kinds[kind] += e.self_cpu_time_total / 1e6
    kinds["outside ops (Python, framework)"] = seconds - sum(kinds.values())
    width = prompt_len + new_tokens
    return (
        seconds,
        train_flops(learner.model.config, sum(p.numel() for p in learner.trainable), sequences * width, width),
        phases,
        kinds,
    )


# --limit's runs, in this order in one invocation: (learners, --compile).
LIMIT_RUNS = [(2, False), (2, True), (1, True)]


def limit(steps, learners, extra):
    """The learner against the machine: the matmul rate, the learner alone (eager and
    compiled), and real runs (LIMIT_RUNS, or --learners N both ways)."""
    import torch
    from transformers import AutoModelForCausalLM

    from config import cpu_has_bf16, precision

    dtype_name = precision(None, False, cpu_has_bf16())
    dtype = getattr(torch, dtype_name)
    cores = len(os.sched_getaffinity(0))
    table, cpu_table = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_path = build_mid_model(os.path.join(tmp, "mid"))
        model = AutoModelForCausalLM.from_pretrained(model_path)
        rate1, rate_all = matmul_rate(model, dtype, 1), matmul_rate(model, dtype, cores)
        print(
            f"matmul rate of the model's shapes in {dtype_name}: 1 thread {rate1 / 1e9:.0f} GFLOP/s, {cores} threads {rate_all / 1e9:.0f} GFLOP/s"
        )
        for compiled in (False, True):
            seconds, flops, phases, kinds = learner_alone(model_path, dtype, 64, 45, 128, 4096, compile=compiled)
            print(
                f"one learner alone, 1 thread, {'compiled' if compiled else 'eager'}, 64 x (45 + 128) positions: {seconds:.2f} s, {flops / seconds / 1e9:.0f} GFLOP/s = {flops / seconds / rate1:.2f} of 1 thread's matmul rate"
            )
            print("  phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
            print("  by kind (s): " + ", ".join(f"{k} {v:.2f}" for k, v in kinds.items()))
        shapes = ["--model", model_path, "--dataset", "synthetic", "--prompts-per-step", "16", "--group-size", "8"]
        shapes += ["--max-new-tokens", "128", "--steps", str(steps), "--beta", "0", "--dtype", dtype_name, *extra]
        parameters = sum(p.numel() for p in model.parameters())
        for n, compiled in [(learners, False), (learners, True)] if learners else LIMIT_RUNS:
            os.environ.update(NPROC=str(n + 1), LEARNERS=str(n))
            flags = [*shapes, *(["--compile"] if compiled else [])]
            *rows, last = run(os.path.join(tmp, f"run{n}{compiled}"), flags)
            # The last step samples nothing beside it (no next step): the learners have the cores.
            width = statistics.median(r["positions_trained"] / r["sequences_trained"] for r in rows)
            rate = [
                train_flops(model.config, parameters, r["positions_trained"], width) / r["train_s"]
                for r in [*rows, last]
            ]
            name = f"{n} learner{'s' * (n > 1)} + 1 sampler, {'compiled' if compiled else 'eager'}"
            table.append(
                (
                    name,
                    *(median(rows, k) for k in ("step_s", "train_s", "sample_s", "sync_s")),
                    statistics.median(rate[:-1]),
                    last["train_s"],
                    rate[-1],
                )
            )
            # Where the cores' seconds went in a step: the learners', the sampler's, idle.
            # The sampler draws the next batch during the train phase, on the same cores,
            # so the learners have the share it leaves; their train FLOP/s is also given
            # against that share of the cores' rate.
            cpu = [
                (
                    sum(v for k, v in r["cpu_by_rank"].items() if k < n),
                    sum(v for k, v in r["cpu_by_rank"].items() if k >= n),
                )
                for r in rows
            ]
            shares = [1 - sampler / (cores * r["step_s"]) for (_, sampler), r in zip(cpu, rows)]
            cpu_table.append(
                (
                    name,
                    statistics.median(c[0] for c in cpu),
                    statistics.median(c[1] for c in cpu),
                    statistics.median(cores * r["step_s"] - sum(c) for c, r in zip(cpu, rows)),
                    statistics.median(shares),
                    statistics.median(f / s for f, s in zip(rate[:-1], shares)),
                )
            )
        wrapped, bare = sampler_against_bare_vllm(shapes)
    print(f"runs (medians of {steps - SKIP - 1} steps after {SKIP}; the last step apart, with no sampling beside it):")
    print(
        "| layout | step s | train s | sample s | sync s | train GFLOP/s | of the cores' rate | last step: train s | its fraction |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, step, train, sample, sync, rate, last_train, last_rate in table:
        print(
            f"| {name} | {step:.2f} | {train:.2f} | {sample:.2f} | {sync:.2f} | {rate / 1e9:.0f} | {rate / rate_all:.3f} | {last_train:.2f} | {last_rate / rate_all:.3f} |"
        )
    print(f"core-seconds per step ({cores} cores x step s), medians of the same steps:")
    print(
        "| layout | learners' CPU s | sampler's CPU s | idle core-s | share the sampler leaves | train's fraction of that share's rate |"
    )
    print("|---|---|---|---|---|---|")
    for name, learners_cpu, sampler_cpu, idle, share, rate in cpu_table:
        print(f"| {name} | {learners_cpu:.2f} | {sampler_cpu:.2f} | {idle:.2f} | {share:.2f} | {rate / rate_all:.3f} |")
    print(
        f"sampler {wrapped:.0f} tokens/s, bare vLLM {bare:.0f} tokens/s on the same requests, ratio {wrapped / bare:.3f}  (target >= 0.95)"
    )
    best = min(table, key=lambda row: row[1])
    print(
        f"SUMMARY fastest step: {best[0]}, {best[1]:.2f} s, train {best[5] / rate_all:.3f} of the {cores} cores' matmul rate ({rate_all / 1e9:.0f} GFLOP/s)"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", default="")
    parser.add_argument("--precision", action="store_true")
    parser.add_argument("--limit", action="store_true")
    parser.add_argument("--learners", type=int, default=0, help="--limit's run: N learners + 1 sampler")
    args, extra = parser.parse_known_args()
    if args.limit:
        return limit(args.steps if args.steps != 30 else 10, args.learners, extra)
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
