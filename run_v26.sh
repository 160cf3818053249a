#!/usr/bin/env bash
set -u
mkdir -p "$OUT/p"
OUT="$OUT/p" bash scripts/gpu_check.sh --quick --dtypes bf16,fp16 > "$OUT/summary.txt" 2>&1
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=$PWD/.gpu/ext
python3 -m lkcnn.bench --quick --channels-last --no-torch --dtypes bf16 --json "$OUT/p/cl.json" > "$OUT/p/cl.log" 2>&1
echo "== CL bf16" >> "$OUT/summary.txt"; tail -8 "$OUT/p/cl.log" >> "$OUT/summary.txt"
cd "$OUT/p" && tar czf ../logs.tgz . && cd - >/dev/null
cat "$OUT/summary.txt"
