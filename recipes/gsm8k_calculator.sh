#!/usr/bin/env bash
# GSM8K with a calculator: Qwen/Qwen2.5-1.5B-Instruct on one node of 8 GPUs (4 learners,
# 4 samplers), episodes of up to 4 turns in which the model may call `calculator` in the
# Hermes format its template teaches (<tool_call>{"name": "calculator", "arguments":
# {"expression": "..."}}</tool_call>); each result comes back as a tool message, and the
# last answer is scored for accuracy and format. --max-new-tokens is the whole episode's
# budget after the prompt, the tool messages included (README, "Extending").
#
#   bash recipes/gsm8k_calculator.sh                    # then any job.py flag, e.g. --steps 500
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=8 LEARNERS=4 exec bash launch.sh \
    --model Qwen/Qwen2.5-1.5B-Instruct \
    --dataset gsm8k \
    --tools calculator \
    --max-turns 4 \
    --prompts-per-step 16 \
    --group-size 8 \
    --max-new-tokens 1536 \
    --rewards accuracy,format \
    --out-dir runs/gsm8k_calculator \
    "$@"
