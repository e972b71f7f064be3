"""Prefill against the compute floor: the FLOPs a prefill must do, the matmul peak measured
in the same run, the engine's prefill time through its public API, and transformers' as the
peer.

The FLOPs counted are the products no implementation avoids: every weight matrix once per
token (2 FLOPs a parameter; routed experts at their ``top_k / num_experts`` share; the
embedding is a gather and the language-model head runs for the last token only), causal
attention's two products (``4 * heads * head_dim`` per query-key pair, ``L (L + 1) / 2``
pairs a layer), and each recurrent layer's state read-out and rank-one update
(``4 * heads * d_a * d_b`` a token). The floor is those FLOPs over the bf16 matmul rate
measured on random data in the same process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.bench.floor import _moe_shape, _path
from lazyspec.bench.kernel_timing import time_calls


@dataclass(frozen=True)
class PrefillFlops:
    weights: float  # weight matrices (experts by their routed share), lm_head for one token
    attention: float  # causal QK^T and PV
    recurrent: float  # state read-out and update

    @property
    def total(self) -> float:
        return self.weights + self.attention + self.recurrent


def prefill_flops(params: Any, cfg: Any, num_tokens: int) -> PrefillFlops:
    """The FLOPs of prefilling one prompt of ``num_tokens`` tokens (module docstring);
    ``params`` may hold arrays or shapes. The MTP head (``mtp``) is not counted."""
    num_experts, top_k = _moe_shape(cfg)
    weights = 0.0
    for keys, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path, size = _path(keys), float(np.prod(leaf.shape))
        if len(leaf.shape) < 2 or "mtp" in path or "embed" in path:
            continue
        if "lm_head" in path:
            weights += 2.0 * size  # the last position's logits
        elif "experts" in path and num_experts:
            weights += 2.0 * num_tokens * size * top_k / num_experts
        else:
            weights += 2.0 * num_tokens * size
    if cfg.tie_word_embeddings:
        weights += 2.0 * cfg.vocab_size * cfg.hidden_size
    pairs = num_tokens * (num_tokens + 1) / 2
    per_pair = 4.0 * cfg.num_attention_heads * cfg.head_dim
    attention = len(cfg.attention_layer_ids) * per_pair * pairs
    per_token = 4.0 * cfg.ssm_heads * cfg.ssm_dim_a * cfg.ssm_dim_b
    recurrent = len(cfg.recurrent_layer_ids) * per_token * num_tokens
    return PrefillFlops(weights=weights, attention=attention, recurrent=recurrent)


def matmul_peak(size: int = 8192, iters: int = 50, warmup_s: float = 1.0) -> float:
    """FLOP/s of a jitted ``size``-cubed bf16 product (float32 accumulation) on random
    data: the compute floor's rate, measured where the prefill runs. The median of
    ``iters`` products after ``warmup_s`` seconds of them, long enough for a GPU's clocks
    to settle under load: after three warm-up products (a few ms), H100 readings ranged
    from 494 to 693 TFLOP/s between processes (benchmarks/log/2026-12-08-h100-kernel-
    tests-and-gdn-inverse.md)."""
    keys = jax.random.split(jax.random.key(0), 2)
    a, b = (jax.random.normal(k, (size, size), jnp.bfloat16) for k in keys)
    product = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    run = lambda: product(a, b).block_until_ready()  # noqa: E731
    run()  # compiles
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        run()
    return 2.0 * size**3 / time_calls(run, iters, warmup=0)


def _median_seconds(prepare: Callable[[], Callable[[], object]], repeats: int) -> float:
    """Median seconds of ``repeats`` calls, each of what ``prepare()`` returns (made fresh,
    outside the timing, and blocking until its result is ready), after one call that is not
    counted (it compiles)."""
    samples = []
    for attempt in range(repeats + 1):
        call = prepare()
        start = time.perf_counter()
        call()
        if attempt:
            samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def engine_prefill_seconds(engine: Any, prompt_len: int, repeats: int = 3) -> float:
    """Median seconds of ``engine.generate`` with one new token over a fresh random prompt
    of ``prompt_len`` tokens (the cache flushed first, so the radix tree holds nothing of
    it); the first call (compiles) is not counted."""
    rng = np.random.default_rng(prompt_len)
    vocab = engine.model.config.vocab_size
    params = {"max_new_tokens": 1, "ignore_eos": True}

    def prepare() -> Callable[[], object]:
        engine.flush_cache()
        prompt = [int(t) for t in rng.integers(1, vocab, size=prompt_len)]
        return lambda: engine.generate(input_ids=prompt, sampling_params=params)

    return _median_seconds(prepare, repeats)


def transformers_prefill_seconds(
    hf_config: dict, prompt_lens: Sequence[int], repeats: int = 3
) -> dict[int, float]:
    """Median seconds of transformers' forward over one prompt of each length (random bf16
    weights on the GPU, built once; the kernels transformers picks with what is installed:
    fla / mamba_ssm when present), logits of the last position only."""
    import torch
    import transformers

    hf = dict(hf_config)
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()

    def forward(ids) -> None:
        with torch.no_grad():
            model(input_ids=ids, logits_to_keep=1)
        torch.cuda.synchronize()

    seconds = {}
    for length in prompt_lens:
        rng = np.random.default_rng(length)

        def prepare(length=length, rng=rng) -> Callable[[], object]:
            ids = torch.tensor(rng.integers(1, config.vocab_size, size=(1, length)), device="cuda")
            torch.cuda.synchronize()
            return lambda: forward(ids)

        seconds[length] = _median_seconds(prepare, repeats)
    model = None  # the weights' memory back to torch, then to the device, before the engines
    torch.cuda.empty_cache()
    return seconds
