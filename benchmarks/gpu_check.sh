#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one script (one GPU is enough; the two-rank test skips on
# fewer): the gpu-marked tests, then configs/gpu1-random-1b.toml trained twice, as configured
# (one process per policy, paced, max_staleness = 1) and lock-step in one process (executor
# "local", max_staleness = 0), with the GPU's memory polled beside each run. Results go to
# $OUT (default bench-results/gpu): gpu-tests.log/.xml, gpu_run.json (step time, tokens/s, peak
# GPU memory per run and policy), each run's log, metrics.jsonl and failures.jsonl.
#
#   bash benchmarks/gpu_check.sh
#
# Needs the project importable (pip install -e '.[qwen,llama]', or PYTHONPATH=src with the
# dependencies installed) and pytest. STEPS=N changes the number of GRPO steps per run (default 4);
# SET="key=value ..." adds overrides to both runs (e.g. smaller models on a smaller card);
# TESTS="..." replaces the test selection (pytest arguments). On one H200, STEPS=3 took about
# 6.5 minutes in all: the tests 74 s, the paced run 124 s, the lock-step run 142 s (each run about
# 45 s of building and 40-50 s of evaluation before its first step); the summary reports torch's
# own peak memory per update (cuda/peak_*_gib, and cuda/memory_cap_gib where a process is capped)
# beside nvidia-smi's. On one H100, the tests took
# 108 s, the paced run 135 s and the lock-step run 148 s (STEPS=3). On one H200 with the static
# cache (8f8dcde): the tests 151 s, the paced run 130 s, the lock-step run 169 s; on 873c65b: the
# tests 134 s, the paced run 122 s, the lock-step run 152 s.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-results/gpu}
runs=${RUNS_DIR:-/tmp/mutualrl-gpu-check}
steps=${STEPS:-4}
mkdir -p "$out" "$runs"
extra=()
for kv in ${SET:-}; do extra+=(--set "$kv"); done
export PYTHONUNBUFFERED=1

device=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
echo "device: $device"
python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"

echo "== gpu-marked tests"
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -rA -s -q -o junit_family=xunit1 \
    --junitxml="$out/gpu-tests.xml" ${TESTS:-tests/policies/test_sharded_gpu.py \
    tests/policies/test_update_gpu.py tests/policies/test_generation.py tests/allocation/test_memory_cap.py} 2>&1 | tee "$out/gpu-tests.log"
echo "tests exit: ${PIPESTATUS[0]}"

train() {   # label, then --set overrides
    local label=$1; shift
    echo "== run $label"
    rm -rf "${runs:?}/$label"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$runs/$label-smi.csv" &
    local smi=$!
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 500 \
        > "$runs/$label-apps.csv" 2>/dev/null &
    local apps=$!
    timeout "${RUN_TIMEOUT:-600}" python3 -m mutualrl.cli train --config configs/gpu1-random-1b.toml \
        --output-dir "$runs/$label" --steps "$steps" --no-progress "$@" "${extra[@]}" 2>&1 | tee "$out/run-$label.log" | tail -25
    echo "run $label exit: ${PIPESTATUS[0]}"
    kill "$smi" "$apps" 2>/dev/null
    wait "$smi" "$apps" 2>/dev/null
    # what the run wrote, finished or not (a run stopped at its time-out keeps its steps)
    for f in metrics.jsonl failures.jsonl summary.json; do
        [ -f "$runs/$label/$f" ] && cp "$runs/$label/$f" "$out/$label-$f"
    done
}

train paced
train lockstep --set allocation.executor=local --set allocation.max_staleness=0

python3 benchmarks/gpu_run_summary.py --device "$device" --json "$out/gpu_run.json" \
    --run "paced=$runs/paced" --smi "paced=$runs/paced-smi.csv" --apps "paced=$runs/paced-apps.csv" \
    --run "lockstep=$runs/lockstep" --smi "lockstep=$runs/lockstep-smi.csv" \
    --apps "lockstep=$runs/lockstep-apps.csv"
