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

# The GPUs this job may use: CUDA_VISIBLE_DEVICES where it is set (SLURM, a shared box),
# else every GPU the driver lists (comm.visible_gpus reads them the same way).
GPUS=0
if [ -d /proc/driver/nvidia/gpus ]; then
    if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
        GPUS=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -cv -e '^ *$' -e '^-1$' || true)
    else
        GPUS=$(ls /proc/driver/nvidia/gpus | wc -l)
    fi
fi
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
# Ranks per node and learners (comm.default_layout, a table in the README): one rank per
# GPU, learners and samplers in powers of two so that the default batch divides; on one
# GPU a learner and a sampler share it; on CPU 2 learners and 1 sampler.
read -r DEFAULT_NPROC DEFAULT_LEARNERS < <("$PYTHON" -c 'import sys, comm; print(*comm.default_layout(int(sys.argv[1]), int(sys.argv[2])))' "$GPUS" "$NNODES")
if [ -z "${NPROC:-}" ]; then
    NPROC=$DEFAULT_NPROC
    LEARNERS=${LEARNERS:-$DEFAULT_LEARNERS}
fi
LEARNERS=${LEARNERS:-$(( NPROC * NNODES / 2 > 0 ? NPROC * NNODES / 2 : 1 ))}

exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" \
    --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" \
    --master-port "${MASTER_PORT:-29500}" \
    --nproc-per-node "$NPROC" \
    grpo.py --learners "$LEARNERS" "$@"
