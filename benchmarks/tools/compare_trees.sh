#!/usr/bin/env bash
# Time two trees of the engine in one device call, alternating, so that a before/after figure
# comes from one card in one state: `compare_trees.sh OLD NEW ROUNDS -- BENCH_ENGINE_ARGS...`.
# OLD and NEW are folders holding a checkout each (e.g. `git archive REV | tar -x -C OLD`);
# each is linked so that `lazyspec.kernels` imports its own `kernels/`, and runs from its
# folder with PYTHONPATH set to it. Logs go to $OUT (or ./out) as engine_<folder>_<round>.log.
set -uo pipefail
old="$1"; new="$2"; rounds="$3"; shift 4
out="${OUT:-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}"
for tree in "$old" "$new"; do ln -sfn ../kernels "$tree/lazyspec/kernels"; done
for round in $(seq 1 "$rounds"); do
  for tree in "$old" "$new"; do
    name="$(basename "$(cd "$tree" && pwd)")"
    (cd "$tree" && PYTHONPATH="$PWD" python3 scripts/bench_engine.py "$@") \
      > "$out/engine_${name}_${round}.log" 2>&1
    echo "== $name round $round (exit $?)"
    grep -E "^\|" "$out/engine_${name}_${round}.log" | tail -8
  done
done
