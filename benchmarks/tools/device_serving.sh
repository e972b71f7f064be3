#!/usr/bin/env bash
# TTFT under load on one device: the README server (the embedded model, NEXTN) answers
# `bench_serving.py --concurrency 64 --output-len 128` (64 prompts of ~290 tokens), once
# with the defaults and once with the earlier ones as the peer (16 running requests,
# four 512-token rows a prefill step). Each server compiles its whole table first
# (/server_info's warmup.done); the second of two runs counts, as in BENCHMARKS.md.
# Logs and JSON summaries go to $OUT. Usage: [CASES="now before"] bash benchmarks/tools/device_serving.sh
set -uo pipefail
out="${OUT:-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn llguidance jsonschema
fi
ln -sfn ../kernels lazyspec/kernels
port=30000
serve_and_bench() {  # name, extra serve flags...
  local name=$1; shift
  python3 scripts/serve.py --speculative-algorithm NEXTN --port $port \
    --compilation-cache-dir "$out/jax-cache" "$@" > "$out/serve-$name.log" 2>&1 &
  local pid=$! start ready=""; start=$(date +%s)
  until python3 -c 'import json, sys, urllib.request as u
info = json.load(u.urlopen(sys.argv[1] + "/server_info", timeout=5))
sys.exit(not info["warmup"]["done"])' "http://127.0.0.1:$port" 2>/dev/null; do
    if [ -z "$ready" ] && python3 -c 'import sys, urllib.request as u
u.urlopen(sys.argv[1] + "/health", timeout=5)' "http://127.0.0.1:$port" 2>/dev/null; then
      ready=$(( $(date +%s) - start )); echo "$name: /health 200 after $ready s (cold cache)"
    fi
    sleep 1
    if ! kill -0 $pid 2>/dev/null; then echo "$name: the server exited"; tail -5 "$out/serve-$name.log"; return; fi
    if (( $(date +%s) - start > ${WARM_S:-200} )); then echo "$name: not warm"; break; fi
  done
  echo "$name: warm after $(( $(date +%s) - start )) s"
  for run in 1 2; do
    python3 scripts/bench_serving.py --url "http://127.0.0.1:$port" --concurrency 64 \
      --output-len 128 --flush --json-out "$out/serving-$name-$run.json" \
      > "$out/serving-$name-$run.txt" 2>&1
  done
  grep -iE "TTFT|ITL|throughput|req/s" "$out/serving-$name-2.txt" | head -8
  kill -INT $pid; wait $pid
}
for case in ${CASES:-now before}; do
  case $case in
    now) serve_and_bench now ;;
    before) serve_and_bench before --max-running-requests 16 --max-prefill-tokens 2048 ;;
  esac
done
