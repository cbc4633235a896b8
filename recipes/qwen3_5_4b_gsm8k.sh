#!/usr/bin/env bash
# The seed recipe as one command: Qwen/Qwen3.5-4B on GSM8K, one node of 8 GPUs, 4 learners
# (FSDP2) and 4 samplers (vLLM, 0.8 of each GPU), 8 prompts x 8 completions of up to 4096
# new tokens per step, the clipped-ratio loss at epsilon 0.2, accuracy + format rewards.
# Every other flag keeps job.py's default (docs/results.md, "The seed recipe", maps each line).
#
#   bash recipes/qwen3_5_4b_gsm8k.sh                    # then any job.py flag, e.g. --steps 500
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch.sh test --version >/dev/null  # builds .venv on a fresh machine
.venv/bin/pip install -q -r recipes/requirements-qwen3_5.txt
# causal-conv1d, the learner's short convolution as one CUDA kernel, is optional: PyPI has
# only its source, which builds with nvcc of the CUDA that torch was built for (13.0).
# Without --no-build-isolation pip would build it in a scratch environment with whatever
# torch the index serves, and the kernel would not load beside the pinned one: it builds
# here against .venv's own torch. Where it cannot build, transformers runs the same
# convolution in plain torch (slower, same numbers), and the recipe goes on.
TORCH_CUDA=$(.venv/bin/python -c 'import torch; print(torch.version.cuda or "")')
NVCC_CUDA=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\),.*/\1/p' || true)
if [ -n "$NVCC_CUDA" ] && [ "$NVCC_CUDA" = "$TORCH_CUDA" ]; then
    .venv/bin/pip install -q ninja packaging wheel setuptools
    .venv/bin/pip install -q --no-build-isolation causal-conv1d==1.7.0 ||
        echo "recipe: causal-conv1d did not build; the learner uses transformers' torch convolution (slower)"
else
    echo "recipe: skipping causal-conv1d (it needs nvcc of CUDA ${TORCH_CUDA:-?}, found ${NVCC_CUDA:-none}); the learner uses transformers' torch convolution (slower)"
fi
NPROC=8 LEARNERS=4 exec bash launch.sh \
    --model Qwen/Qwen3.5-4B \
    --dataset gsm8k \
    --prompts-per-step 8 \
    --group-size 8 \
    --max-new-tokens 4096 \
    --sampler-gpu-memory 0.8 \
    --epsilon 0.2 \
    --rewards accuracy,format \
    --out-dir runs/qwen3_5_4b_gsm8k \
    "$@"
