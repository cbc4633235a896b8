"""The GPU path on a machine that has torch and transformers but neither vLLM nor the
network, where benchmarks/gpu_check.sh (which installs requirements.txt and downloads
the hub model) cannot run. It runs job.main itself under torchrun, 1 learner + 1
sampler sharing one GPU as launch.sh places them, on the tiny model, with one piece
stood in for: the sampler's engine is transformers' generate in the engine's dtype
(GenerateEngine below), because vLLM is not there. Everything else is the real run:
placement, the learners' NCCL group, FSDP2 in bf16 mixed precision on CUDA, chunked
log-probs, the loss, the weight sync, metrics, a checkpoint and its resume, --compile; then the
same loop on a tiny tied Qwen3.5 composite (the seed model's layout). Then
benchmarks/memory.py on the GPU default's shapes (Qwen2.5-0.5B: 896 x 24 layers, a
152k vocabulary): bf16 at 4 x 4096 positions with and without gradient checkpointing,
and bf16 against float32 on one 4096-position sequence.

    python3 benchmarks/gpu_learner_check.py [--no-memory]

It prints one PASS/FAIL line per check, then the figures. On a CPU it runs too (gloo,
float32), which is how it was tried before it went to a GPU.
"""

import json
import os
import subprocess
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from comm import free_port  # noqa: E402


class GenerateEngine:
    """sampler.Sampler's interface over transformers' generate: n seeded completions per
    prompt with the log-probs of the sampled tokens after temperature, and an in-place
    weight load. One prompt's n completions are one batch (no padding), so it is slow,
    but exact enough to measure the learner against."""

    def __init__(
        self,
        model,
        max_model_len,
        seed,
        dtype,
        gpu_memory_utilization=0.3,
        kv_cache_gb=1.0,
        compile=False,
        head_dtype=None,
    ):
        """sampler.Sampler's own signature (tests/test_sampler.py holds them equal), as
        job.py calls it; the engine's memory, compile and head options mean nothing here."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.dtype = getattr(torch, dtype)
        self.kept_dtypes = {}
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=self.dtype).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.params = dict(self.model.named_parameters())

    def sample(self, prompt_ids, n, max_tokens, temperature, key):
        import torch

        eos, completions = self.tokenizer.eos_token_id, []
        for i, prompt in enumerate(prompt_ids):
            torch.manual_seed(zlib.crc32(repr((*key, i)).encode()))  # a function of the request alone
            ids = torch.tensor([list(prompt)] * n, device=self.device)
            sampling = (
                dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
                if temperature
                else {"do_sample": False}
            )
            with torch.no_grad():
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_tokens,
                    output_scores=True,
                    return_dict_in_generate=True,
                    eos_token_id=eos,
                    pad_token_id=self.tokenizer.pad_token_id,
                    **sampling,
                )
            new = out.sequences[:, len(prompt) :]  # [n, T]
            logp = torch.stack(out.scores, 1).float().log_softmax(-1)  # [n, T, V], after temperature
            logp = logp.gather(-1, new[..., None])[..., 0].cpu()  # [n, T]
            for j, tokens in enumerate(new.tolist()):
                end = tokens.index(eos) + 1 if eos in tokens else len(tokens)
                completions.append(
                    {
                        "prompt_ids": list(prompt),
                        "token_ids": tokens[:end],
                        "sampler_logprobs": logp[j, :end].tolist(),
                        "text": self.tokenizer.decode(tokens[:end], skip_special_tokens=True),
                        "truncated": eos not in tokens,
                    }
                )
        return completions

    def load_weights(self, named_tensors):
        for name, tensor in named_tensors:
            self.params[name].data.copy_(tensor)


def rank_main():
    """One torchrun rank: job.main, with the engine stood in for on the sampler rank."""
    import types

    from torch.distributed.elastic.multiprocessing.errors import record

    sys.modules["sampler"] = module = types.ModuleType("sampler")
    module.Sampler = GenerateEngine
    import job

    record(job.main)(sys.argv[1:])


def run(out, *flags):
    """One 1 + 1 run of job.py (the tiny model unless flags name another); its metrics
    rows (train steps only)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += [__file__, "--learners", "1", "--model", "tiny", "--out-dir", out, "--overwrite", *flags]
    cmd += ["--prompts-per-step", "16", "--samples-every", "0"]
    t = time.time()
    result = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(f"[{time.time() - t:.0f} s, exit {result.returncode}] {' '.join(cmd[5:])}", flush=True)
    if result.returncode != 0:
        print(result.stdout[-3000:])
        for name in sorted(os.listdir(os.path.join(out, "logs"))) if os.path.isdir(os.path.join(out, "logs")) else []:
            print(f"--- {name}\n" + open(os.path.join(out, "logs", name)).read()[-3000:])
    path = os.path.join(out, "metrics.jsonl")
    return [r for r in map(json.loads, open(path)) if "loss" in r] if os.path.exists(path) else []


def check(ok, what):
    print(f"{'PASS' if ok else 'FAIL'} {what}", flush=True)
    return ok


def main():
    import torch

    gpu = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if gpu else "no GPU"
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {name}", flush=True)
    out = os.path.join(ROOT, "runs", "gpu_learner_check")
    steps = ["--steps", "6", "--save-every", "3", "--eval-every", "3", "--eval-size", "32"]
    ahead = run(f"{out}/ahead", *steps)
    exact = ["--steps", "4", "--save-every", "2", "--eval-every", "0", "--max-staleness", "0", "--dtype", "float32"]
    on_policy = run(f"{out}/on_policy", *exact)
    resumed = run(f"{out}/resumed", *exact, "--resume", f"{out}/on_policy/checkpoints/step_2")

    from config import cpu_has_bf16, precision

    dtype = precision(None, bool(gpu), cpu_has_bf16())  # what the run's default resolved to
    check([r["step"] for r in ahead] == list(range(6)), f"6 steps, --max-staleness 1, --dtype auto ({dtype})")
    evals = [json.loads(line) for line in open(f"{out}/ahead/metrics.jsonl") if "eval_accuracy" in line]
    accuracy = [round(r["eval_accuracy"], 3) for r in evals]
    check([r["step"] for r in evals] == [0, 3, 6], f"held-out evals at steps 0, 3, 6: {accuracy}")
    check(all(0 < r["grad_norm"] < float("inf") for r in ahead), "grad norms finite and non-zero")
    check(os.path.exists(f"{out}/ahead/checkpoints/step_3"), f"{dtype} checkpoint saved at step 3")
    # bf16 on both sides: per-token gaps of a few 1e-2 are bf16 rounding through the
    # network; stale or wrong weights give gaps of order 1.
    bound = 0.05 if dtype == "bfloat16" else 1e-4
    worst = ahead[0]["mismatch_mean"] if ahead else float("inf")
    check(worst < bound, f"{dtype} sampler vs learner log-probs at step 0: mean |diff| {worst:.2e} < {bound}")
    worst = max((r["mismatch_mean"] for r in on_policy), default=float("inf"))
    check(
        len(on_policy) == 4 and worst < 1e-4,
        f"float32, on-policy, after every sync: mean |diff| {worst:.2e} < 1e-4 (the sampler holds the learner's weights)",
    )
    # --compile: torch.compile's kernels (Triton on a GPU) inside FSDP2's hooks, the same
    # numbers as the sampler's in float32.
    compiled = run(f"{out}/compiled", *exact, "--compile")
    worst = max((r["mismatch_mean"] for r in compiled), default=float("inf"))
    check(
        len(compiled) == 4 and worst < 1e-4,
        f"--compile, float32, on-policy: 4 steps, mean |diff| after every sync {worst:.2e} < 1e-4",
    )
    from safetensors.torch import load_file

    final = [f"{out}/{name}/final/model.safetensors" for name in ("on_policy", "resumed")]
    gap = float("inf")
    if all(map(os.path.exists, final)):
        a, b = map(load_file, final)
        gap = max((a[k] - b[k]).abs().max().item() for k in a)
    same = [r["reward_mean"] for r in on_policy[2:]] == [r["reward_mean"] for r in resumed]
    check(
        same and len(resumed) == 2 and gap < 1e-6,
        f"resumed at step 2: steps 2-3's rewards equal, final weights within {gap:.1e} of the straight run's (< 1e-6)",
    )
    # The seed's model family: a tiny random Qwen3.5 composite (gated delta net beside
    # attention, tied embeddings, a vision tower in the checkpoint), bf16, trained text
    # model saved back as the composite. A high learning rate and a reward that varies
    # in every group move the weights at each step, so a sync that fails shows.
    from tests.plugins.hybrid_models import build_tiny_qwen3_5_composite

    composite = build_tiny_qwen3_5_composite(f"{out}/qwen3_5_model", tie_word_embeddings=True)
    hybrid = run(
        f"{out}/qwen3_5",
        *["--model", composite, "--dataset", "synthetic", "--dtype", "bfloat16", "--steps", "3", "--lr", "1e-2"],
        *["--warmup-steps", "0", "--max-staleness", "0", "--eval-every", "0", "--beta", "0", "--max-new-tokens", "16"],
        *["--rewards", "tests.plugins.hybrid_models:parity"],
    )
    worst = max((r["mismatch_mean"] for r in hybrid), default=float("inf"))
    saved = f"{out}/qwen3_5/final/config.json"
    architectures = json.load(open(saved))["architectures"] if os.path.exists(saved) else None
    check(
        len(hybrid) == 3 and worst < 1e-2 and architectures == ["Qwen3_5ForConditionalGeneration"],
        f"Qwen3.5 composite, bf16: 3 steps, mismatch after every sync {worst:.2e} < 1e-2, saved as {architectures}",
    )
    for label, rows in (("ahead", ahead[1:]), ("on-policy float32", on_policy[1:])):
        if rows:
            mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("step_s", "train_s", "sample_s", "sync_s")}
            print(
                f"figures ({label}): step {mean['step_s']:.2f} s, train {mean['train_s']:.2f} s, sample {mean['sample_s']:.2f} s"
                f" (transformers' generate, not vLLM), sync {mean['sync_s'] * 1e3:.0f} ms,"
                f" peak learner memory {max(r['peak_memory_mb_learner'] for r in rows):.0f} MB",
                flush=True,
            )
    if "--no-memory" in sys.argv or not gpu:
        return
    # Chunked against dense log-probs, gradient checkpointing, then bf16 against float32
    # on one sequence (float32 attention on 4 x 4096 positions did not fit on an H200:
    # docs/results.md, Memory).
    for flags in (
        "--dtype bfloat16 --tokens 16384",
        "--dtype bfloat16 --tokens 16384 --gradient-checkpointing",
        "--dtype bfloat16 --tokens 4096",
        "--dtype float32 --tokens 4096",
    ):
        cmd = [sys.executable, "benchmarks/memory.py", "--hidden-size", "896", "--layers", "24", "--seq-len", "4096"]
        cmd += ["--steps", "5", *flags.split()]
        print(f"$ {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, cwd=ROOT)


if __name__ == "__main__":
    rank_main() if "RANK" in os.environ else main()
