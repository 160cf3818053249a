#!/usr/bin/env bash
# On a machine with 2+ GPUs: RepLKNet-31B on synthetic data with DDP, 1 GPU vs 2 GPUs. Prints images/s of each
# (per-device batch 64) and the training loss of 1 GPU x 128 vs 2 GPUs x 64 (the same global batch) step by step.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.gpu/ext}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m lkcnn.ops.build || exit 1
common=(model=replknet31b data=synthetic data.num_workers=6 "callbacks=[default,throughput]"
        callbacks.throughput.warmup_batches=10 trainer=ddp trainer.max_steps=30 trainer.limit_val_batches=2
        trainer.log_every_n_steps=1)
run() { python3 train.py "${common[@]}" "$@" >"$OUT/$1.log" 2>&1 || tail -20 "$OUT/$1.log"; }
run trainer.devices=1 data.batch_size=64 hydra.run.dir="$OUT/g1b64"
run trainer.devices=2 data.batch_size=64 hydra.run.dir="$OUT/g2b64"
run trainer.devices=1 data.batch_size=128 hydra.run.dir="$OUT/g1b128"
python3 - "$OUT" <<'PY'
import csv, json, sys
from pathlib import Path
out = Path(sys.argv[1])
for run in ("g1b64", "g2b64", "g1b128"):
    tp = next((out / run).rglob("throughput.json"), None)
    print(run, "throughput:", json.loads(tp.read_text()) if tp else "missing")
def losses(run):
    rows = [r for f in (out / run).rglob("metrics.csv") for r in csv.DictReader(open(f))]
    return {int(r["step"]): float(r["train/loss_step"]) for r in rows if r.get("train/loss_step")}
a, b = losses("g1b128"), losses("g2b64")
print("step  1 GPU x128  2 GPUs x64")
for s in sorted(set(a) & set(b))[:40:4]:
    print(f"{s:4d}  {a[s]:9.4f}  {b[s]:9.4f}")
PY
