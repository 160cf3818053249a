#!/usr/bin/env bash
# Nsight Compute report of the lkcnn kernels on one shape (default: seed (64,384,32,32) k31 fp32), for the notes in
# docs/performance.md. Usage on the GPU machine: bash scripts/profile.sh [N C H W K DTYPE]   (writes $OUT/ncu.txt)
# NCU_KERNELS (default: every lkcnn kernel) picks kernels by regex, NCU_EXTRA adds ncu arguments (e.g. --metrics ...).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.gpu/ext}
read -r N C H W K DT <<<"${*:-64 384 32 32 31 float32}"
ncu --clock-control none --kernel-name "regex:${NCU_KERNELS:-dwconv}" --launch-skip 3 --launch-count 3 ${NCU_EXTRA:-} \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis_Tables --section LaunchStats \
    python3 - "$N" "$C" "$H" "$W" "$K" "$DT" >"$OUT/ncu.txt" 2>&1 <<'PY'
import sys, torch
from lkcnn.ops import dwconv2d
n, c, h, w, k = map(int, sys.argv[1:6]); dtype = getattr(torch, sys.argv[6])
x = torch.randn(n, c, h, w, device="cuda", dtype=dtype, requires_grad=True)
wt = torch.randn(c, 1, k, k, device="cuda", dtype=dtype, requires_grad=True)
for _ in range(2):
    dwconv2d(x, wt).backward(torch.randn(n, c, h, w, device="cuda", dtype=dtype))
torch.cuda.synchronize()
PY
echo "ncu rc=$? -> $OUT/ncu.txt"
grep -E "dwconv_|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Config|Issue Slots Busy|Executed Ipc A|Bank|Warp Cycles Per Issued|Block Limit" "$OUT/ncu.txt" | head -80
