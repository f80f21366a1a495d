#!/usr/bin/env bash
# Every GPU measurement in one command, for a GPU host with torch and triton and no network:
#   bash perf/gpu_run.sh [OUT_DIR]        (default perf/results/gpu; PRESET=quick for a short run)
# 1. perf/gpu_kernels.py: each Triton kernel checked against the torch reference, then timed
#    (bandwidth against the device peak and a measured copy) and the attention-only decode ratios;
#    the HSTU kernel also per tile shape and without its biases (its profile);
# 2. the whole semantic-ID decode (perf.bench_decode) on the GPU, ops on the Triton kernels, then
#    with the ops forced to the torch reference; each timed eager (Python launching every op, as
#    served) and as CUDA-graph replays (the GPU's own work);
# 3. the served decode (backend_src/decoding/cuda_graphs.py): bucketed CUDA-graph replays checked
#    against the eager decode and timed (graphs/served_decode.json), and its GPU tests when pytest is
#    installed; the HSTU kernel in fp32 (its non-spilling tiles) into fp32/;
# 4. M-FALCON ranking (perf.bench_ranking) and history caching (perf.bench_caching) on the GPU.
# GENREC_COMMIT names the commit in the result files when the tree was copied without its history;
# BASELINE_KERNELS (another version of the kernels: a backend_src/ops/triton_kernels directory, or a
# single-file version) is timed beside ours.
# Each step has its own time limit and writes its results as it goes, so one failing or slow step
# leaves the others' results. Everything printed also goes to OUT_DIR/run.log. STEPS (names, space
# separated) runs only those steps, e.g. to split the run into commands that each fit a time limit:
#   STEPS="kernels decode-triton-ops-graphs served-decode" bash perf/gpu_run.sh; STEPS="..." ...
set -u
out=${1:-perf/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
exec > >(tee "$out/run.log") 2>&1

step() {  # step SECONDS NAME COMMAND...: run with a time limit, report how it ended
    local limit=$1 name=$2 t0=$SECONDS rc
    shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
    echo "=== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0))s"
}

date -u
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
# the commit every result file names (GENREC_COMMIT when the tree came without its git history)
$PY -c "from backend_src.results import git_commit; print('commit', git_commit())" | tee "$out/commit.txt"

step "${KERNELS_LIMIT:-300}" kernels $PY perf/gpu_kernels.py --preset "${PRESET:-default}" --out "$out" \
    ${BASELINE_KERNELS:+--baseline-kernels "$BASELINE_KERNELS"}
decode=(-m perf.bench_decode --device cuda --users 512 512 128 --max-seconds 15)
step 100 decode-triton-ops $PY "${decode[@]}" --reps 9 --out "$out"
step 100 decode-triton-ops-graphs $PY "${decode[@]}" --cuda-graphs --reps 15 --out "$out/graphs"
step 60 decode-torch-ops env GENREC_OPS_BACKEND=torch $PY "${decode[@]}" --variants full pfa dynamic_topk \
    --reps 7 --out "$out/torch_ops"
step 60 decode-torch-ops-graphs env GENREC_OPS_BACKEND=torch $PY "${decode[@]}" --variants full pfa dynamic_topk \
    --cuda-graphs --reps 15 --out "$out/torch_ops_graphs"
step 150 served-decode $PY perf/gpu_kernels.py --served-decode --out "$out"
if $PY -c "import pytest" 2>/dev/null; then
    step 120 gpu-tests $PY -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py
fi
step 90 hstu-fp32 $PY perf/gpu_kernels.py --dtype fp32 --skip-decode --preset quick --out "$out/fp32"
step 60 ranking $PY -m perf.bench_ranking --device cuda --reps 9 --max-seconds 10 --out "$out"
step 45 caching $PY -m perf.bench_caching --device cuda --thread-counts 1 --users 1 16 256 --max-seconds 8 \
    --out "$out"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv || true
date -u
