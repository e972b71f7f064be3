"""Pool sizes from device memory: SGLang's ``--mem-fraction-static``.

The fraction of one device's memory covers the weights and every pool; what is left of it
after the weights and the fixed pools (request tables, token counts, grammar masks) is
split between the KV pool and the recurrent-state slot pool by
``--mamba-full-memory-ratio`` (state : KV, SGLang's rule and default). A size given on the
command line (``--max-total-tokens`` or ``--max-mamba-cache-size``) is kept and the other
pool takes the rest. The remaining ``1 - fraction`` is left to XLA's temporaries.

``device_memory`` reads the memory the first device's allocator may use (on a GPU,
``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the card: 75 % unless set); on the CPU backend,
where jax reports none, the host's physical memory. ``plan_pools`` is pure given that
figure; ``apply_pool_plan`` folds the plan into ``EngineConfig`` keywords and logs it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MEM_FRACTION = 0.85  # on accelerators when --mem-fraction-static is not given
DEFAULT_MAMBA_FULL_MEMORY_RATIO = 0.9  # SGLang's: state bytes / KV bytes
# The host keeps a free list entry per KV page and state slot; past this many pages the
# list costs more host memory than a larger pool can serve (a 2-layer toy model on an
# 80 GB card would otherwise get tens of millions of pages).
MAX_PLANNED_KV_PAGES = 2**21
# The running batch of a server whose pools are planned from memory, unless
# --max-running-requests is given (the state slots may cap it lower: ``plan_memory``). The
# fixed default of 16 queues requests past it: at concurrency 64 three in four waited for
# a whole batch to finish before their prefill began. SGLang sizes its batch from memory too.
PLANNED_RUNNING = 128


@dataclass(frozen=True)
class PoolPlan:
    """Per-device bytes of one memory plan (what ``apply_pool_plan`` logs)."""

    platform: str
    memory_bytes: int  # what the device's allocator may use
    fraction: float
    weight_bytes: int
    fixed_bytes: int  # request tables, token counts, grammar masks
    kv_bytes_per_token: int  # target and draft head, on one device
    kv_tokens: int
    slot_bytes: int  # one state slot over all recurrent layers, on one device
    state_slots: int

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    @property
    def state_bytes(self) -> int:
        return self.state_slots * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.fixed_bytes + self.kv_bytes + self.state_bytes


def device_memory() -> tuple[str, int]:
    """(platform, bytes) of the first device: its allocator's ``bytes_limit``, or on a
    backend that reports none (CPU), the host's physical memory."""
    import jax

    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit:
        return device.platform, int(limit)
    return device.platform, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _nbytes(leaf: Any) -> int:
    return math.prod(leaf.shape) * leaf.dtype.itemsize


def weight_bytes(model_cfg: Any, dtype: str) -> int:
    """Bytes of the model's weights in ``dtype`` (leaves that keep their own dtype in it),
    from the family's weight plan; the MTP head counted when the config declares one."""
    import jax.numpy as jnp
    from jax.tree_util import tree_leaves

    from lazyspec.models.registry import family_module

    heads: dict[str, Any] = {"mtp": None} if model_cfg.has_mtp else {}
    if not model_cfg.tie_word_embeddings:
        heads["lm_head"] = None
    plan = family_module(model_cfg.family).weight_plan(model_cfg, heads)
    leaves = tree_leaves(plan, is_leaf=lambda node: hasattr(node, "param_shape"))
    return sum(
        math.prod(leaf.param_shape) * jnp.dtype(leaf.dtype or dtype).itemsize for leaf in leaves
    )


def plan_pools(
    config: Any,
    model_cfg: Any,
    platform: str,
    memory_bytes: int,
    fraction: float,
    ratio: float = DEFAULT_MAMBA_FULL_MEMORY_RATIO,
    given_tokens: int | None = None,
    given_slots: int | None = None,
) -> PoolPlan:
    """The KV tokens and state slots that fill ``fraction`` of ``memory_bytes`` (one device
    of ``config.tp_size``) after the weights and fixed pools; ``given_tokens`` /
    ``given_slots`` are kept as given. Pure. ValueError naming the figures when the
    fraction leaves no room for one request's pools."""
    from lazyspec.engine.runner import abstract_pools, kv_bytes_per_token, slot_bytes
    from lazyspec.scheduler.layout import plan_memory

    tp = config.tp_size
    # the longest context the layout can get: the request table's width at its largest
    context = config.context_length or model_cfg.max_position_embeddings
    probe = dataclasses.replace(config, max_total_tokens=context, max_mamba_cache_size=None)
    layout = plan_memory(probe, model_cfg)
    pools = abstract_pools(
        model_cfg, layout, config.spec_enabled, config.dtype, config.mamba_ssm_dtype
    )
    kv_split = tp if tp <= model_cfg.num_kv_heads else 1  # replicated past the KV heads
    per_token = kv_bytes_per_token(pools)
    if pools.mtp_kv is not None:
        per_token += sum(_nbytes(p) // p.shape[0] for p in pools.mtp_kv.k + pools.mtp_kv.v)
    per_token = -(-per_token // kv_split)
    per_slot = -(-slot_bytes(pools) // tp)
    fixed = sum(
        _nbytes(p)
        for p in (pools.req_to_token, pools.output_counts, pools.in_prompt, pools.vocab_mask)
    )
    weights = -(-weight_bytes(model_cfg, config.dtype) // tp)
    budget = int(fraction * memory_bytes) - weights - fixed
    if given_slots is not None:
        state = given_slots * per_slot
    elif given_tokens is not None:
        state = budget - given_tokens * per_token
    else:
        state = int(budget * ratio / (1 + ratio))
    slots = given_slots if given_slots is not None else max(0, state) // per_slot
    page = config.page_size
    if given_tokens is not None:
        tokens = given_tokens
    else:
        pages = min(max(0, budget - slots * per_slot) // (per_token * page), MAX_PLANNED_KV_PAGES)
        tokens = pages * page
    peak = config.strategy.peak_slots
    least = min(context, config.chunked_prefill_size)
    if tokens < least or slots < peak:
        raise ValueError(
            f"--mem-fraction-static={fraction} of {memory_bytes / 2**30:.2f} GiB leaves "
            f"{budget / 2**30:.2f} GiB after {weights / 2**30:.2f} GiB of weights and "
            f"{fixed / 2**20:.1f} MiB of request tables: room for {tokens} KV tokens and "
            f"{slots} state slots, fewer than one request needs ({least} tokens, {peak} slots); "
            "raise the fraction or give --max-total-tokens and --max-mamba-cache-size"
        )
    return PoolPlan(
        platform, memory_bytes, fraction, weights, fixed, per_token, tokens, per_slot, slots
    )


def apply_pool_plan(
    kwargs: dict[str, Any],
    fraction: float | None,
    ratio: float = DEFAULT_MAMBA_FULL_MEMORY_RATIO,
) -> PoolPlan | None:
    """Size the pools of the ``EngineConfig`` keywords ``kwargs`` (mutated:
    ``max_total_tokens``, ``max_mamba_cache_size`` and an unset ``max_running_requests``,
    which becomes ``PLANNED_RUNNING``) from the device's memory: with ``fraction`` given,
    or on an accelerator with ``DEFAULT_MEM_FRACTION``; on the CPU backend without
    ``fraction``, nothing changes (returns None). Both sizes given: nothing to plan. Logs
    the plan."""
    given_tokens = kwargs.get("max_total_tokens")
    given_slots = kwargs.get("max_mamba_cache_size")
    if given_tokens is not None and given_slots is not None:
        if fraction is not None:
            logger.warning(
                "--mem-fraction-static=%s is not used: --max-total-tokens and "
                "--max-mamba-cache-size size both pools",
                fraction,
            )
        return None
    platform, memory = device_memory()
    if fraction is None:
        if platform == "cpu":
            return None
        fraction = DEFAULT_MEM_FRACTION
    from lazyspec.config import EngineConfig
    from lazyspec.models.registry import load_model_config

    if kwargs.get("max_running_requests") is None:  # the request tables are sized for it
        kwargs["max_running_requests"] = PLANNED_RUNNING
    config = EngineConfig(**kwargs)
    model_cfg = load_model_config(config.model_path)
    plan = plan_pools(
        config, model_cfg, platform, memory, fraction, ratio, given_tokens, given_slots
    )
    kwargs["max_total_tokens"] = plan.kv_tokens
    kwargs["max_mamba_cache_size"] = plan.state_slots
    logger.info(
        "pools from %s memory %.2f GiB x mem_fraction_static %s = %.2f GiB: weights %.2f GiB, "
        "request tables %.1f MiB, KV %.2f GiB (%d tokens x %d B), state %.2f GiB (%d slots x "
        "%d B), %.2f GiB left for temporaries; up to %d running requests",
        plan.platform,
        memory / 2**30,
        fraction,
        fraction * memory / 2**30,
        plan.weight_bytes / 2**30,
        plan.fixed_bytes / 2**20,
        plan.kv_bytes / 2**30,
        plan.kv_tokens,
        plan.kv_bytes_per_token,
        plan.state_bytes / 2**30,
        plan.state_slots,
        plan.slot_bytes,
        (memory - plan.total_bytes) / 2**30,
        kwargs["max_running_requests"],
    )
    if given_tokens is None and plan.kv_tokens == MAX_PLANNED_KV_PAGES * config.page_size:
        logger.info(
            "KV pool capped at %d pages (the host's free list); --max-total-tokens sets more",
            MAX_PLANNED_KV_PAGES,
        )
    return plan
