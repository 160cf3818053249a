#!/usr/bin/env bash
set -u
mkdir -p "$OUT/p"
OUT="$OUT/p" bash scripts/gpu_check.sh --quick > "$OUT/summary.txt" 2>&1
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=$PWD/.gpu/ext
OUT="$OUT/p" NCU_KERNELS='fwd_tc_kernel' NCU_EXTRA='--metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.sum' timeout 150 bash scripts/profile.sh 64 256 28 28 29 bfloat16 > "$OUT/p/ncu_sum.txt" 2>&1
grep -E "fwd_tc_kernel|Duration|Issue Slots Busy|hmma|Compute \(SM\)|Registers" "$OUT/p/ncu.txt" | head -20 >> "$OUT/summary.txt"
cd "$OUT/p" && tar czf ../logs.tgz . && cd - >/dev/null
cat "$OUT/summary.txt"
