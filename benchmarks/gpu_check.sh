#!/usr/bin/env bash
# The first thing to run on a machine with one GPU (and the network): builds .venv, runs
# the hub default (Qwen2.5-0.5B-Instruct on GSM8K) as 1 learner + 1 sampler sharing the
# GPU for 3 steps, then a 2-step on-policy run, and prints one PASS/FAIL line per check
# and the figures. About 5-8 minutes on one 80-140 GB GPU, most of it install and download.
#
#   bash benchmarks/gpu_check.sh [extra job.py flags]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
rm -rf "$OUT"
# One GPU, shared by the learner and the sampler, whatever the node has: on an 8-GPU node
# launch.sh would otherwise give each rank a GPU of its own, and the shared path, with its
# memory fractions and the gloo weight group, would go untested.
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export NPROC=2 LEARNERS=1
COMMON=(--steps 3 --eval-every 0 --samples-every 0 "$@")

bash launch.sh "${COMMON[@]}" --out-dir "$OUT/ahead" || echo "FAIL run 1 (--max-staleness 1) exited $?"
bash launch.sh "${COMMON[@]}" --steps 2 --max-staleness 0 --out-dir "$OUT/on_policy" || echo "FAIL run 2 (--max-staleness 0) exited $?"
GPU_MB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "${CUDA_VISIBLE_DEVICES%%,*}" 2>/dev/null || nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)

.venv/bin/python - "$OUT" "$GPU_MB" <<'EOF'
import json, os, sys

out, gpu_mb = sys.argv[1], float(sys.argv[2])


def rows(run):
    path = os.path.join(out, run, "metrics.jsonl")
    return [r for r in map(json.loads, open(path)) if "reward_mean" in r] if os.path.exists(path) else []


def check(ok, what):
    print(f"{'PASS' if ok else 'FAIL'} {what}")


ahead, on_policy = rows("ahead"), rows("on_policy")
check(len(ahead) >= 1 and ahead[0]["step"] == 0, "step 0 completes")
check(len(ahead) == 3, "3 steps complete with --max-staleness 1")
# bf16 on both sides: a log-prob is a sum of bf16 roundings (8-bit mantissa, about 0.4%
# relative each) through the network, so per-token gaps of a few 1e-2 are normal and a
# broken sync (stale or wrong weights) gives gaps of order 1.
for name, rs in (("on-policy run", on_policy), ("first step of run 1", ahead[:1])):
    worst = max((r["mismatch_mean"] for r in rs), default=float("inf"))
    check(worst < 0.05, f"sampler vs learner bf16 log-probs after a sync ({name}): mean |diff| {worst:.4f} < 0.05")
# The sampler shares the GPU with the learner: vLLM's fraction is 0.3 of it there.
sampler_mb = max((r["peak_memory_mb_sampler"] for r in ahead), default=float("inf"))
check(sampler_mb <= 0.3 * gpu_mb, f"sampler GPU memory {sampler_mb:.0f} MB within its fraction 0.3 of {gpu_mb:.0f} MB")
# ... and it is GPU memory, not the process's host RSS (weights reach this sampler through
# gloo, so its weight device is the CPU): vLLM allocates its KV cache up front, so its
# peak is most of its fraction.
check(sampler_mb >= 0.15 * gpu_mb, f"sampler peak {sampler_mb:.0f} MB is GPU memory: at least half its fraction")
same = bool(on_policy) and bool(ahead) and on_policy[0]["reward_mean"] == ahead[0]["reward_mean"] and on_policy[0]["tokens_sampled"] == ahead[0]["tokens_sampled"]
check(same, "a second run reproduces step 0's rewards and sampled tokens (seeded sampling on GPU)")
if ahead:
    last = ahead[-1]
    step = sum(r["step_s"] for r in ahead[1:]) / max(1, len(ahead) - 1)
    sync = sum(r["sync_s"] for r in ahead) / len(ahead)
    print(f"figures: step {step:.2f} s, sync {sync * 1e3:.0f} ms (memcpy of the same bytes {last['sync_memcpy_s'] * 1e3:.2f} ms),"
          f" sampled {sum(r['tokens_sampled'] for r in ahead) / sum(r['sample_s'] for r in ahead):.0f} tokens/s,"
          f" peak learner memory {max(r['peak_memory_mb_learner'] for r in ahead):.0f} MB, sampler {sampler_mb:.0f} MB")
EOF

# The seed's model family: a tiny Qwen3.5 composite (gated delta nets, a vision tower in
# the checkpoint) through the whole loop in bf16 on the GPU. vLLM's Qwen3.5 module imports
# torchvision (through its Qwen3-VL code) even for text, with the CUDA torchvision that
# launch.sh keeps there. A high learning rate and a reward that varies in every group move
# the weights at each step, so a sync that fails shows in the mismatch.
COMPOSITE=$(.venv/bin/python -c 'import sys; sys.path.insert(0, "."); from tests.plugins.hybrid_models import build_tiny_qwen3_5_composite as b; print(b(sys.argv[1], tie_word_embeddings=True))' "$OUT/qwen3_5_model")
bash launch.sh --model "$COMPOSITE" --dataset synthetic --dtype bfloat16 --steps 2 --lr 1e-2 --warmup-steps 0 \
    --max-staleness 0 --eval-every 0 --samples-every 0 --beta 0 --max-new-tokens 16 \
    --rewards tests.plugins.hybrid_models:parity --out-dir "$OUT/qwen3_5" || echo "FAIL the Qwen3.5 composite's run exited $?"
.venv/bin/python - "$OUT/qwen3_5" <<'EOF'
import json, os, sys

out = sys.argv[1]
path = os.path.join(out, "metrics.jsonl")
rows = [r for r in map(json.loads, open(path)) if "loss" in r] if os.path.exists(path) else []
worst = max((r["mismatch_mean"] for r in rows), default=float("inf"))
saved = os.path.join(out, "final", "config.json")
architectures = json.load(open(saved))["architectures"] if os.path.exists(saved) else None
ok = len(rows) == 2 and worst < 1e-2 and architectures == ["Qwen3_5ForConditionalGeneration"]
print(f"{'PASS' if ok else 'FAIL'} Qwen3.5 composite, bf16, on the GPU: {len(rows)} of 2 steps, mismatch after every sync"
      f" {worst:.2e} < 1e-2, saved as {architectures}")
EOF
