"""XLA's memory analysis of a served engine's programs: what each program of the table holds
while it runs, beside the pools it is handed.

The engine is sized as ``scripts/serve.py`` sizes it from the same flags (the pools fill the
device's memory fraction), built without warm-up; then each program of its table (one
per kind and bucket, up to ``--most``) is compiled alone and its arguments, outputs,
aliased bytes and temporaries are printed in GiB with its compile seconds. A program whose
temporaries or unaliased outputs approach the pools' size copies a pool. Copies over
``--copy-gib`` in the optimised HLO are counted per program.

    python benchmarks/tools/program_memory.py -- --speculative-algorithm NEXTN
"""

from __future__ import annotations

import argparse
import re
import time

import jax

from lazyspec.server.launch import build_parser, resolve_engine_kwargs
from lazyspec.server.pools import apply_pool_plan

GIB = 2**30
# an HLO instruction's result shape: dtype[d0,d1,...]
_SHAPE = re.compile(r"=\s*(\w+)\[([\d,]*)\]\{?[^ ]*\s+copy\(")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}


def large_copies(hlo_text: str, min_bytes: float) -> int:
    """The ``copy`` instructions of ``hlo_text`` whose result holds at least ``min_bytes``."""
    count = 0
    for dtype, dims in _SHAPE.findall(hlo_text):
        size = _BYTES.get(dtype, 4)
        for dim in filter(None, dims.split(",")):
            size *= int(dim)
        count += size >= min_bytes
    return count


def served_engine(serve_args: list[str]):
    """An engine of ``serve.py``'s flags, its pools planned as the server plans them."""
    from lazyspec.engine.engine import Engine

    kwargs, sglang, _ = resolve_engine_kwargs(build_parser().parse_args(serve_args))
    apply_pool_plan(kwargs, sglang.mem_fraction_static, sglang.mamba_full_memory_ratio)
    kwargs["skip_warmup"] = True
    return Engine(**kwargs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--most", type=int, default=12, help="programs compiled at most")
    p.add_argument("--copy-gib", type=float, default=0.5, help="a copy this large is counted")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then serve.py's flags")
    args = p.parse_args()
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    engine = served_engine(serve_args)
    runner = engine.runner
    pools = sum(leaf.nbytes for leaf in jax.tree.leaves(runner.pools)) / GIB
    table = runner.program_table()
    print(f"device {jax.devices()[0].device_kind}; pools {pools:.2f} GiB; {len(table)} programs")
    print("| program | compile s | arguments | outputs | aliased | temporaries | large copies |")
    print("|---|---|---|---|---|---|---|")
    for program in table[: args.most]:
        start = time.perf_counter()
        compiled = program.compile()
        seconds = time.perf_counter() - start
        m = compiled.memory_analysis()
        copies = large_copies(compiled.as_text(), args.copy_gib * GIB)
        sizes = (
            m.argument_size_in_bytes,
            m.output_size_in_bytes,
            m.alias_size_in_bytes,
            m.temp_size_in_bytes,
        )
        key = program.key
        name = f"{key.kind} rows={key.rows} tokens={key.tokens} greedy={key.greedy}"
        cells = " | ".join(f"{size / GIB:.3f}" for size in sizes)
        print(f"| {name} | {seconds:.1f} | {cells} | {copies} |", flush=True)


if __name__ == "__main__":
    main()
