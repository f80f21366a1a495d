#!/usr/bin/env bash
# Whole-decode latency of full attention and PFA (perf.bench_decode, histories 512 and 2048) at an
# earlier commit and at the working tree, alternated ROUNDS times: the speed of a shared machine drifts
# by several percent between minutes, so a change is read from ratios taken round by round. The
# earlier commit is exported with `git archive` into a temporary directory (the repository is not
# touched). Run from the repository root:
#   bash perf/experiments/ab_decode.sh OLD_COMMIT [ROUNDS] [OUT]      # OUT: perf/results/ab_decode.txt
# REPS (default 21) sets the timed repetitions per variant; REPS=2 with ROUNDS=1 is a quick check.
set -euo pipefail
old=$1
rounds=${2:-3}
out=${3:-perf/results/ab_decode.txt}
reps=${REPS:-21}
py=${PY:-.venv/bin/python}
py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"  # absolute, still the venv's
export MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/old"
git archive "$old" | tar -x -C "$tmp/old"
run() {  # prints: full_512 pfa_512 ratio_512 full_2048 pfa_2048 ratio_2048
    (cd "$1" && "$py" -m perf.bench_decode --histories 512 2048 --users 32 8 --variants full pfa --reps "$reps" \
        --out "$tmp/out" 2>/dev/null >/dev/null && "$py" -c "
import json
rows = {(r['mode'], r['history']): r for r in json.load(open('$tmp/out/decode_latency.json'))['rows']}
print(' '.join(f\"{rows['full', n]['latency_ms_p50']:6.1f} {rows['pfa', n]['latency_ms_p50']:6.1f} \"
               f\"{rows['pfa', n]['speedup_vs_full']:5.2f}x\" for n in (512, 2048)))")
}
{
    echo "decode ms per batch (full, PFA, full/PFA) at history 512 (32 users) and 2048 (8 users); $rounds rounds"
    echo "old = $(git rev-parse --short "$old"), new = working tree at $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes')"
    for i in $(seq "$rounds"); do
        echo "round $i old  $(run "$tmp/old")"
        echo "round $i new  $(run .)"
    done
} > "$tmp/result.txt"  # the result file is replaced only by a complete run
cp "$tmp/result.txt" "$out"
cat "$out"
