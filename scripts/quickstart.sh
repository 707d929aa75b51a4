#!/usr/bin/env bash
# Install deggs into .venv and train a small model on this machine's CPU: a coordinator
# and two workers on loopback, on the built-in corpus, then sample from the result.
#
#   bash scripts/quickstart.sh [STEPS]      (default 30 steps)
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-30}"
run=runs/quickstart

if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
fi
# Every time: a .venv left from an older checkout would run that checkout's code.
.venv/bin/python -m pip install --quiet . ||   # a regular install, as users make it
    { echo "quickstart: installing deggs into .venv failed (pip's message is above)" >&2; exit 1; }
bin="$PWD/.venv/bin"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

rm -rf "$run"
mkdir -p "$run"
$bin/deggs-prepare --config small --out "$run/data"
$bin/deggs-print-arch --config small | tail -n 2

workers=()
cleanup() { kill -TERM "${workers[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

$bin/deggs-coordinator --config small --data-dir "$run/data" --port 0 --save-dir "$run/checkpoints" \
    --max-steps "$steps" > >(tee "$run/coordinator.log") 2>&1 &
coordinator=$!
port=""
for _ in $(seq 100); do
    port=$(grep -o 'listening on [0-9.]*:[0-9]*' "$run/coordinator.log" 2>/dev/null | grep -o '[0-9]*$' || true)
    [[ -n "$port" ]] && break
    sleep 0.1
done
[[ -n "$port" ]] || { echo "the coordinator did not start" >&2; exit 1; }

# No --config: the workers adopt the coordinator's. They run in $run, away from the
# checkout's ./config.toml, which a worker would read otherwise.
for i in 1 2; do
    (cd "$run" && exec "$bin/deggs-worker" 127.0.0.1 --port "$port" \
        --data-dir data --backend cpu --threads 1 > "worker$i.log" 2>&1) &
    workers+=($!)
done
while kill -0 "$coordinator" 2>/dev/null; do
    alive=0
    for w in "${workers[@]}"; do kill -0 "$w" 2>/dev/null && alive=1; done
    if [[ $alive == 0 ]]; then
        echo "the workers stopped; see $run/worker*.log" >&2
        tail -n 3 "$run"/worker*.log >&2
        kill -TERM "$coordinator"
        exit 1
    fi
    sleep 1
done
cleanup

echo
echo "=== sampling from the trained model ($run/checkpoints) ==="
$bin/deggs-generate --load-dir "$run/checkpoints" --data-dir "$run/data" --tokens 64
