"""The checkpoint-boundary finish test.

A request is forced (ignore_eos, exact max_new_tokens) to finish at chosen offsets around a
checkpoint boundary; then a greedy continuation of the finished sequence is generated twice,
reusing the cache and after flushing it. Run with free state slots and with every spare
allocation forced to fail, with speculative decoding on and off. Prints: finish position,
pool state, checkpoint served (the continuation's cached_tokens), identical tokens, max
|Δlogprob|.

    python scripts/bench_boundary.py                      # the full grid (prompt 500, I=64, 832)
    python scripts/bench_boundary.py --prompt-len 100 --interval 32 --boundary 160 --cont 8

The model is a random-weight tiny Qwen3-Next with an MTP head unless --model-path is given.
With ``--drafter scripted`` (default for random weights, whose own draft head accepts
almost nothing) the draft head proposes the target's greedy continuation with a fraction of
positions corrupted, so accept lengths vary over 1..D.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lazyspec.engine.engine import Engine

DEFAULT_OFFSETS = (-2, -1, 0, 1, 2, 16, 32)


@dataclass(frozen=True)
class Cell:
    offset: int
    exhausted: bool
    spec: bool
    served: int
    identical: int
    total: int
    max_dlogprob: float
    accept_len: float | None


def _engine(model, spec: bool, exhausted: bool, args) -> Engine:
    from lazyspec.engine.engine import Engine

    kw = dict(speculative_algorithm="NEXTN", speculative_num_steps=args.steps) if spec else {}
    return Engine(
        model=model,
        mamba_scheduler_strategy="extra_buffer_lazy",
        mamba_track_interval=args.interval,
        mamba_chunk_size=args.chunk,
        chunked_prefill_size=args.chunked_prefill,
        max_running_requests=4,
        max_total_tokens=args.kv_tokens,
        context_length=args.context,
        debug_fail_spare_alloc=exhausted,
        mamba_cache_policy=args.mamba_cache_policy,
        skip_warmup=True,
        **kw,
    )


def greedy_sequence(model, prompt: list[int], total: int, args) -> list[int]:
    """prompt + the engine's non-speculative greedy continuation up to ``total`` tokens."""
    engine = _engine(model, False, False, args)
    out = engine.generate(
        input_ids=prompt,
        sampling_params={"max_new_tokens": total - len(prompt), "ignore_eos": True},
    )
    return prompt + out["output_ids"]


def run_cell(model, prompt: list[int], offset: int, exhausted: bool, spec: bool, args) -> Cell:
    engine = _engine(model, spec, exhausted, args)
    finish = args.boundary + offset
    params = {"max_new_tokens": finish - len(prompt), "ignore_eos": True}
    first = engine.generate(input_ids=prompt, sampling_params=params)
    sequence = prompt + first["output_ids"]
    cont = {"max_new_tokens": args.cont, "ignore_eos": True}
    hit = engine.generate(input_ids=sequence, sampling_params=cont, return_logprob=True)
    accept = engine.get_server_info()["avg_accept_length"]
    engine.check_integrity()
    assert engine.flush_cache()
    miss = engine.generate(input_ids=sequence, sampling_params=cont, return_logprob=True)
    lp_hit = np.array([lp for lp, _ in hit["meta_info"]["output_token_logprobs"]])
    lp_miss = np.array([lp for lp, _ in miss["meta_info"]["output_token_logprobs"]])
    same = sum(a == b for a, b in zip(hit["output_ids"], miss["output_ids"]))
    engine.check_integrity()
    return Cell(
        offset,
        exhausted,
        spec,
        hit["meta_info"]["cached_tokens"],
        same,
        args.cont,
        float(np.max(np.abs(lp_hit - lp_miss))),
        accept,
    )


def build_model(args):
    from lazyspec.testing.tiny_models import tiny_model

    if args.model_path:
        from lazyspec.models import load_model

        return load_model(args.model_path)
    return tiny_model("qwen3_next", seed=args.seed)


def run_grid(args) -> list[Cell]:
    from tqdm import tqdm

    model = build_model(args)
    rng = np.random.default_rng(args.seed)
    prompt = [int(t) for t in rng.integers(3, model.config.vocab_size, size=args.prompt_len)]
    spec_model = model
    if args.drafter == "scripted":
        from lazyspec.testing.scripted_drafter import make_script, scripted_model

        total = args.boundary + max(args.offsets) + args.cont + 8
        sequence = greedy_sequence(model, prompt, total, args)
        script = make_script(
            sequence, args.context + 8, args.corrupt, model.config.vocab_size, seed=args.seed
        )
        spec_model = scripted_model(model, script)
    cells = []
    jobs = [(s, e, o) for s in (True, False) for e in (False, True) for o in args.offsets]
    for spec, exhausted, offset in tqdm(jobs, desc="boundary grid"):
        cells.append(run_cell(spec_model if spec else model, prompt, offset, exhausted, spec, args))
    return cells


def format_table(cells: list[Cell], boundary: int) -> str:
    lines = [
        "| spec | finish position | state pool | checkpoint served | greedy tokens "
        "| max abs dlogprob | accept len |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        accept = f"{c.accept_len:.2f}" if c.accept_len is not None else "-"
        lines.append(
            f"| {'MTP' if c.spec else 'off'} | {boundary}{c.offset:+d} | "
            f"{'exhausted' if c.exhausted else 'free slots'} | {c.served} | "
            f"{c.identical}/{c.total} | {c.max_dlogprob:.1e} | {accept} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF folder; default: tiny random Qwen3-Next")
    p.add_argument("--prompt-len", type=int, default=500)
    p.add_argument("--interval", type=int, default=64, help="mamba_track_interval")
    p.add_argument("--chunk", type=int, default=64, help="mamba_chunk_size")
    p.add_argument("--chunked-prefill", type=int, default=256)
    p.add_argument("--boundary", type=int, default=832)
    p.add_argument(
        "--offsets", type=lambda s: tuple(int(x) for x in s.split(",")), default=DEFAULT_OFFSETS
    )
    p.add_argument("--cont", type=int, default=32, help="continuation tokens")
    p.add_argument("--steps", type=int, default=3, help="speculative_num_steps (D = steps + 1)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--kv-tokens", type=int, default=8192, help="max_total_tokens")
    p.add_argument("--drafter", choices=("scripted", "mtp"), default="scripted")
    p.add_argument("--corrupt", type=float, default=0.3, help="scripted drafter corruption rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--mamba-cache-policy",
        choices=("sglang", "value"),
        default="sglang",
        help="the tree's eviction policy (the grid is SGLang's: its rules by default)",
    )
    p.add_argument("--out", default=None, help="also write the table to this file")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    table = format_table(run_grid(args), args.boundary)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
