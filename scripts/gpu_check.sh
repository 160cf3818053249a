#!/usr/bin/env bash
# One call on the GPU machine: build the CUDA extension (cold and warm times), compile report (registers, spills),
# GPU tests, benchmark (the large kernels, then the small branches). Logs go to $OUT; the short summary prints last.
# Usage, from the repo root on a GPU machine:  bash scripts/gpu_check.sh [--tests-only|--bench-only] [bench args...]
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.gpu/ext}
mode=all
case "${1:-}" in --tests-only|--bench-only) mode=${1#--}; mode=${mode%-only}; shift ;; esac

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
$PY scripts/compile_check.py 90 >"$OUT/ptxas.log" 2>&1 &
ptxas_pid=$!

t0=$(date +%s%N)
if ! $PY -m lkcnn.ops.build -v >"$OUT/build.log" 2>&1; then tail -40 "$OUT/build.log"; exit 1; fi
t1=$(date +%s%N)
$PY -m lkcnn.ops.build >"$OUT/warm.log" 2>&1
t2=$(date +%s%N)

trc=skipped brc=skipped
if [ "$mode" != bench ]; then
  # every GPU-marked test (the 2-GPU ones skip on one GPU); the data tests import Hydra, which a GPU machine without
  # it gets as carried wheels; the notebooks need Jupyter and have no GPU test. The suite is bound by compiling
  # (Triton's 8-bit GEMMs, the 8-bit export), so it runs on 8 workers where pytest-xdist is installed: 4.5 minutes
  # on a 16-core H200 machine, where one process did not finish it in 6.
  workers=(); $PY -c "import xdist" 2>/dev/null && workers=(-n "${GPU_TEST_WORKERS:-8}")
  $PY -m pytest -q "${workers[@]}" -m gpu tests/ --ignore=tests/test_notebooks.py -p no:cacheprovider \
    >"$OUT/tests.log" 2>&1; trc=$?
fi
wait $ptxas_pid  # the compile report competes for the CPU, and small shapes' timings include host time
if [ "$mode" != tests ]; then
  $PY -m lkcnn.bench "$@" --json "$OUT/bench.json" --plot "$OUT/bench.png" >"$OUT/bench.log" 2>&1; brc=$?
  $PY -m lkcnn.bench branches --json "$OUT/branches.json" >"$OUT/branches.log" 2>&1 || brc=$?  # bf16, ~1 minute
fi

echo "== device: $(tail -1 "$OUT/gpu.txt")"
echo "== build: first $(( (t1 - t0) / 1000000 )) ms, warm load in a new process $(( (t2 - t1) / 1000000 )) ms"
echo "== ptxas:"; grep -E "registers|spill|error" "$OUT/ptxas.log" | sort | uniq -c | head -12
if [ "$trc" != skipped ]; then echo "== gpu tests (rc=$trc):"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -25; fi
if [ "$brc" != skipped ]; then
  echo "== bench (rc=$brc):"; tail -45 "$OUT/bench.log"; echo "== small branches:"; tail -9 "$OUT/branches.log"
fi
