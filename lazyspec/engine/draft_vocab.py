"""The draft head's reduced vocabulary (a speculative token map, ``lazyspec/token_map.py``).

``DraftVocab`` holds the lm_head's columns of the map's ids as one ``[hidden, K]`` matrix and
the ids themselves. ``Runner`` builds it once at start-up and keeps it in the params under
``DRAFT_VOCAB``, so every jitted step receives it with the weights; the params' pytree
structure then says whether a map is in force, and the steps compile one form or the other.

Placement follows the rule table for lm_head columns (``("embed", "vocab")``: the K columns
are sharded over tp like the lm_head's, replicated where tp does not divide K); the ids are
replicated. ``draft_argmax`` is the greedy draft of one chain step either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lazyspec.engine.sharding import ShardingPlan

DRAFT_VOCAB = "draft_vocab"  # the params key of the reduced draft head
LM_HEAD_COLUMN_AXES = ("embed", "vocab")  # the lm_head's logical axes (rule table)


@jax.tree_util.register_dataclass
@dataclass
class DraftVocab:
    lm_head: jax.Array  # [hidden, K]: the lm_head's columns of token_ids
    token_ids: jax.Array  # [K] int32, sorted, the last id repeated up to a multiple of 128


def build_draft_vocab(
    family: Any, cfg: Any, params: dict, token_ids: np.ndarray, sharding: ShardingPlan
) -> DraftVocab:
    """Gather the lm_head columns of ``token_ids`` (``draft_token_ids``' output) from the
    placed ``params``, straight into their shardings; reads ``params`` only."""
    if not hasattr(family, "lm_head_columns"):
        raise ValueError(
            f"speculative_token_map: the {getattr(family, '__name__', family)!r} family's "
            "draft head cannot score a reduced vocabulary"
        )
    hidden, width = cfg.hidden_size, len(token_ids)
    shardings = DraftVocab(
        lm_head=sharding.sharding(LM_HEAD_COLUMN_AXES, (hidden, width)),
        token_ids=sharding.replicated,
    )

    def gather(params, ids):
        return DraftVocab(lm_head=family.lm_head_columns(params, cfg, ids), token_ids=ids)

    ids = jax.device_put(np.asarray(token_ids, np.int32), sharding.replicated)
    return jax.jit(gather, out_shardings=shardings)(params, ids)


def draft_argmax(family: Any, cfg: Any, params: dict, mtp_hidden: jax.Array) -> jax.Array:
    """The greedy draft ``[B]`` int32 from the MTP hidden ``[B, hidden]``: the argmax of the
    MTP logits over the whole vocabulary or, when ``params`` holds a ``DraftVocab``, over
    its ids only (the argmax's column mapped back to the full id)."""
    head = params.get(DRAFT_VOCAB)
    if head is None:
        logits = family.compute_mtp_logits(params, cfg, mtp_hidden[:, None])[:, 0]
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = family.compute_mtp_logits(params, cfg, mtp_hidden[:, None], lm_head=head.lm_head)
    return head.token_ids[jnp.argmax(logits[:, 0], axis=-1)]
