"""What a run reports: the learners' metrics reduced into one row per step, the
JSON-lines logs, wandb/TensorBoard forwarding, the end-of-run summary and the plot."""

import dataclasses
import json
import os
import resource
import time

import torch
import torch.distributed as dist

import tasks
from report import NOT_PARTS, read_jsonl
from tools import CALL

SHORT = {"accuracy": "acc"}  # how the progress bar writes a part's name


def summary(cfg, metrics_path, wall_s):
    rows = read_jsonl(metrics_path)
    train = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_length" in r]
    lines = [
        f"run finished: {len(train)} steps in {wall_s:.0f} s; metrics in {metrics_path}, policy in {os.path.join(cfg.out_dir, 'final')}"
    ]
    if evals:
        key = "eval_accuracy" if "eval_accuracy" in evals[0] else "eval_reward"
        lines.append(
            f"{key.replace('_', ' ')}: {evals[0][key]:.3f} at step {evals[0]['step']} -> {evals[-1][key]:.3f} at step {evals[-1]['step']}"
        )
    if train:
        seconds = sum(r["step_s"] for r in train)
        tokens = sum(r["tokens_sampled"] for r in train)
        lines.append(
            f"train reward {train[0]['reward_mean']:.3f} -> {train[-1]['reward_mean']:.3f}; {seconds:.0f} s in steps; {tokens / max(1e-9, sum(r['sample_s'] for r in train)):.0f} sampled tokens/s"
        )
    return "\n".join(lines)


def peak_memory_mb(device):
    """This process's peak: CUDA memory allocated on a GPU, resident memory otherwise."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


def memcpy_seconds(num_bytes, device, repeats=5, max_bytes=64 * 2**20):
    """The time one in-memory copy of num_bytes takes: the yardstick for a weight sync.
    Timed on at most max_bytes (best of `repeats`) and scaled, so that it never allocates
    twice the model on a GPU that already holds the learner."""
    size = max(1, min(num_bytes, max_bytes))
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best * num_bytes / size


def reduce_metrics(sums, maxima, device):
    """The whole step's metrics from every learner's share. `sums` is a list of dicts
    whose values add up across learners, `maxima` one dict whose values take the
    largest; the result has the same shape. Two collectives, whatever the number of
    metrics (every learner holds the same keys, so the order agrees)."""
    keys = [sorted(d) for d in sums]
    peaks = sorted(maxima)
    total = torch.tensor([float(d[k]) for d, ks in zip(sums, keys) for k in ks], dtype=torch.float64, device=device)
    peak = torch.tensor([float(maxima[k]) for k in peaks], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    values = iter(total.tolist())
    return [{k: next(values) for k in ks} for ks in keys], dict(zip(peaks, peak.tolist()))


def part_key(name, metric_names=None):
    """The metrics.jsonl key of reward `name`'s mean: the name itself where it is one a task
    lists in its METRICS (`accuracy`, `format`), else `reward_<name>` (`reward_code_tests`,
    `reward_my_module:fn`)."""
    return name if name in (tasks.metric_names() if metric_names is None else metric_names) else f"reward_{name}"


def part_keys(row):
    """The keys of a metrics row that are its rewards' means, in the row's order."""
    named = set(tasks.metric_names())
    return [k for k in row if k in named or (k.startswith("reward_") and k not in NOT_PARTS)]


def progress(row):
    """The progress bar's text after a step: the reward, the first reward a task logs under
    its own name (else the first reward's part: reward_<name>), the seconds per step."""
    parts = [f"reward {row['reward_mean']:.3f}"]
    named = set(tasks.metric_names())
    if keys := sorted(part_keys(row), key=lambda k: k not in named):
        name = keys[0].removeprefix("reward_")
        parts.append(f"{SHORT.get(name, name)} {row[keys[0]]:.2f}")
    return ", ".join(parts + [f"{row['step_s']:.1f} s/step"])


def step_metrics(step, rollouts, reports, sums, token_sums, maxima, grad_norm, lr, wait_s, train_s):
    """One row of metrics.jsonl. Each reward's mean over the rollouts goes under its
    part_key, in the order of --rewards; a reward not in --rewards has none. token_sums
    (the objective's metrics, the KL, the mismatch and the entropy) are sums over the
    trained tokens, reported per token (a *_seqs one counts sequences, and is reported
    per trained sequence)."""
    rewards = torch.tensor([c.reward for c in rollouts])
    lengths = torch.tensor([len(c.token_ids) for c in rollouts], dtype=torch.float32)
    parts = {name: sum(c.parts[name] for c in rollouts) / len(rollouts) for name in rollouts[0].parts}
    tokens = max(1.0, sums["tokens"])
    named = set(tasks.metric_names())
    return {
        "step": step,
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item(),
        **{part_key(k, named): v for k, v in parts.items()},
        "completion_len": lengths.mean().item(),
        "completion_len_max": lengths.max().item(),
        "truncated_frac": sum(c.truncated for c in rollouts) / len(rollouts),
        "reward_errors": sum(r["reward_counts"]["reward_errors"] for r in reports),
        "reward_timeouts": sum(r["reward_counts"]["reward_timeouts"] for r in reports),
        # programs the rewards and tools ran in the sandbox that ended in an error (sandbox.py)
        "sandbox_errors": sum(
            r["reward_counts"]["sandbox_errors"] + r.get("env_counts", {}).get("sandbox_errors", 0) for r in reports
        ),
        "loss": sums["loss"],
        "grad_norm": grad_norm,
        "lr": lr,
        **{
            k: v / (max(1.0, sums["sequences_trained"]) if k.endswith("_seqs") else tokens)
            for k, v in token_sums.items()
        },
        "mismatch_max": maxima["mismatch"],
        "groups_uniform": int(sums["groups_uniform"]),
        "groups_dropped": int(sums["groups_dropped"]),
        "sequences_trained": int(sums["sequences_trained"]),
        "tokens_sampled": sum(c.model_tokens() for c in rollouts),
        "tokens_trained": int(sums["tokens"]),
        "positions_trained": int(sums["positions"]),  # padded: what the learners computed on
        "padded_frac": sums["padding"] / max(1.0, sums["positions"]),
        "staleness": step - min(r["weights_step"] for r in reports),
        "samplers": len(reports),
        "peak_memory_mb_learner": maxima["peak_memory_mb"],
        "peak_memory_mb_sampler": max(r["peak_memory_mb"] for r in reports),
        "sample_s": max(r["sample_s"] for r in reports),
        "reward_s": max(r["reward_s"] for r in reports),
        "wait_s": wait_s,
        "train_s": train_s,
        **episode_metrics(rollouts, reports),
    }


def episode_metrics(rollouts, reports):
    """With an environment: assistant turns and tool calls (tools.py's format; the last
    answer's calls are never run) per episode, and the environment's errors, timeouts
    and seconds (the slowest sampler's)."""
    if not all("env_counts" in r for r in reports):
        return {}
    turns = [sum(m["role"] == "assistant" for m in c.turns) for c in rollouts]
    counts = [r["env_counts"] for r in reports]
    return {
        "turns_mean": sum(turns) / len(turns),
        "turns_max": max(turns),
        "tool_calls_mean": sum(
            len(CALL.findall(m["content"])) for c in rollouts for m in c.turns[:-1] if m["role"] == "assistant"
        )
        / len(rollouts),
        "env_errors": sum(c["env_errors"] for c in counts),
        "env_timeouts": sum(c["env_timeouts"] for c in counts),
        "env_s": max(c["env_s"] for c in counts),
    }


SAMPLE_GROUPS = 2  # whole groups per logged step in samples.jsonl


def sample_indices(cfg, step, num_rollouts):
    """The rollouts samples.jsonl keeps at `step`: SAMPLE_GROUPS whole groups, spread over
    the step (the first group of each share: with two samplers, one from each), so that
    a reader sees why a group's advantages were what they were. None off logged steps."""
    if not cfg.samples_every or step % cfg.samples_every:
        return []
    groups = num_rollouts // cfg.group_size
    firsts = sorted({g * groups // SAMPLE_GROUPS for g in range(min(SAMPLE_GROUPS, groups))})
    return [f * cfg.group_size + j for f in firsts for j in range(cfg.group_size)]


def sample_row(step, index, c, cfg):
    """One line of samples.jsonl: the completion, its rewards and advantage, the ids as
    trained (a reader can check them against the tokenizer) and, per token, the sampler's
    and the learner's log-probs (rounded to 1e-6: the float32 mismatch is about 1e-5)."""
    row = {"step": step, "group": index // cfg.group_size, "text": c.text, "reward": c.reward, **c.parts}
    row.update(truncated=c.truncated, advantage=c.advantage, prompt_ids=c.prompt_ids, token_ids=c.token_ids)
    row["sampler_logprobs"] = [round(x, 6) for x in c.sampler_logprobs]
    row["learner_logprobs"] = None if c.learner_logprobs is None else [round(x, 6) for x in c.learner_logprobs]
    if cfg.env:  # the whole transcript, and which ids the model drew
        row.update(turns=c.turns, model_mask=c.model_mask)
    return row


def plot(out_dir):
    """curves.png from metrics.jsonl: reward, the first reward's part (train accuracy) and
    the held-out accuracy, and seconds per phase."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no curves.png")
        return None
    rows = read_jsonl(os.path.join(out_dir, "metrics.jsonl"))
    train = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_length" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in train]
    left.plot(steps, [r["reward_mean"] for r in train], label="reward")
    first = part_keys(train[0])[:1] if train else []
    for key in first:  # a row holds every reward's part
        left.plot(steps, [r[key] for r in train], label=f"train {key.removeprefix('reward_')}")
    key = "eval_accuracy" if evals and "eval_accuracy" in evals[0] else "eval_reward"
    left.plot([r["step"] for r in evals], [r.get(key, 0.0) for r in evals], "o-", label=key.replace("_", " "))
    left.set_xlabel("step")
    left.legend()
    for phase in ("sync_s", "sample_s", "reward_s", "wait_s", "train_s"):
        right.plot(steps, [r[phase] for r in train], label=phase)
    right.set_xlabel("step")
    right.set_ylabel("seconds")
    right.legend()
    path = os.path.join(out_dir, "curves.png")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def open_reporter(cfg):
    """A function that forwards one metrics row to wandb or TensorBoard, or None."""
    if cfg.report_to == "wandb":
        import wandb

        run = wandb.init(project="grpo", dir=cfg.out_dir, config=dataclasses.asdict(cfg))
        return lambda row: run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    if cfg.report_to == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(cfg.out_dir)

        def report(row):
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    writer.add_scalar(k, v, row["step"])
            writer.flush()

        return report
    return None


def open_log(path, first_step):
    """A JSON-lines log opened for appending, without the rows of steps >= first_step
    (which a resumed run writes again)."""
    rows = []
    if first_step and os.path.exists(path):
        rows = [r for r in read_jsonl(path) if r["step"] < first_step]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return open(path, "a")


def eval_line(step, evals):
    """One console line for an eval as it comes: accuracy first, then the other rewards, the length."""
    keys = sorted((k for k in evals if k != "eval_length"), key=lambda k: (k != "eval_accuracy", k))
    parts = [f"{k[5:].replace('_', ' ')} {evals[k]:.3f}" for k in keys]
    return f"eval at step {step}: " + ", ".join(parts + [f"length {evals['eval_length']:.1f} tokens"])


def merge_evals(reports):
    """One eval from the samplers' shares (each sampler sends one after every due sync)."""
    evals = [r["eval"] for r in reports]
    n = max(1, sum(e["n"] for e in evals))
    return {f"eval_{k}": sum(e[k] for e in evals) / n for k in evals[0] if k not in ("n", "samples")}


def estimate_learner_memory(
    model, learners, tokens, device, compute_dtype, reference, logprob_chunk, gradient_checkpointing=False, seq_len=None
):
    """The peak bytes one learner rank holds during a step, by component, from the
    model's parameters and config at the configured sizes; `total` is their sum. It counts
    tensors only: not the CUDA context or the Python runtime (the free memory it is
    compared with already excludes them). Works on an FSDP2 model (a DTensor counts
    whole) and on one built on the meta device (for a model too big to load here).

      parameters, gradients  float32 shards: 4 bytes each per parameter (gradients: per
                             trained one) / learners
      optimizer              AdamW's two float32 moments: 8 bytes per trained parameter
                             / learners
      reference              the frozen copy, in the compute dtype, sharded
      unsharded              what FSDP2 holds whole: the root's parameters (embeddings,
                             head, final norm; the root never reshards after forward),
                             of the policy and the reference, the head's gradient, and
                             two blocks in flight with one block's gradient
      activations            saved for the backward by `layers` blocks over `tokens`
                             positions: about 9H + 4I + 4 kv_heads x head_dim values per
                             position and layer, plus the attention mask's seq_len^2 per
                             sequence and layer (with gradient checkpointing: H values
                             per position and layer, plus one layer's whole)
      logits                 float32 [positions, V] tensors alive at the peak: about 5
                             whole ones on the dense path (the saved logits, then the
                             backward's softmax, scatter, sum and scaled copies), about
                             3 of [logprob_chunk, V] on the chunked one"""
    config = model.config.get_text_config()
    H, V, layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    intermediate = getattr(config, "intermediate_size", None) or 4 * H
    heads = getattr(config, "num_attention_heads", 1) or 1
    kv = (getattr(config, "num_key_value_heads", None) or heads) * (getattr(config, "head_dim", None) or H // heads)
    c = torch.finfo(compute_dtype).bits // 8  # bytes per value computed
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in names]
    total = sum(p.numel() for p in model.parameters())  # tied weights once
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # all, or LoRA's adapters
    root = total - sum(blocks)
    head_weight = model.get_output_embeddings().weight
    head = head_weight.numel() if head_weight.requires_grad else 0
    seq_len = min(seq_len or tokens, tokens)
    mask_bytes = 4 if device.type == "cpu" else c  # the CPU attention kernel takes a float32 mask
    if gradient_checkpointing:
        activations = (
            tokens * layers * H * c + tokens * (9 * H + 4 * intermediate + 4 * kv) * c + tokens * seq_len * mask_bytes
        )
    else:
        activations = tokens * layers * (9 * H + 4 * intermediate + 4 * kv) * c + layers * tokens * seq_len * mask_bytes
    positions = min(logprob_chunk, tokens) if logprob_chunk else tokens
    # Computing in bf16, the head's own [positions, V] output comes before its float32 copy.
    logits = positions * V * ((3 if logprob_chunk else 5) * 4 + (c if c != 4 else 0))
    estimate = {
        "parameters": 4 * total / learners,
        "gradients": 4 * trained / learners,
        "optimizer": 8 * trained / learners,
        "reference": c * total / learners if reference else 0,
        "unsharded": c * (root * (2 if reference else 1) + head + 3 * max(blocks, default=0)),
        "activations": activations,
        "logits": logits,
    }
    estimate["total"] = sum(estimate.values())
    return estimate
