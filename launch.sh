#!/usr/bin/env bash
# Start a GRPO run with torchrun; every argument is passed on to job.py.
#
#   bash launch.sh                        # GPUs: all of them, Qwen2.5-0.5B on GSM8K; no GPU: the tiny CPU default
#   bash launch.sh --steps 200 --lr 2e-6  # any job.py flag
#   NPROC=4 LEARNERS=2 bash launch.sh     # ranks on this node, and learners in all
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 bash launch.sh   # on each node
#   RESTARTS=3 bash launch.sh             # a failed rank restarts the job from its newest checkpoint, 3 times at most
#   bash launch.sh test [pytest args]     # the test suite (-m "not system": the fast tier)
#   bash launch.sh gpus                   # how many GPUs this node shows (nothing is installed)
#   PYTHON3=python3.12 bash launch.sh     # the Python .venv is built with (else preflight.py picks)
#
# The first call builds .venv from requirements.txt (GPU) or requirements-cpu.txt; the
# first `test` adds requirements-test.txt.
set -euo pipefail
cd "$(dirname "$0")"

# The GPUs this job may use: CUDA_VISIBLE_DEVICES where it is set (SLURM, a shared box),
# else every GPU the driver lists, from its /proc folder or, where that is absent (WSL2,
# some containers), from `nvidia-smi -L` (comm.visible_gpus counts the same way).
DRIVER_GPUS=0
if [ -d /proc/driver/nvidia/gpus ]; then
    DRIVER_GPUS=$(ls /proc/driver/nvidia/gpus | wc -l)
elif command -v nvidia-smi >/dev/null 2>&1; then
    DRIVER_GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
GPUS=$DRIVER_GPUS
if [ "$DRIVER_GPUS" -gt 0 ] && [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    GPUS=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -cv -e '^ *$' -e '^-1$' || true)
fi
if [ "${1:-}" = "gpus" ]; then  # what this script found, for a check by hand or a test
    echo "$GPUS"
    exit 0
fi
# A node that cannot run this is refused here in one line (preflight.py), before any
# install: a driver too old for torch's CUDA build, which would fail every rank later.
if [ "$GPUS" -gt 0 ]; then
    python3 preflight.py driver || exit 2
fi
REQUIREMENTS=$( [ "$GPUS" -gt 0 ] && echo requirements.txt || echo requirements-cpu.txt )
STAMP=".venv/installed-$(sha1sum "$REQUIREMENTS" | cut -c1-12)"
if [ -z "${PYTHON:-}" ] && [ ! -f "$STAMP" ]; then
    # A Python that vLLM supports: PYTHON3, else the first of python3, python3.12, ... that is one.
    BASE_PYTHON=${PYTHON3:-}
    [ -n "$BASE_PYTHON" ] || BASE_PYTHON=$(python3 preflight.py python) || exit 2
    "$BASE_PYTHON" -m venv .venv
    .venv/bin/pip install -q -r "$REQUIREMENTS"
    # GPUs: FlashInfer's prebuilt kernels (Hopper and newer). Without them vLLM downloads
    # and JIT-compiles them at every engine start, for minutes, while the learners wait.
    if [ "$GPUS" -gt 0 ]; then
        .venv/bin/vllm download-kernels >/dev/null ||
            echo "launch.sh: vllm download-kernels failed; FlashInfer will build its kernels at the first start (minutes)"
    fi
    # CPU only: PyPI's torchvision does not match the CPU torch build and breaks
    # transformers' model imports. On GPUs the CUDA torchvision that vLLM brings is kept:
    # vLLM's Qwen3.5 module imports it (through its Qwen3-VL code) even for text.
    if [ "$GPUS" -eq 0 ]; then
        .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    touch "$STAMP"
fi
PYTHON=${PYTHON:-.venv/bin/python}

if [ "${1:-}" = "test" ]; then
    shift
    # The suite's own packages (requirements-test.txt: what builds the real pretrained model).
    TEST_STAMP=".venv/installed-test-$(sha1sum requirements-test.txt | cut -c1-12)"
    if [ "$PYTHON" = .venv/bin/python ] && [ ! -f "$TEST_STAMP" ]; then
        .venv/bin/pip install -q -r requirements-test.txt
        touch "$TEST_STAMP"
    fi
    exec "$PYTHON" -m pytest -q tests "$@"
fi

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
# Ranks per node and learners (comm.default_layout, README "GPUs, many nodes and clusters"): one rank per
# GPU, learners and samplers in powers of two so that the default batch divides; on one
# GPU a learner and a sampler share it; on CPU 2 learners and 1 sampler.
# One Python start (it imports torch) for both: the layout, and a free port for one node.
read -r DEFAULT_NPROC DEFAULT_LEARNERS FREE_PORT < <("$PYTHON" -c 'import sys, comm; print(*comm.default_layout(int(sys.argv[1]), int(sys.argv[2])), comm.free_port())' "$GPUS" "$NNODES")
if [ -z "${NPROC:-}" ]; then
    NPROC=$DEFAULT_NPROC
    LEARNERS=${LEARNERS:-$DEFAULT_LEARNERS}
fi
LEARNERS=${LEARNERS:-$(( NPROC * NNODES / 2 > 0 ? NPROC * NNODES / 2 : 1 ))}
for arg in "$@"; do
    case "$arg" in -h | --help) exec "$PYTHON" job.py --help ;; esac
done

# RESTARTS=N: when a rank fails (a crash, a kill, a hang the watchdog sees), torchrun
# restarts the whole job, N times at most (its --max-restarts), and each start continues
# from the newest complete checkpoint (--resume auto, unless a --resume is given).
# 0, the default: a failure ends the job within seconds, for a person to look at.
RESTARTS=${RESTARTS:-0}
[[ "$RESTARTS" =~ ^[0-9]+$ ]] || { echo "launch.sh: RESTARTS must be a whole number, got '$RESTARTS'" >&2; exit 2; }
RESUME=()
if [ "$RESTARTS" -gt 0 ]; then
    RESUME=(--resume auto)
    for arg in "$@"; do
        case "$arg" in --resume | --resume=*) RESUME=() ;; esac
    done
fi

# A config that cannot work is refused here, once, in one line (exit 2), before torchrun
# starts a rank: job.py's own checks, with this node's layout and no model or store.
# It prints the run's folder, where the logs go.
OUT_DIR=$(WORLD_SIZE=$(( NPROC * NNODES )) LOCAL_WORLD_SIZE=$NPROC GROUP_RANK=$NODE_RANK LOCAL_RANK=0 \
    "$PYTHON" job.py check --learners "$LEARNERS" "$@" "${RESUME[@]}") || exit $?

# One node: a free port, so that two jobs on one machine do not collide on torchrun's 29500.
if [ -z "${MASTER_PORT:-}" ]; then
    MASTER_PORT=29500
    [ "$NNODES" -eq 1 ] && MASTER_PORT=$FREE_PORT
fi
TORCHRUN=("$PYTHON" -m torch.distributed.run
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --master-addr "${MASTER_ADDR:-127.0.0.1}"
    --master-port "$MASTER_PORT"
    --nproc-per-node "$NPROC"
    --max-restarts "$RESTARTS"
    job.py --learners "$LEARNERS" "$@" "${RESUME[@]}")

# GRPO_VERBOSE=1: every rank's output and torchrun's own on the console, as they come.
if [ -n "${GRPO_VERBOSE:-}" ] && [ "${GRPO_VERBOSE}" != 0 ]; then
    exec "${TORCHRUN[@]}"
fi

# Quiet (the default): each rank sends its output to $OUT_DIR/logs/rank_<r>.log and keeps
# this console for its progress and warnings (console.py); torchrun's own banner and
# failure table go to torchrun.log. A rank that fails says so itself (and leaves the
# marker logs/failed); for one that was killed, which cannot, this script names it from
# torchrun's report. Preemption: the ranks leave logs/preempted and exit 75, and so does
# this script. torchrun runs in the background so that this script can speak after it:
# SIGTERM and SIGHUP are passed on; SIGINT (Ctrl-C) reaches torchrun from the terminal
# itself, as both are in its foreground process group.
LOGS="$OUT_DIR/logs"
TORCHRUN_LOG="$LOGS/torchrun.log"
[ "$NNODES" -gt 1 ] && TORCHRUN_LOG="$LOGS/torchrun_node$NODE_RANK.log"
mkdir -p "$LOGS"
rm -f "$LOGS/failed" "$LOGS/preempted" "$LOGS"/peer_error_*
"${TORCHRUN[@]}" 2>"$TORCHRUN_LOG" &
PID=$!
SIGNALLED=""
trap 'SIGNALLED=1; kill -TERM "$PID" 2>/dev/null || true' TERM HUP
trap 'SIGNALLED=1' INT
while kill -0 "$PID" 2>/dev/null; do
    wait "$PID" || true
done
STATUS=0
wait "$PID" || STATUS=$?
trap - TERM HUP INT

tail_of() {  # the last lines of a log, indented; a progress bar's redraws count as one
    awk '{n = split($0, frames, "\r"); line = frames[n]; if (line ~ /[^[:space:]]/) last[++count] = line}
        END {for (i = (count > 12 ? count - 11 : 1); i <= count; i++) print "    " last[i]}' "$1" || true
}
if [ "$STATUS" -ne 0 ] && [ ! -f "$LOGS/failed" ]; then
    if [ -f "$LOGS/preempted" ]; then
        exit 75  # rank 0 said what it saved
    fi
    if [ -n "$SIGNALLED" ]; then  # signalled, and the ranks were stopped before they could save
        LATEST=$(cat "$OUT_DIR/checkpoints/latest" 2>/dev/null || true)
        echo
        if [ -n "$LATEST" ]; then
            echo "stopped by a signal before a checkpoint of this step was saved: the newest is $OUT_DIR/checkpoints/$LATEST (--resume continues from it); logs in $LOGS"
        else
            echo "stopped by a signal before any checkpoint was saved: nothing to resume; logs in $LOGS"
        fi
        exit "$STATUS"
    fi
    # torchrun's failures, each as "rank : 2 (local_rank: 2)", "exitcode : -9 (pid: ...)" and
    # "traceback : Signal 9 (SIGKILL) received by PID ...": its root cause first, then the
    # others. Its root cause is the earliest timestamp, in whole seconds, and a killed rank's
    # is the moment torchrun notices it, so a peer that raised on the broken connection can
    # come first: such a rank leaves logs/peer_error_<rank> (console.Failures) and is skipped.
    FAILURES=$(awk '/Root Cause/ {root = 1}
        $1 == "rank" && $2 == ":" {rank = $3}
        $1 == "exitcode" {code = $3}
        $1 == "traceback" {sub(/^ *traceback *: */, ""); entry = rank " " code " " $0
                           if (root) first = entry; else rest[++n] = entry}
        END {if (first != "") print first; for (i = 1; i <= n; i++) print rest[i]}' "$TORCHRUN_LOG") || true
    RANK="" CODE="" WHY=""
    while read -r R C W; do
        [ -n "$R" ] || continue
        [ -n "$RANK" ] || { RANK=$R CODE=$C WHY=$W; }
        if [ ! -f "$LOGS/peer_error_$R" ]; then
            RANK=$R CODE=$C WHY=$W
            break
        fi
    done <<<"$FAILURES"
    if [ -n "$RANK" ] && [ -f "$LOGS/rank_$RANK.log" ]; then
        echo
        WHO=$(head -n 1 "$LOGS/rank_$RANK.log" | sed -n 's/^\(rank [0-9]* ([a-z]*)\),.*/\1/p')
        echo "${WHO:-rank $RANK} died with status $CODE${WHY:+ ($WHY)}; the end of its log, $LOGS/rank_$RANK.log:"
        tail_of "$LOGS/rank_$RANK.log"
    else
        echo
        echo "torchrun failed with status $STATUS; the end of its log, $TORCHRUN_LOG:"
        tail_of "$TORCHRUN_LOG"
    fi
fi
exit "$STATUS"
