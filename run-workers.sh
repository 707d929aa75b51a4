#!/usr/bin/env bash
# One deggs worker per GPU of this machine, each pinned with CUDA_VISIBLE_DEVICES.
#
#   ./run-workers.sh HOST [N_GPUS] [-- extra deggs-worker options]
#
# N_GPUS defaults to the count nvidia-smi reports, or to the GPUs an inherited
# CUDA_VISIBLE_DEVICES lists (a Slurm job's, say): worker i then gets its i-th entry, so
# a shared node's other GPUs are left alone. Each worker's CPU thread pools get
# nproc / N_GPUS threads. Ctrl-C (or SIGTERM) stops them all.
set -euo pipefail

usage="usage: $0 HOST [N_GPUS] [-- deggs-worker options...]"
if [[ $# -ge 1 && ( "$1" == "-h" || "$1" == "--help" ) ]]; then
    echo "$usage"
    echo "One deggs worker per GPU (N_GPUS: nvidia-smi's count), each with its own"
    echo "CUDA_VISIBLE_DEVICES and its output prefixed [gpu i]; Ctrl-C stops them all."
    echo "An inherited CUDA_VISIBLE_DEVICES limits the workers to the GPUs it lists."
    echo "DEGGS_WORKER replaces the worker command."
    exit 0
fi
if [[ $# -lt 1 ]]; then
    echo "$usage" >&2
    exit 2
fi
host="$1"; shift
gpus=""
if [[ $# -gt 0 && "$1" != "--" ]]; then gpus="$1"; shift; fi
if [[ $# -gt 0 && "$1" == "--" ]]; then shift; fi

devices=()
if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    IFS=, read -ra devices <<< "$CUDA_VISIBLE_DEVICES"
    gpus="${gpus:-${#devices[@]}}"
fi
if [[ -z "$gpus" ]]; then
    if ! command -v nvidia-smi >/dev/null; then
        echo "$0: nvidia-smi not found; give the number of GPUs as the second argument" >&2
        exit 2
    fi
    gpus=$(nvidia-smi --list-gpus | wc -l)
fi
if ! [[ "$gpus" =~ ^[0-9]+$ ]] || [[ "$gpus" -lt 1 ]]; then
    echo "$0: the number of GPUs must be a positive integer, not '$gpus'" >&2
    exit 2
fi
if [[ ${#devices[@]} -gt 0 && "$gpus" -gt ${#devices[@]} ]]; then
    echo "$0: $gpus workers asked for, but CUDA_VISIBLE_DEVICES lists ${#devices[@]} GPUs" >&2
    exit 2
fi

worker="${DEGGS_WORKER:-deggs-worker}"
# Each worker's CPU thread pools (NumPy's BLAS, OpenMP, numba) get its share of this
# machine's cores rather than all of them each: the workers' updates and Python then do
# not contend. A value set by the caller is kept.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys those two
share=$(( cores / gpus )); (( share >= 1 )) || share=1
for pool in OMP_NUM_THREADS OPENBLAS_NUM_THREADS MKL_NUM_THREADS NUMBA_NUM_THREADS; do
    export "$pool=${!pool:-$share}"
done
pids=()
stop() {
    trap - INT TERM
    echo "stopping ${#pids[@]} workers" >&2
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait
}
trap stop INT TERM

for ((i = 0; i < gpus; i++)); do
    # $! must be the worker itself (not a pipe stage), so it gets the signal
    device="${devices[i]:-$i}"
    CUDA_VISIBLE_DEVICES=$device $worker "$host" "$@" > >(sed -u "s/^/[gpu $device] /") 2>&1 &
    pids+=($!)
done
echo "started $gpus workers for $host" >&2
wait
