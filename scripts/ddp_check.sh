#!/usr/bin/env bash
# On a machine with 2+ GPUs: RepLKNet-31B on synthetic data with DDP, 1 GPU vs 2 GPUs. Prints images/s of each
# (per-device batch 64) and the training loss of 1 GPU x 128 vs 2 GPUs x 64 (the same global batch) step by step,
# then the all-reduce bus bandwidth between the GPUs (scripts/allreduce_bw.py).
# Usage: bash scripts/ddp_check.sh [hydra overrides for every run, e.g. trainer.sync_batchnorm=false]
#        RUNS="g1b64 g2b64" bash scripts/ddp_check.sh ...   (a subset of g1b64 g2b64 g1b128 g2b128)
#        ALLREDUCE=0 skips the all-reduce bandwidth measurement
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.gpu/ext}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m lkcnn.ops.build || exit 1
common=(model=replknet31b data=synthetic data.num_workers=6 "callbacks=[default,throughput]"
        callbacks.throughput.warmup_batches=10 trainer=ddp trainer.max_steps=50 trainer.limit_val_batches=2
        trainer.log_every_n_steps=1)
declare -A setup=([g1b64]="trainer.devices=1 data.batch_size=64" [g2b64]="trainer.devices=2 data.batch_size=64"
                   [g1b128]="trainer.devices=1 data.batch_size=128" [g2b128]="trainer.devices=2 data.batch_size=128")
for name in ${RUNS:-g1b64 g2b64 g1b128}; do
  # shellcheck disable=SC2086
  python3 train.py "${common[@]}" ${setup[$name]} hydra.run.dir="$OUT/$name" "$@" >"$OUT/$name.log" 2>&1 \
    || tail -20 "$OUT/$name.log"
done
python3 - "$OUT" <<'PY'
import csv, json, sys
from pathlib import Path
out = Path(sys.argv[1])
for run in ("g1b64", "g2b64", "g1b128", "g2b128"):
    tp = next((out / run).rglob("throughput.json"), None)
    print(run, "throughput:", json.loads(tp.read_text()) if tp else "missing")
def losses(run):
    rows = [r for f in (out / run).rglob("metrics.csv") for r in csv.DictReader(open(f))]
    return {int(r["step"]): float(r["train/loss_step"]) for r in rows if r.get("train/loss_step")}
a, b = losses("g1b128"), losses("g2b64")
if not (a and b):
    sys.exit(0)
print("step  1 GPU x128  2 GPUs x64")
for s in sorted(set(a) & set(b))[:40:4]:
    print(f"{s:4d}  {a[s]:9.4f}  {b[s]:9.4f}")
PY
if [ "${ALLREDUCE:-1}" = 1 ]; then torchrun --standalone --nproc-per-node 2 scripts/allreduce_bw.py 2>&1 | tail -8; fi
