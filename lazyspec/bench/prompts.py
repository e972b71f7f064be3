"""Prompts for benchmarks of the embedded default model: held-out windows of its corpus."""

from __future__ import annotations

import numpy as np

from lazyspec.training import corpus


def held_out_prompts(tokenizer, num_prompts: int, prompt_len: int, new_tokens: int, seed: int):
    """One window of ``prompt_len`` tokens (after ``<|endoftext|>``) per validation file
    long enough for the window and ``new_tokens``, until ``num_prompts``."""
    root = corpus.stdlib_root()
    rng = np.random.default_rng(seed)
    prompts = []
    for name in (f for f in corpus.stdlib_files(root) if corpus.is_validation_file(f)):
        ids = tokenizer.encode(corpus.read_source(root / name)).ids
        if len(ids) < prompt_len + new_tokens:
            continue
        start = int(rng.integers(1, len(ids) - prompt_len - new_tokens + 1))
        prompts.append(ids[:1] + ids[start : start + prompt_len - 1])
        if len(prompts) == num_prompts:
            break
    return prompts
