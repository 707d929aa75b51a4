#!/usr/bin/env bash
# How run-workers.sh scales on this box: for each N given, a coordinator on loopback
# and N workers (one a GPU) train STEPS steps from scratch, then scripts/scaling.py
# prints each run's time a step, tokens/s, scaling against the first N and whether
# every step's loss equals the first run's.
#
#   bash scripts/scaling.sh DATA_DIR N [N ...] [-- --set TABLE.KEY=VALUE ...]
#
# The --set options change the config of the coordinator and of the workers alike.
#   STEPS (20)      steps a run; the first 5 are not timed (compiles, graph capture)
#   CONFIG          config.toml
#   RUNS            runs/scaling: save directories gpusN and logs
#   WORKER_OPTIONS  more deggs-worker options (--backend cpu for CPU workers; the
#                   default is --backend gpu, so a worker without a GPU fails)
#   PYTHON          python3: the interpreter of scaling.py (and of deggs if not installed)
# Example: bash scripts/scaling.sh data 1 2 4 8 -- --set training.chunk_size=20480
set -euo pipefail
usage="usage: $0 DATA_DIR N [N ...] [-- --set TABLE.KEY=VALUE ...]"
[[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
data="$1"; shift
counts=()
while [[ $# -gt 0 && "$1" != "--" ]]; do counts+=("$1"); shift; done
[[ $# -gt 0 ]] && shift  # the --
[[ ${#counts[@]} -ge 1 ]] || { echo "$usage" >&2; exit 2; }
for n in "${counts[@]}"; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "$0: a GPU count must be a positive integer, not '$n'" >&2; exit 2; }
done
if [[ $(printf '%s\n' "${counts[@]}" | sort | uniq -d) ]]; then
    echo "$0: each GPU count once (a run's save directory is named by it)" >&2; exit 2
fi
[[ -f "$data/input.bin" ]] || { echo "$0: no $data/input.bin (deggs-prepare makes it)" >&2; exit 2; }
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${STEPS:-20}" config="${CONFIG:-config.toml}" runs="${RUNS:-runs/scaling}"
python="${PYTHON:-python3}"
coordinator_cmd=(deggs-coordinator) worker_cmd="deggs-worker"  # installed, else the checkout's
if ! command -v deggs-coordinator >/dev/null; then
    coordinator_cmd=("$python" -m deggs coordinator) worker_cmd="$python -m deggs worker"
    export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi
coordinator="" workers=""
stop() { kill -TERM $coordinator $workers 2>/dev/null || true; }
trap stop EXIT
trap "exit 130" INT TERM  # the EXIT trap then stops the run

mkdir -p "$runs"
dirs=()
for n in "${counts[@]}"; do
    dir="$runs/gpus$n"
    rm -rf "$dir"
    # port 0: any free one, read back from the coordinator's log
    "${coordinator_cmd[@]}" --config "$config" --host 127.0.0.1 --port 0 --save-dir "$dir" \
        --max-steps "$steps" "$@" > "$runs/coordinator$n.log" 2>&1 &
    coordinator=$!
    port=""
    for _ in $(seq 300); do
        port=$(grep -o 'listening on [0-9.]*:[0-9]*' "$runs/coordinator$n.log" | grep -o '[0-9]*$' || true)
        [[ -n "$port" ]] && break
        kill -0 "$coordinator" 2>/dev/null || break  # it failed: say so at once
        sleep 0.1
    done
    if [[ -z "$port" ]]; then
        echo "$0: the coordinator did not start ($runs/coordinator$n.log):" >&2
        tail -n 5 "$runs/coordinator$n.log" >&2
        exit 1
    fi
    DEGGS_WORKER="$worker_cmd" "$root/run-workers.sh" 127.0.0.1 "$n" -- --config "$config" \
        --data-dir "$data" --port "$port" --backend gpu "$@" ${WORKER_OPTIONS:-} > "$runs/workers$n.log" 2>&1 &
    workers=$!
    # The coordinator exits at step STEPS; the workers leave when it says the run is
    # finished, just before. Workers gone with the coordinator still there 30 s later
    # have failed.
    while kill -0 "$coordinator" 2>/dev/null && kill -0 "$workers" 2>/dev/null; do sleep 0.2; done
    for _ in $(seq 150); do kill -0 "$coordinator" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$coordinator" 2>/dev/null; then
        echo "$0: the workers stopped before step $steps (see $runs/workers$n.log)" >&2
        exit 1
    fi
    status=0
    wait "$coordinator" || status=$?
    coordinator=""
    # the workers leave once the run is finished; any still there after 30 s are stopped
    for _ in $(seq 300); do kill -0 "$workers" 2>/dev/null || break; sleep 0.1; done
    kill -TERM "$workers" 2>/dev/null || true
    wait "$workers" 2>/dev/null || true
    workers=""
    [[ $status -eq 0 ]] || { echo "$0: the coordinator failed (see $runs/coordinator$n.log)" >&2; exit 1; }
    dirs+=("$dir")
done
# --workers: a run with fewer workers than asked for (one crashed, or found no GPU) fails
"$python" "$root/scripts/scaling.py" --workers "$(IFS=,; echo "${counts[*]}")" "${dirs[@]}"
