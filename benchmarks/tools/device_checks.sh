#!/usr/bin/env bash
# The GPU checks of one device call, in order of importance: the kernel tests compiled
# with the GDN chunked form's (`pytest -k "pallas or gdn_chunked"`), the README server's
# start-up cold and warm (to /health 200), then
# (COMPARE=1) one before/after bench_engine row against a checkout in .old
# (compare_trees.sh); STARTUP=0 skips the start-up check; ENGINE_STARTUP=1 times
# bench_engine's qwen3_next_moe engine to ready and to its whole table (once per count of
# ENGINE_STARTUP_THREADS compile threads; ENGINE_STARTUP_S seconds each); PREFILL=1 times
# the preset's prefill rows at a few prefill chunks (PREFILL_CHUNKS, PREFILL_S seconds
# each), each with its profile's device time by category (command buffers off, so that
# kernels map to their scopes); MEMORY=1 prints the README server's programs' memory
# analysis (program_memory.py, MEMORY_MOST programs); SERVING=1 runs device_serving.sh's
# TTFT at concurrency 64 (SERVING_CASES, default "now"); SPEC=1 times NEXTN against plain
# decode by batch size twice (bench_spec_batch.py, NEXTN also with SPEC_LIMIT as
# speculative_disable_by_batch_size); PREFILL_TUNINGS runs each prefill chunk once per
# kernel-tuning override (e.g. "default gdn.chunk_inverse=true"). Serving needs fastapi, uvicorn,
# llguidance and jsonschema: where the machine lacks them, carry their wheels in .whl
# (benchmarks/tools/serving_wheels.sh). Logs go to $OUT.
set -uo pipefail
out="${OUT:-out}"; mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn llguidance jsonschema
fi
ln -sfn ../kernels lazyspec/kernels  # lazyspec.kernels without an install
start=$(date +%s)
timeout "${PALLAS_S:-240}" python3 -m pytest tests/kernels -k "pallas or gdn_chunked" -q -rf -n 8 \
  -p no:cacheprovider --durations=10 > "$out/pallas.log" 2>&1
echo "pallas rc=$? in $(( $(date +%s) - start )) s"
grep -E "passed|failed" "$out/pallas.log" | tail -2
grep -E "^FAILED" "$out/pallas.log" | cut -c1-230 | head -40
if [ "${STARTUP:-1}" = 1 ]; then
  # to /health 200 only: the GPU's whole table takes longer than a call should spend on it
  timeout 170 python3 scripts/bench_startup.py --runs 1 --ready-only -- \
    --speculative-algorithm NEXTN > "$out/startup.log" 2>&1
  echo "startup rc=$?"; tail -3 "$out/startup.log"
fi
if [ "${ENGINE_STARTUP:-0}" = 1 ]; then  # the 2.5 B preset's engine: to ready, to its table
  for threads in ${ENGINE_STARTUP_THREADS:-default}; do  # compile threads, e.g. "1 2 4 8"
    flags="${ENGINE_STARTUP_FLAGS:-}"; [ "$threads" = default ] || flags+=" --compile-threads $threads"
    timeout "${ENGINE_STARTUP_S:-300}" python3 scripts/bench_engine.py --preset qwen3_next_moe \
      --startup --batch 64 --context 1024 $flags > "$out/engine-startup-$threads.log" 2>&1
    echo "engine startup ($threads threads) rc=$?"
    grep -E "^(engine ready|whole table)" "$out/engine-startup-$threads.log" | cut -c1-400
  done
fi
if [ "${PREFILL:-0}" = 1 ]; then  # the accelerator's prefill chunk, by measurement
  for chunk in ${PREFILL_CHUNKS:-512 2048 8192}; do
    for tuning in ${PREFILL_TUNINGS:-default}; do
      extra=(); [ "$tuning" = default ] || extra=(--kernel-tuning "$tuning")
      name="${tuning//[^a-z0-9_.]/_}"  # letters, digits, . and _: what comes back from $OUT
      log="$out/prefill-$chunk-$name.log"
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" \
        timeout "${PREFILL_S:-150}" python3 scripts/bench_engine.py --preset qwen3_next_moe \
        --prefill-lens 4096,32768 --prefill-chunk "$chunk" --profile "$out/prof-$chunk-$name" \
        "${extra[@]}" > "$log" 2>&1
      echo "prefill chunk $chunk, $tuning rc=$?"; grep -E "^\| qwen3_next_moe" "$log" | tail -2
    done
  done
fi
if [ "${SERVING:-0}" = 1 ]; then  # TTFT at concurrency 64 on the README server
  CASES="${SERVING_CASES:-now}" timeout "${SERVING_S:-240}" bash benchmarks/tools/device_serving.sh
fi
if [ "${SPEC:-0}" = 1 ]; then  # where NEXTN stops winning, twice (a run is ~0.1 s a row)
  # 15 engines a run: the second reads their programs from a persistent cache the first
  # fills (each run's untimed first pass compiles, so the timed pass is the same either way)
  for run in 1 2; do
    JAX_COMPILATION_CACHE_DIR=/tmp/spec-jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
    timeout "${SPEC_S:-200}" python3 benchmarks/tools/bench_spec_batch.py --batches 1,4,8,16,64 \
      --limit "${SPEC_LIMIT:-8}" --out "$out/spec-batch-$run.json" > "$out/spec-batch-$run.log" 2>&1
    echo "spec by batch, run $run rc=$?"; grep -E "^\|" "$out/spec-batch-$run.log"
  done
fi
if [ "${MEMORY:-0}" = 1 ]; then  # what each served program holds beside the pools
  timeout "${MEMORY_S:-300}" python3 benchmarks/tools/program_memory.py \
    --most "${MEMORY_MOST:-16}" -- --speculative-algorithm NEXTN > "$out/memory.log" 2>&1
  echo "memory rc=$?"; grep -E "^device|^\|" "$out/memory.log"
fi
if [ "${COMPARE:-0}" = 1 ]; then
  timeout 150 bash benchmarks/tools/compare_trees.sh .old . 1 -- --preset qwen3_next_moe \
    --batches 16 --decode-steps 1 2>&1 | tail -8
fi
