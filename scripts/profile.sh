#!/usr/bin/env bash
# Nsight Compute report of the lkcnn kernels on one shape, for the notes in docs/performance.md and docs/kernels.md.
# Usage on the GPU machine (writes $OUT/ncu.txt):
#   bash scripts/profile.sh [N C H W K DTYPE]        the large-kernel op (default: seed (64,384,32,32) k31 fp32)
#   bash scripts/profile.sh branches ["CASE"]        the branch op's three passes on a `python -m lkcnn.bench branches`
#                                                    case (default: "unireplknet_b s3 k13"), bf16, channels_last
# NCU_KERNELS (default: every lkcnn kernel) picks kernels by regex, NCU_EXTRA adds ncu arguments (e.g. --metrics ...).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.gpu/ext}
ncu_run() {  # ncu_run SKIP COUNT PYTHON-ARGS...: the kernels of the second of two identical rounds
  ncu --clock-control none --kernel-name "regex:${NCU_KERNELS:-dwconv|branch}" --launch-skip "$1" \
      --launch-count "$2" ${NCU_EXTRA:-} --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy \
      --section WarpStateStats --section MemoryWorkloadAnalysis_Tables --section LaunchStats "${@:3}"
}
if [ "${1:-}" = branches ]; then
  ncu_run 3 3 python3 - "${2:-unireplknet_b s3 k13}" >"$OUT/ncu.txt" 2>&1 <<'PY'
import sys, torch
from lkcnn.bench import branches
from lkcnn.ops.dwconv_branches import uses_kernels
if sys.argv[1] not in branches.CASES:
    sys.exit(f"unknown case {sys.argv[1]!r}: choose from {', '.join(branches.CASES)}")
nchw, pairs = branches.CASES[sys.argv[1]]
s = branches._inputs(nchw, pairs, torch.bfloat16, torch.device("cuda"))
if not uses_kernels(s["x"], [k for k, _ in pairs], [r for _, r in pairs]):
    sys.exit("the branch kernels do not take this input (is the extension built? python -m lkcnn.ops.build)")
for _ in range(2):  # fwd, input gradient, weight gradient, twice: the second round is profiled
    for fn in branches.passes("lkcnn_branches", pairs).values():
        fn(s)
torch.cuda.synchronize()
PY
else
  read -r N C H W K DT <<<"${*:-64 384 32 32 31 float32}"
  ncu_run 3 3 python3 - "$N" "$C" "$H" "$W" "$K" "$DT" >"$OUT/ncu.txt" 2>&1 <<'PY'
import sys, torch
from lkcnn.ops import dwconv2d
n, c, h, w, k = map(int, sys.argv[1:6]); dtype = getattr(torch, sys.argv[6])
x = torch.randn(n, c, h, w, device="cuda", dtype=dtype, requires_grad=True)
wt = torch.randn(c, 1, k, k, device="cuda", dtype=dtype, requires_grad=True)
for _ in range(2):
    dwconv2d(x, wt).backward(torch.randn(n, c, h, w, device="cuda", dtype=dtype))
torch.cuda.synchronize()
PY
fi
rc=$?
echo "ncu rc=$rc -> $OUT/ncu.txt"
[ "$rc" = 0 ] || tail -5 "$OUT/ncu.txt"
grep -E "dwconv_|branches_|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Block Limit|L1/TEX Hit|L2 Hit|stalled" "$OUT/ncu.txt" | head -${NCU_LINES:-80}
