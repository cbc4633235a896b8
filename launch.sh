#!/usr/bin/env bash
# Start a GRPO run with torchrun; every argument is passed on to grpo.py.
#
#   bash launch.sh                        # GPUs: all of them, Qwen2.5-0.5B on GSM8K; no GPU: the tiny CPU default
#   bash launch.sh --steps 200 --lr 2e-6  # any grpo.py flag
#   NPROC=4 LEARNERS=2 bash launch.sh     # ranks on this node, and learners in all
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 bash launch.sh   # on each node
#   bash launch.sh test [pytest args]     # the test suite
#
# The first call builds .venv from requirements.txt (GPU) or requirements-cpu.txt.
set -euo pipefail
cd "$(dirname "$0")"

GPUS=$( { ls /proc/driver/nvidia/gpus 2>/dev/null || true; } | wc -l)
REQUIREMENTS=$( [ "$GPUS" -gt 0 ] && echo requirements.txt || echo requirements-cpu.txt )
STAMP=".venv/installed-$(sha1sum "$REQUIREMENTS" | cut -c1-12)"
if [ -z "${PYTHON:-}" ] && [ ! -f "$STAMP" ]; then
    python3 -m venv .venv
    .venv/bin/pip install -q -r "$REQUIREMENTS"
    # PyPI's torchvision does not match the CPU torch build and breaks transformers'
    # model imports; a text model needs none of these.
    .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    touch "$STAMP"
fi
PYTHON=${PYTHON:-.venv/bin/python}

if [ "${1:-}" = "test" ]; then
    shift
    exec "$PYTHON" -m pytest -q tests "$@"
fi

NNODES=${NNODES:-1}
if [ "$GPUS" -gt 0 ]; then
    # One rank per GPU, half of them learning; one GPU is shared by a learner and a sampler.
    NPROC=${NPROC:-$(( GPUS > 1 ? GPUS : 2 ))}
    LEARNERS=${LEARNERS:-$(( NPROC * NNODES / 2 ))}
else
    # The CPU default: 2 learners, so FSDP really shards, and 1 sampler.
    NPROC=${NPROC:-3}
    LEARNERS=${LEARNERS:-2}
fi

exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" \
    --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" \
    --master-port "${MASTER_PORT:-29500}" \
    --nproc-per-node "$NPROC" \
    grpo.py --learners "$LEARNERS" "$@"
