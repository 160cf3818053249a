#!/usr/bin/env bash
# On a GPU machine: lkcnn installed as users install it (not editable), then `python -m lkcnn.doctor --build` from
# outside the checkout, twice: JIT-built from the installed package's own sources, and prebuilt at install time
# (LKCNN_BUILD_EXT=1). Each install goes into a fresh folder on PYTHONPATH, beside the machine's own torch and timm
# (a venv of a venv's interpreter would not see them); logs go to $OUT.
# Usage, from the repo root:  bash scripts/install_check.sh
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
ARCH=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
work=$(mktemp -d)
rc=0
for mode in jit prebuilt; do
  if [ "$mode" = prebuilt ]; then export LKCNN_BUILD_EXT=1 TORCH_CUDA_ARCH_LIST=$ARCH; fi
  t0=$(date +%s)
  $PY -m pip install -q --no-deps --no-build-isolation --target "$work/$mode" . >"$OUT/install_$mode.log" 2>&1 || rc=1
  t1=$(date +%s)
  unset LKCNN_BUILD_EXT TORCH_CUDA_ARCH_LIST
  (cd "$work" && PYTHONPATH="$work/$mode${PYTHONPATH:+:$PYTHONPATH}" TORCH_EXTENSIONS_DIR="$work/ext_$mode" \
    $PY -m lkcnn.doctor --build) \
    >"$OUT/doctor_$mode.log" 2>&1 || rc=1
  t2=$(date +%s)
  echo "== $mode: install $((t1 - t0)) s, doctor --build $((t2 - t1)) s"
  cat "$OUT/doctor_$mode.log"
done
exit $rc
