"""What keeping samples.jsonl's per-token log-probs costs (the run report's, report.py): one
learner alone on the tiny model, the default step's shape (64 prompts x 4 completions of 24
tokens, no KL), train_step with and without the logged rollouts' learner log-probs kept, in
alternation; the all-reduce that shares them between learners; and the bytes of a logged
step's rows.

    python benchmarks/samples_cost.py [--repeats 10]"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import metrics
    from comm import free_port
    from config import parse_config, resolve
    from grpo import Rollout, share_kept_logprobs, train_step
    from learner import Learner
    from tiny import build_tiny_model, tiny_model_dir

    path = tiny_model_dir()
    if not os.path.exists(path):
        build_tiny_model(path)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    out = tempfile.mkdtemp()
    cfg = resolve(
        parse_config(["--dtype", "float32", "--beta", "0", "--out-dir", out, "--samples-every", "1"]), 2, False, False
    )
    cfg.learners = 1
    learner = Learner(path, init_device_mesh("cpu", (1,)), torch.device("cpu"), lr=1e-5, compute_dtype=torch.float32)
    rng = torch.Generator().manual_seed(0)
    n = cfg.prompts_per_step * cfg.group_size

    def rollouts():
        return [
            Rollout(
                prompt_ids=torch.randint(3, 250, (40,), generator=rng).tolist(),
                token_ids=torch.randint(3, 250, (cfg.max_new_tokens,), generator=rng).tolist(),
                sampler_logprobs=[-5.5] * cfg.max_new_tokens,
                text="x" * cfg.max_new_tokens,
                truncated=False,
                reward=float(i % 3 == 0),  # every group mixed: all trained, the kept ones too
            )
            for i in range(n)
        ]

    keep = metrics.sample_indices(cfg, 0, n)
    seconds = {"without": [], "with": []}
    for r in range(args.repeats + 1):  # the first pair warms the allocator up
        for kind in ("without", "with"):
            batch = rollouts()
            t = time.perf_counter()
            train_step(cfg, learner, batch, 0, keep=keep if kind == "with" else ())
            if r:
                seconds[kind].append(time.perf_counter() - t)
    kept = [batch[i] for i in keep]
    t = time.perf_counter()
    share_kept_logprobs(kept, torch.device("cpu"))  # what several learners add: one all-reduce
    share_s = time.perf_counter() - t
    t = time.perf_counter()
    lines = [json.dumps(metrics.sample_row(0, i, batch[i], cfg)) + "\n" for i in keep]
    rows_s = time.perf_counter() - t
    lists = ("sampler_logprobs", "learner_logprobs")
    plain = [json.dumps({k: v for k, v in json.loads(line).items() if k not in lists}) + "\n" for line in lines]
    without, with_ = statistics.median(seconds["without"]), statistics.median(seconds["with"])
    print(f"train_step, {n} rollouts of {cfg.max_new_tokens} tokens, median of {args.repeats}:")
    print(f"  without kept log-probs {without:.4f} s, with {with_:.4f} s ({len(keep)} kept): {with_ - without:+.4f} s")
    print(
        f"  the learners' all-reduce of them (a world of one) {share_s * 1e3:.2f} ms; the rows' JSON {rows_s * 1e3:.2f} ms"
    )
    print(
        f"  a logged step's rows: {sum(map(len, lines))} bytes, {sum(map(len, plain))} without the two log-prob lists"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
