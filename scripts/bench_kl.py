"""KL between cache-hit generations and a cache-free recompute of the same sequence.

Two cases, as in SGLang's KL kit:
* prefill-cache-hit: prefill the prompts (max_new_tokens=0) so their in-prompt checkpoints
  are cached, then generate with logprobs (a cache hit);
* decode-cache-hit: generate turn 1, then turn 2 = prompt + output + one new token, which
  hits a checkpoint written during decode (cached_tokens > prompt length).
The sampled tokens' logprobs are compared with ``reference_logits`` (full recompute, no
cache) on the same sequence: k3 = mean(exp(r) - 1 - r), r = lp_reference - lp_engine,
averaged over samples. Per strategy, speculation on and off.

    python scripts/bench_kl.py --num-prompts 8 --out kl.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def reference_logprobs(model, ids: list[int], start: int, bucket: int = 256) -> np.ndarray:
    """log p(ids[t] | ids[:t]) for t >= start, by cache-free recompute (padded: causal)."""
    from lazyspec.models import reference_logits

    padded = -(-len(ids) // bucket) * bucket
    logits = reference_logits(model, list(ids) + [0] * (padded - len(ids)))[: len(ids)]
    logits = logits - logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return np.array([logp[t - 1, ids[t]] for t in range(start, len(ids))])


def k3(lp_engine: np.ndarray, lp_reference: np.ndarray) -> float:
    r = lp_reference - lp_engine
    return float(np.mean(np.exp(r) - 1 - r))


def _engine(model, strategy: str, spec: bool, args):
    from lazyspec.engine.engine import Engine

    kw = dict(speculative_algorithm="NEXTN", speculative_num_steps=3) if spec else {}
    return Engine(
        model=model,
        mamba_scheduler_strategy=strategy,
        mamba_track_interval=args.interval,
        mamba_chunk_size=args.chunk,
        chunked_prefill_size=256,
        max_running_requests=8,
        max_total_tokens=65536,
        context_length=1024,
        skip_warmup=True,
        **kw,
    )


def _engine_logprobs(out: dict) -> np.ndarray:
    return np.array([lp for lp, _ in out["meta_info"]["output_token_logprobs"]])


def run_case(model, strategy: str, spec: bool, case: str, prompts, args) -> tuple[float, int]:
    engine = _engine(model, strategy, spec, args)
    params = {"max_new_tokens": args.output_len, "ignore_eos": True}
    if case == "prefill":
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0})
        seqs = prompts
    else:
        first = engine.generate(input_ids=prompts, sampling_params=params)
        seqs = [p + o["output_ids"] + [7] for p, o in zip(prompts, first)]
    outs = engine.generate(input_ids=seqs, sampling_params=params, return_logprob=True)
    values, hits = [], 0
    for seq, out in zip(seqs, outs):
        need = (len(seq) - args.output_len) if case == "decode" else 0  # > prompt + 1
        if out["meta_info"]["cached_tokens"] <= need:
            continue
        hits += 1
        ids = seq + out["output_ids"]
        values.append(k3(_engine_logprobs(out), reference_logprobs(model, ids, len(seq))))
    engine.check_integrity()
    return (float(np.mean(values)) if values else float("nan")), hits


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF folder; default: tiny random Qwen3-Next")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--interval", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--strategies", default="extra_buffer,extra_buffer_lazy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.model_path:
        from lazyspec.models import load_model

        model = load_model(args.model_path)
    else:
        from lazyspec.testing.tiny_models import tiny_model

        model = tiny_model("qwen3_next")
    rng = np.random.default_rng(args.seed)
    prompts = [
        [int(t) for t in rng.integers(3, model.config.vocab_size, size=args.prompt_len)]
        for _ in range(args.num_prompts)
    ]
    lines = [
        "| strategy | spec | prefill-cache KL | hits | decode-cache KL | hits |",
        "|---|---|---|---|---|---|",
    ]
    for strategy in args.strategies.split(","):
        for spec in (False, True):
            pre, pre_hits = run_case(model, strategy, spec, "prefill", prompts, args)
            dec, dec_hits = run_case(model, strategy, spec, "decode", prompts, args)
            lines.append(
                f"| {strategy} | {'NEXTN' if spec else 'off'} | {pre:.2e} | "
                f"{pre_hits}/{len(prompts)} | {dec:.2e} | {dec_hits}/{len(prompts)} |"
            )
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
