#!/usr/bin/env bash
# One call on the GPU machine for a before/after measurement: the same command on a copy of the code before a change
# (A) and on the checkout (B), each tree importing its own lkcnn and its own build of the CUDA extension (the two
# built in parallel), A and B alternating ROUNDS times, each run its own process, so both sides meet the same machine.
# The copy travels with the checkout: make it before the call with
#   mkdir -p .ab/A && git archive BASE | tar -x -C .ab/A
# and carry `.ab` (git ignores it). Each run happens in its tree's root with AB_OUT set to $OUT/A1, $OUT/B1, $OUT/A2,
# ... (put its files there, e.g. `--json "$AB_OUT.json"`); its output goes to $AB_OUT.log, whose last TAIL lines
# print after the run.
# Usage, from the repo root on a GPU machine (BUILD=0 leaves the builds to the runs):
#   A=.ab/A ROUNDS=2 bash scripts/ab_check.sh 'python3 -m lkcnn.bench e2e --models replknet31b --runs auto --compile
#       --channels-last --steps 30 --warmup 6 --json "$AB_OUT.json"'
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
if [ $# -ne 1 ]; then
  echo "Error: give the command as one quoted argument: A=.ab/A [ROUNDS=n] bash scripts/ab_check.sh '<command>'" >&2
  exit 2
fi
base=${A:-.ab/A}
if [ ! -d "$base/lkcnn" ]; then
  echo "Error: $base holds no copy of the code: mkdir -p $base && git archive BASE | tar -x -C $base" >&2
  exit 2
fi
base=$(cd "$base" && pwd)
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.gpu/ext}  # keyed by the sources' hash
# in_tree A|B CMD...: CMD in that tree's root, importing that tree's lkcnn
in_tree() {
  local root=$PWD
  [ "$1" = A ] && root=$base
  shift
  (cd "$root" && PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} "$@")
}

if [ "${BUILD:-1}" = 1 ]; then
  t0=$(date +%s)
  declare -A rc
  in_tree A $PY -m lkcnn.ops.build >"$OUT/build_A.log" 2>&1 &
  pid=$!
  in_tree B $PY -m lkcnn.ops.build >"$OUT/build_B.log" 2>&1
  rc[B]=$?
  wait "$pid"; rc[A]=$?
  for t in A B; do
    if [ "${rc[$t]}" != 0 ]; then echo "== build $t failed:"; tail -20 "$OUT/build_$t.log"; exit 1; fi
  done
  echo "== builds: $(( $(date +%s) - t0 )) s"
fi
for r in $(seq "${ROUNDS:-1}"); do
  for t in A B; do
    export AB_OUT=$OUT/$t$r
    in_tree $t bash -c "$1" >"$AB_OUT.log" 2>&1
    echo "== $t$r (rc=$?):"
    tail -n "${TAIL:-3}" "$AB_OUT.log"
  done
done
