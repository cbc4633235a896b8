"""Chunked log-probs against the dense path (a large vocabulary, tied and untied heads,
a temperature, plain and under 2-rank FSDP2), the frozen reference in the compute dtype,
the micro-batch default, gradient checkpointing, and the start-up memory estimate
against a measured peak.

This file is also its own torchrun worker: `python -m torch.distributed.run ...
tests/test_logprobs.py fsdp MODEL OUT` and `python tests/test_logprobs.py estimate|checkpointing
MODEL OUT` are what the tests below run."""

import copy
import json
import os
import random
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import ROOT, free_port  # noqa: E402

TEMPERATURE = 0.7


def random_model(path, vocab_size, hidden_size=64, layers=2, tied=False, intermediate_size=None):
    """A random-init Qwen2 saved where Learner loads it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=tied,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    if path:
        model.save_pretrained(path)
    return model


def rollouts(vocab, sequences=8, seq_len=40, seed=0):
    """One group of sequences of varied lengths (so micro-batches pad), random tokens."""
    from grpo import Rollout

    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab) for _ in range(6)]
    out = []
    for i in range(sequences):
        n = rng.randint(seq_len // 2, seq_len - len(prompt))
        out.append(
            Rollout(
                prompt_ids=prompt,
                token_ids=[rng.randrange(3, vocab) for _ in range(n)],
                sampler_logprobs=[rng.uniform(-10.0, -8.0) for _ in range(n)],
                text="",
                truncated=False,
                reward=float(i % 3),
            )
        )
    return out


def step_config(group_size, max_tokens, beta=0.1):
    from config import Config

    return Config(
        learners=int(os.environ.get("WORLD_SIZE", 1)),
        prompts_per_step=1,
        group_size=group_size,
        max_new_tokens=40,
        max_prompt_len=40,
        temperature=TEMPERATURE,
        beta=beta,
        epsilon_high=0.2,
        max_grad_norm=1e9,
        max_tokens_per_microbatch=max_tokens,
        micro_batch_size=group_size,
    )


# ---------------------------------------------------------------- plain model


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_logprobs_and_gradients_match_dense(tied):
    """A 32k vocabulary, a chunk that does not divide the positions, padding and a
    temperature: the same log-probs and entropies, and the same gradient for every
    parameter (the head's, or with tied embeddings the shared one's, included)."""
    from logprobs import token_logprobs

    model = random_model(None, 32000, tied=tied)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (3, 41), generator=g)  # [B, T]
    attention = torch.ones_like(ids)
    attention[1, 30:] = 0
    weights = torch.randn(3, 40, generator=g)  # [B, T-1]: an arbitrary upstream gradient
    results = {}
    for chunk in (0, 17):
        model.zero_grad(set_to_none=True)
        logp, entropy = token_logprobs(model, ids, attention, TEMPERATURE, chunk)
        (logp * weights).sum().backward()
        results[chunk] = logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}
    (dense_logp, dense_entropy, dense_grads), (logp, entropy, grads) = results[0], results[17]
    assert (logp - dense_logp).abs().max().item() < 1e-6
    assert (entropy - dense_entropy).abs().max().item() < 1e-5
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert head in grads and grads[head].abs().max() > 0.1
    for name, want in dense_grads.items():
        # Relative to the gradient's scale: the head's is a sum over every position,
        # which the chunks add up in another order (a float32 rounding, ~6e-7 here).
        worst = (grads[name] - want).abs().max().item() / max(1.0, want.abs().max().item())
        assert worst < 1e-6, (name, worst)


def test_chunked_path_saves_no_full_logits():
    """What the chunked forward keeps for the backward is [N, H]-sized, never [N, V]."""
    from logprobs import token_logprobs

    model = random_model(None, 32000)
    ids = torch.randint(0, 32000, (2, 300))
    largest = []

    def pack(t):
        largest.append(t.numel())
        return t

    for chunk in (0, 64):
        largest.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            token_logprobs(model, ids, torch.ones_like(ids), TEMPERATURE, chunk)
        saved = max(n for n in largest if n != 32000 * 64)  # the head's own weight aside
        if chunk:
            assert saved < 2 * 300 * 32000 / 100, saved
        else:
            assert saved >= 2 * 299 * 32000, saved  # the dense path does keep them


# ---------------------------------------------------------------- FSDP2, 2 ranks


def fsdp_worker(model_dir, out_dir):
    """Each model, dense and chunked: one train_step (KL to a reference, temperature,
    packed micro-batches) with SGD, the full weights saved by rank 0. Then the reference
    of a bf16 learner: stored in bf16, frozen, and its chunked log-probs near dense."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from grpo import train_step
    from learner import Learner

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    for name in ("untied", "tied"):
        path = os.path.join(model_dir, name)
        batch = rollouts(8000)
        for chunk in (0, 7):
            torch.manual_seed(0)
            learner = Learner(path, mesh, torch.device("cpu"), lr=0.0, reference=True, logprob_chunk=chunk)
            learner.optimizer = torch.optim.SGD(learner.model.parameters(), lr=0.5)
            *_, grad_norm = train_step(step_config(len(batch), 120), learner, copy.deepcopy(batch), rank)
            state = {n: learner.full_tensor(n, torch.float32).clone() for n in learner.named_params}
            if rank == 0:
                torch.save({"state": state, "grad_norm": grad_norm}, os.path.join(out_dir, f"{name}-{chunk}.pt"))
    learner = Learner(
        os.path.join(model_dir, "tied"), mesh, torch.device("cpu"), lr=0.0, reference=True, compute_dtype=torch.bfloat16
    )
    ref_params = list(learner.reference.parameters())
    ids, attention, *_ = learner.collate(rollouts(8000))
    with torch.no_grad():
        chunked = learner.token_logprobs(learner.reference, ids, attention, TEMPERATURE)[0]
        learner.logprob_chunk = 0
        dense = learner.token_logprobs(learner.reference, ids, attention, TEMPERATURE)[0]
    if rank == 0:
        report = {
            "reference_dtypes": sorted({str(p.dtype) for p in ref_params}),
            "reference_grad": any(p.requires_grad for p in ref_params),
            "policy_dtypes": sorted({str(p.dtype) for p in learner.model.parameters()}),
            "bf16_diff": (chunked - dense).abs().max().item(),
        }
        json.dump(report, open(os.path.join(out_dir, "bf16.json"), "w"))
    dist.destroy_process_group()


@pytest.mark.system  # starts its own processes or model: not in the fast tier
def test_chunked_matches_dense_under_fsdp(tmp_path):
    """Two FSDP2 learners: the updated weights after one step agree to 1e-6 between the
    dense and chunked paths, with an untied and a tied head (the head's gradient then
    reaches the sharded parameters through FSDP's own reduce-scatter). And the bf16
    learner's reference is a bf16 copy with no gradients beside float32 masters."""
    from safetensors.torch import load_file

    for name, tied in (("untied", False), ("tied", True)):
        random_model(str(tmp_path / name), 8000, tied=tied)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        os.path.abspath(__file__),
        "fsdp",
        str(tmp_path),
        str(out),
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    for name in ("untied", "tied"):
        initial = load_file(str(tmp_path / name / "model.safetensors"))
        dense, chunked = (torch.load(out / f"{name}-{c}.pt") for c in (0, 7))
        head = "model.embed_tokens.weight" if name == "tied" else "lm_head.weight"
        assert head in dense["state"]
        moved = (dense["state"][head] - initial[head]).abs().max().item()
        worst = max((dense["state"][k] - chunked["state"][k]).abs().max().item() for k in dense["state"])
        print(
            f"{name}: head moved {moved:.3g}, max diff dense/chunked {worst:.2e}, grad norms {dense['grad_norm']:.6g} / {chunked['grad_norm']:.6g}"
        )
        assert moved > 1e-4, f"{name}: the step did not move the head"
        assert worst < 1e-6, name
        assert chunked["grad_norm"] == pytest.approx(dense["grad_norm"], rel=1e-6)
    bf16 = json.load(open(out / "bf16.json"))
    assert bf16["reference_dtypes"] == ["torch.bfloat16"] and not bf16["reference_grad"]
    assert bf16["policy_dtypes"] == ["torch.float32"]
    assert bf16["bf16_diff"] < 0.05, bf16  # bf16 matmuls of different shapes round apart


# ---------------------------------------------------------------- defaults


def test_default_micro_batch_holds_one_whole_sequence():
    from config import parse_config, resolve

    seed = resolve(
        parse_config(["--model", "tiny", "--max-new-tokens", "4096", "--out-dir", "/nonexistent/run"]),
        world_size=2,
        has_gpu=False,
    )
    assert seed.max_tokens_per_microbatch == 512 + 4096 and seed.logprob_chunk == 1024
    short = resolve(parse_config(["--model", "tiny", "--out-dir", "/nonexistent/run"]), world_size=2, has_gpu=False)
    assert short.max_tokens_per_microbatch == 4096
    with pytest.raises(SystemExit):
        resolve(
            parse_config(["--model", "tiny", "--logprob-chunk", "-1", "--out-dir", "/nonexistent/run"]),
            world_size=2,
            has_gpu=False,
        )


# ---------------------------------------------------------------- gradient checkpointing


def checkpointing_worker(model_dir, out_file):
    """One learner (FSDP2 over a world of 1) with and without gradient checkpointing:
    how often the first block's MLP runs in one train step, and the grad norm."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from grpo import train_step
    from learner import Learner

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    batch = rollouts(512, sequences=4)
    result = {}
    for checkpointing in (False, True):
        learner = Learner(model_dir, mesh, torch.device("cpu"), lr=0.0, gradient_checkpointing=checkpointing)
        calls, mlp = [], learner.model.model.layers[0].mlp
        forward = mlp.forward  # wrapped, not hooked: a checkpoint's recompute runs no module hooks
        mlp.forward = lambda *args: calls.append(1) or forward(*args)
        norm = train_step(step_config(len(batch), 4096, beta=0.0), learner, copy.deepcopy(batch), 0)[-1]
        result[str(checkpointing)] = {"calls": len(calls), "grad_norm": norm}
    json.dump(result, open(out_file, "w"))
    dist.destroy_process_group()


@pytest.mark.system  # starts its own processes or model: not in the fast tier
def test_gradient_checkpointing_recomputes_each_block_and_changes_no_gradient(tmp_path):
    """--gradient-checkpointing: each block runs again in the backward (transformers
    recomputes a block only while it is in training mode, and from_pretrained loads in
    eval mode), and the gradient is the same: the model's attention dropout of 0.5 was
    not switched on with it."""
    random_model(str(tmp_path / "model"), 512)
    config = json.load(open(tmp_path / "model" / "config.json"))
    json.dump({**config, "attention_dropout": 0.5}, open(tmp_path / "model" / "config.json", "w"))  # must stay off
    out = tmp_path / "checkpointing.json"
    cmd = [sys.executable, os.path.abspath(__file__), "checkpointing", str(tmp_path / "model"), str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    measured = json.load(open(out))
    off, on = measured["False"], measured["True"]
    print(
        f"first block's MLP calls: {off['calls']} without, {on['calls']} with; grad norms {off['grad_norm']:.8g}, {on['grad_norm']:.8g}"
    )
    assert off["calls"] >= 1 and on["calls"] == 2 * off["calls"]
    assert abs(on["grad_norm"] - off["grad_norm"]) <= 1e-6 * off["grad_norm"]


# ---------------------------------------------------------------- compiled blocks


def compile_worker(model_dir, out_file):
    """One learner (FSDP2 over a world of 1) eager, compiled (--compile) and compiled
    with gradient checkpointing, each from the same weights through the same train step
    on micro-batches of varied batch sizes and widths: the log-probs of the step's
    sequences before it, its grad norm, and how many graphs torch.compile built."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from grpo import train_step
    from learner import Learner

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    batch = rollouts(512, sequences=24, seq_len=40)
    result = {}
    for name, compiled, checkpointing in (("eager", False, False), ("compiled", True, False), ("both", True, True)):
        counters.clear()
        learner = Learner(model_dir, mesh, torch.device("cpu"), 0.0, 0.0, checkpointing, compile=compiled)
        ids, attention, *_ = learner.collate(batch)
        with torch.no_grad():
            logp = learner.token_logprobs(learner.model, ids, attention, TEMPERATURE)[0]  # [B, T-1]
        # 100 positions per micro-batch: widths 26-40, 2 or 3 sequences each.
        norm = train_step(step_config(len(batch), 100, beta=0.0), learner, copy.deepcopy(batch), 0)[-1]
        result[name] = {"logp": logp.tolist(), "grad_norm": norm, "graphs": counters["stats"]["unique_graphs"]}
    json.dump(result, open(out_file, "w"))
    dist.destroy_process_group()


@pytest.mark.system  # starts its own processes or model: not in the fast tier
def test_compiled_blocks_compute_what_eager_ones_do(tmp_path):
    """--compile: each block's forward runs through torch.compile, under FSDP2's hooks,
    alone and with gradient checkpointing; log-probs and the step's gradient are the
    eager learner's within float32 rounding, and the micro-batches' many shapes cost a
    few graphs (one per block code, recompiled once with symbolic sizes), not one per
    shape."""
    random_model(str(tmp_path / "model"), 512)
    out = tmp_path / "compile.json"
    cmd = [sys.executable, os.path.abspath(__file__), "compile", str(tmp_path / "model"), str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    r = json.load(open(out))
    eager = torch.tensor(r["eager"]["logp"])
    for name in ("compiled", "both"):
        gap = (torch.tensor(r[name]["logp"]) - eager).abs().max().item()
        print(
            f"{name}: {r[name]['graphs']} graphs, log-prob gap {gap:.2e}, grad norm {r[name]['grad_norm']:.8g} (eager {r['eager']['grad_norm']:.8g})"
        )
        assert 1 <= r[name]["graphs"] <= 6
        assert gap <= 1e-4
        assert abs(r[name]["grad_norm"] - r["eager"]["grad_norm"]) <= 1e-4 * r["eager"]["grad_norm"]
    assert r["eager"]["graphs"] == 0


# ---------------------------------------------------------------- the memory estimate


def rss_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024


def estimate_worker(model_dir, out_file, chunk):
    """One learner (FSDP2 over a world of 1), two steps; the peak resident set above
    what the process held before the learner, and the estimate."""
    import resource

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import metrics
    from grpo import train_step
    from learner import Learner

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    batch = rollouts(32000, sequences=4, seq_len=512)
    tokens = len(batch) * 512
    before = rss_bytes()
    learner = Learner(model_dir, mesh, torch.device("cpu"), lr=1e-5, reference=True, logprob_chunk=chunk)
    estimate = metrics.estimate_learner_memory(
        learner.model, 1, tokens, torch.device("cpu"), torch.float32, True, chunk, seq_len=512
    )
    line = learner.memory_line(1, tokens, 512)
    for _ in range(2):
        train_step(step_config(len(batch), tokens), learner, copy.deepcopy(batch), 0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    json.dump({"peak": peak, "estimate": estimate, "line": line}, open(out_file, "w"))
    dist.destroy_process_group()


@pytest.mark.system  # starts its own processes or model: not in the fast tier
@pytest.mark.parametrize("chunk", [1024, 0])
def test_memory_estimate_is_within_30_percent_of_the_measured_peak(tmp_path, chunk):
    """A 32k vocabulary, 256 wide, 4 layers, 2048 positions per micro-batch, with a
    reference: the estimate against the peak resident set above the process's
    footprint before the learner loads, chunked and dense."""
    random_model(str(tmp_path / "model"), 32000, hidden_size=256, layers=4, intermediate_size=768)
    out = tmp_path / "estimate.json"
    cmd = [sys.executable, os.path.abspath(__file__), "estimate", str(tmp_path / "model"), str(out), str(chunk)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    r = json.load(open(out))
    ratio = r["estimate"]["total"] / r["peak"]
    print(
        f"chunk {chunk}: estimate {r['estimate']['total'] / 2**20:.0f} MB, measured {r['peak'] / 2**20:.0f} MB, ratio {ratio:.2f}"
    )
    print(r["line"])
    assert 0.7 <= ratio <= 1.3, r
    assert r["line"].startswith("learner memory: estimated peak") and "WARNING" not in r["line"]


if __name__ == "__main__":
    if sys.argv[1] == "fsdp":
        fsdp_worker(*sys.argv[2:4])
    elif sys.argv[1] == "checkpointing":
        checkpointing_worker(*sys.argv[2:4])
    elif sys.argv[1] == "compile":
        compile_worker(*sys.argv[2:4])
    elif sys.argv[1] == "estimate":
        estimate_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
