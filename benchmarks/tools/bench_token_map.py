"""Accept length of NEXTN drafting with speculative token maps vs the full vocabulary.

Greedy, on held-out prompts of the embedded default model's corpus (one window per
validation file of the stdlib, as ``notebooks/accept_length.ipynb`` picks them), one fresh
engine per map. Prints a markdown table: the ids of each map file, the draft head's
columns (EOS ids added, padded to a multiple of 128), accept length (tokens a verify step
commits, the bonus token included), per-position acceptance, and whether the greedy
outputs equal those without a map. CPU is enough (accept length only, no timing).

    python scripts/build_token_map.py --num-tokens 512 --output out/token_map_512.json
    python benchmarks/tools/bench_token_map.py --token-maps out/token_map_512.json
"""

from __future__ import annotations

import argparse

import numpy as np

from lazyspec.bench.prompts import held_out_prompts
from lazyspec.engine.draft_vocab import DRAFT_VOCAB
from lazyspec.engine.engine import Engine
from lazyspec.models import load_model
from lazyspec.server.launch import DEFAULT_MODEL
from lazyspec.token_map import read_token_map


def run(model, prompts, args, token_map: str | None) -> dict:
    context = -(-(args.prompt_tokens + args.new_tokens + 64) // 64) * 64
    engine = Engine(
        model=model,
        speculative_algorithm="NEXTN",
        speculative_num_steps=args.steps,
        speculative_token_map=token_map,
        context_length=context,
        max_total_tokens=context * 2 * len(prompts),
        max_running_requests=args.batch,
        skip_warmup=True,
        random_seed=args.seed,
    )
    params = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
    reqs = [engine.add_request(input_ids=p, sampling_params=params) for p in prompts]
    engine.run_until_done(reqs)
    hist = np.concatenate([r.accept_hist for r in reqs])
    columns = engine.runner.params.get(DRAFT_VOCAB)
    return {
        "map": token_map or "none (full vocabulary)",
        "ids": None if token_map is None else len(read_token_map(token_map)),
        "columns": None if columns is None else int(columns.token_ids.shape[0]),
        "accept_length": float(hist.mean()),
        "per_position": [float(np.mean(hist > i + 1)) for i in range(args.steps)],
        "outputs": [list(r.output_ids) for r in reqs],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=str(DEFAULT_MODEL))
    parser.add_argument("--token-maps", nargs="*", default=[], help="Map files to compare.")
    parser.add_argument("--steps", type=int, default=3, help="speculative_num_steps")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=160)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=8, help="max_running_requests")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    model = load_model(args.model_path)
    prompts = held_out_prompts(
        model.tokenizer, args.prompts, args.prompt_tokens, args.new_tokens, args.seed
    )
    results = [run(model, prompts, args, m) for m in [None, *args.token_maps]]
    vocab = model.config.vocab_size
    print(
        f"{len(prompts)} held-out prompts of {args.prompt_tokens} tokens, {args.new_tokens} new "
        f"tokens each, greedy, speculative_num_steps={args.steps}, vocabulary {vocab}\n"
    )
    print("| token map | ids in file | draft columns | accept length | per position | same out |")
    print("|---|---|---|---|---|---|")
    for r in results:
        same = r["outputs"] == results[0]["outputs"]
        positions = " ".join(f"{a:.2f}" for a in r["per_position"])
        ids = vocab if r["ids"] is None else r["ids"]
        columns = vocab if r["columns"] is None else r["columns"]
        print(
            f"| {r['map']} | {ids} | {columns} | {r['accept_length']:.3f} | {positions} | {same} |"
        )
    return results


if __name__ == "__main__":
    main()
