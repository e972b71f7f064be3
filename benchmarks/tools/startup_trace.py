"""Where the README server's start-up goes, phase by phase: the engine ``scripts/serve.py``
builds from the same flags (its pool plan, then ``Engine`` without warm-up), then each
program a first request needs (``warmup.first_request_keys``, in warm-up order) loaded as
stored (``engine/executables.py``), or else traced and lowered, compiled (a persistent-cache
hit when the cache holds it) and stored (timed with the compiling), then run once
(``Runner.warm``), one at a time, each phase's seconds printed. Run it twice on one cache
directory for the cold and the warm figures:

    python benchmarks/tools/startup_trace.py --cache-dir /tmp/c -- --speculative-algorithm NEXTN

One program at a time shows each phase's own cost; the server runs them in a thread pool
(``scripts/bench_startup.py`` times that).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", required=True, help="the JAX compilation cache")
    parser.add_argument("serve_args", nargs="*", help="serve.py's flags (after --)")
    args = parser.parse_args()
    start = time.perf_counter()

    def say(what: str, since: float) -> float:
        now = time.perf_counter()
        print(f"{now - start:7.2f} s  {now - since:6.2f} s  {what}", flush=True)
        return now

    from lazyspec.server.launch import build_parser, resolve_engine_kwargs
    from lazyspec.server.lifecycle import enable_compilation_cache
    from lazyspec.server.pools import apply_pool_plan

    serve = build_parser().parse_args(args.serve_args)
    kwargs, sglang, _ = resolve_engine_kwargs(serve)
    enable_compilation_cache(args.cache_dir)
    mark = say("flags parsed, compilation cache set", start)
    apply_pool_plan(kwargs, sglang.mem_fraction_static, sglang.mamba_full_memory_ratio)
    mark = say(
        f"pool plan: {kwargs.get('max_total_tokens')} KV tokens, "
        f"{kwargs.get('max_mamba_cache_size')} state slots",
        mark,
    )
    from lazyspec.engine.engine import Engine
    from lazyspec.engine.executables import store_for_jax_cache
    from lazyspec.engine.warmup import (
        CompileListener,
        compile_and_store,
        first_request_keys,
        warm_order,
    )

    engine = Engine(**{**kwargs, "skip_warmup": True})
    mark = say("engine built (weights placed, pools allocated)", mark)
    runner = engine.runner
    keys = runner.program_keys
    first = first_request_keys(runner.layout, keys)
    table = {program.key: program for program in runner.program_table()}
    print(f"{len(keys)} programs, {len(first)} for a first request", flush=True)
    store = store_for_jax_cache(list(runner.sharding.mesh.devices.flat))
    listener = CompileListener()  # which programs XLA compiled
    listener.start()
    for key in warm_order(runner.layout, keys):
        if key not in first:
            continue
        compiled = None if store is None else store.load(table[key])
        if compiled is not None:
            mark = say(f"loaded   {key}", mark)
        else:
            lowered = table[key].lower()
            mark = say(f"lowered  {key}", mark)
            compiled = compile_and_store(table[key], lowered, store, listener)
            mark = say(f"compiled {key}", mark)
        runner.bind(key, compiled)
        runner.warm(key)
        mark = say(f"ran      {key}", mark)
    say("ready (every first-request program compiled and run once)", start)


if __name__ == "__main__":
    main()
