#!/usr/bin/env bash
# One call on the GPU machine for whole-network training speed: build the CUDA extension, the GPU tests of the ops the
# networks run, each stage's blocks (`lkcnn.bench blocks`), and optionally the compiled networks against timm's
# ConvNeXt-B (`lkcnn.bench e2e --compare`: compile, timing and profile; RepLKNet-31B brings its 3x3 twin: ~7 minutes
# with a cold build on an H200; UniRepLKNet-B's did not finish within 540 s after ConvNeXt-B, so one --models network
# per run; each network's start, images/s (before its profile) and profile's end print with the seconds since the
# start), each Triton kernel's rate in the compiled step (`lkcnn.bench rates`: ~2-4 minutes a network), and an A/B of
# inductor settings on one whole network (`E2E_AB`: lkcnn's settings, then with these, each its own process with its own
# cold inductor cache; images/s and the first step's seconds, the compile's cost), and the training app run twice on one
# inductor cache (`APP`, a model: images/s and the first step's seconds cold and from the cache; needs hydra-core
# importable), and the launch-shape sweep of lkcnn's Triton normalization kernels (`SWEEP`,
# scripts/triton_launch_shapes.py's arguments: ~1-2 minutes a set of shapes). Logs and records go to $OUT; the short
# tables print last.
# Usage, from the repo root on a GPU machine (each part runs when its variable is non-empty):
#   bash scripts/network_check.sh                # tests, then blocks (and longest kernels) of RepLKNet-31B, UniRepLKNet-B
#   BLOCKS="--models replknet31b --inductor realize_reads_threshold=4" bash scripts/network_check.sh
#   TESTS= BLOCKS= COMPARE="--models replknet31b" bash scripts/network_check.sh
#   TESTS= BLOCKS= RATES="--models unireplknet_b" bash scripts/network_check.sh
#   TESTS= BLOCKS= E2E_AB="triton.prefer_nd_tiling=True" [E2E_MODEL=replknet31b] bash scripts/network_check.sh
#   BLOCKS= APP=replknet31b bash scripts/network_check.sh
#   TESTS= BLOCKS= SWEEP="--shapes grn" bash scripts/network_check.sh
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
TESTS=${TESTS-1}
BLOCKS=${BLOCKS-"--models replknet31b,unireplknet_b --kernels 8"}
COMPARE=${COMPARE-}
RATES=${RATES-}
E2E_AB=${E2E_AB-}
E2E_MODEL=${E2E_MODEL:-replknet31b}
APP=${APP-}
SWEEP=${SWEEP-}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.gpu/ext}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.gpu/inductor}
t0=$(date +%s)
since() { echo "$(( $(date +%s) - t0 )) s"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
if ! $PY -m lkcnn.ops.build >"$OUT/build.log" 2>&1; then tail -20 "$OUT/build.log"; exit 1; fi
echo "== build: $(tail -1 "$OUT/build.log" | cut -c1-100), $(since)"
if [ -n "$TESTS" ]; then
  $PY -m pytest -q tests/test_ops_gpu.py tests/test_ops_branches_gpu.py tests/test_bn_gelu_gpu.py \
    tests/test_gelu_grn_gpu.py -p no:cacheprovider >"$OUT/tests.log" 2>&1
  echo "== gpu tests (rc=$?), $(since):"; grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$OUT/tests.log" | tail -15
fi
if [ -n "$BLOCKS" ]; then
  # shellcheck disable=SC2086  # BLOCKS holds several arguments
  $PY -m lkcnn.bench blocks $BLOCKS --json "$OUT/blocks.json" >"$OUT/blocks.log" 2>&1
  echo "== blocks (rc=$?), $(since):"; grep -v -E "^\s*$|UserWarning|_warn_once" "$OUT/blocks.log" | head -80
fi
if [ -n "$COMPARE" ]; then
  # shellcheck disable=SC2086
  $PY -m lkcnn.bench e2e $COMPARE --compare convnext_base --compile --steps 30 --warmup 6 --json "$OUT/compare.json" \
    >"$OUT/compare.log" 2>&1
  echo "== compare (rc=$?), $(since):"; grep -v -E "UserWarning|_warn_once" "$OUT/compare.log" | tail -20
fi
if [ -n "$RATES" ]; then
  # shellcheck disable=SC2086
  $PY -m lkcnn.bench rates $RATES --json "$OUT/rates.json" >"$OUT/rates.log" 2>&1
  echo "== rates (rc=$?), $(since):"; grep -v -E "UserWarning|_warn_once|acc_events|^\s*$" "$OUT/rates.log" | head -60
fi
if [ -n "$E2E_AB" ]; then
  for side in base ab; do
    settings=(); [ $side = ab ] && settings=(--inductor "$E2E_AB")
    rm -rf "$PWD/.gpu/inductor_ab_$side"  # cold: the first step's seconds are the whole compile
    TORCHINDUCTOR_CACHE_DIR=$PWD/.gpu/inductor_ab_$side $PY -m lkcnn.bench e2e --models "$E2E_MODEL" --runs auto \
      --compile --channels-last --steps 30 --warmup 6 "${settings[@]}" --json "$OUT/e2e_ab_$side.json" \
      >"$OUT/e2e_ab_$side.log" 2>&1
    echo "== e2e $side (rc=$?), $(since):"; grep -E "images/s|img/s" "$OUT/e2e_ab_$side.log" | tail -2
  done
fi
if [ -n "$APP" ]; then
  rm -rf "$PWD/.gpu/inductor_app"
  for run in cold warm; do
    TORCHINDUCTOR_CACHE_DIR=$PWD/.gpu/inductor_app $PY train.py model="$APP" data=synthetic data.num_workers=6 \
      'callbacks=[default,throughput]' data.batch_size=64 trainer.limit_val_batches=0 trainer.precision=bf16-mixed \
      trainer.max_steps=150 hydra.run.dir="$PWD/.gpu/app_$run" >"$OUT/app_$run.log" 2>&1
    echo "== app $run (rc=$?), $(since):"; grep -E "first step|images/s" "$OUT/app_$run.log" | tail -3
  done
fi
if [ -n "$SWEEP" ]; then
  # shellcheck disable=SC2086  # SWEEP holds several arguments
  $PY scripts/triton_launch_shapes.py $SWEEP --json "$OUT/launch_shapes.json" >"$OUT/launch_shapes.log" 2>&1
  echo "== launch shapes (rc=$?), $(since):"; grep -v -E "UserWarning|_warn_once" "$OUT/launch_shapes.log" | tail -40
fi
