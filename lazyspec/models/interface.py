"""The device-side contract between the engine and a model family.

Every family module (``qwen3_next.py``, ``nemotron_h.py``) exposes the same functions over
these pytrees, so the runner never branches on the family:

``forward(params, cfg, inputs, kv, rec, *, mode, chunk_size=64, kernels=XLA_KERNELS,
keep_chunk=None)`` -> ``(hidden, kv, RecurrentOut)``

``cfg`` (the family's ``ModelConfig``), ``mode``, ``chunk_size`` and ``kernels`` are static:
they hash and compare by value, so jit takes them as static arguments.

* ``inputs`` is a ``ForwardInputs``: B rows of T token slots; row b's new tokens are
  ``tokens[b, :num_new[b]]`` (the rest is padding and must not change any state).
* ``kv`` is a ``KVPools``: one (k, v) pair per attention layer, each
  ``[num_kv_rows, n_kv_heads, head_dim]``; row 0 is the null row and is never written.
  New tokens' K/V are scattered to ``kv_write_idx`` (out-of-range sentinel = dropped), then
  each query attends to the row's context through ``kv_read_idx`` (positions 0..ctx_len-1,
  causal by absolute position).
* ``rec`` is the state *before* the new tokens, one entry per recurrent layer and row:
  ``StateRows`` gathered by the runner from the slot pools, or a ``PoolView``, the pools
  themselves with row b at slot ``slot[b]``. ``rec.layer(l)`` hands layer l its rows (from
  a ``PoolView`` the ssm rows as ``PoolRows``, which a state-update kernel reads in place,
  ungathered; from a writing ``PoolView`` the conv rows too, for the conv kernel).
* ``mode`` (static): ``"extend"`` (prefill chunk; also returns the state after every
  ``chunk_size`` tokens of the row, ``RecurrentOut.chunks``: ``ChunkStates``, stacked),
  ``"decode"`` (T=1) or ``"verify"`` (T=D; also returns the state after every position,
  ``RecurrentOut.steps``: ``StepStates``, one array per layer). ``RecurrentOut.final``
  (``StateRows``) is the state after each row's new tokens. ``"decode"`` from a
  ``PoolView`` writes in place instead: each layer's new state goes straight into the
  pools at each row's slot (rows at slot 0 write nothing), through the state-update and
  conv kernels' decode modes or a masked scatter; ``RecurrentOut.pools`` is the written view
  and there is no ``final``.
* ``kernels`` (static): the ``kernels.backend.Kernels`` of the engine's backend, resolved
  once; the recurrent layers' decode / verify state update runs in its kernel when it has
  one (``XLA_KERNELS`` has none: the jnp token scans).
* ``keep_chunk`` (extend only, optional ``[B]`` int): return only the state after chunk
  ``keep_chunk[b]`` of each row (``chunks`` then has one entry per row), selected layer by
  layer so the other chunk states of all layers never have to exist at once.
* ``hidden`` is the residual stream after the last layer, *before* the final norm
  ([B, T, hidden]); ``compute_logits(params, cfg, hidden)`` applies the final norm and lm_head.

``mtp_forward(params, cfg, hidden, next_tokens, inputs, mtp_kv, *, kernels=)`` ->
``(mtp_hidden, mtp_kv)``: the draft head (one decoder layer, its own KV pools; its attention
and experts in ``kernels``, the XLA forms by default); logits via ``compute_mtp_logits``, or,
with a speculative token map, ``compute_mtp_logits(..., lm_head=lm_head_columns(params, cfg,
ids))``: the logits of those ids only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from lazyspec.kernels.backend import XLA_KERNELS, Kernels


@jax.tree_util.register_dataclass
@dataclass
class ForwardInputs:
    tokens: jax.Array  # [B, T] int32
    positions: jax.Array  # [B, T] int32, absolute positions of the new tokens
    num_new: jax.Array  # [B] int32, valid new tokens per row (0 = padding row)
    kv_write_idx: jax.Array  # [B, T] int32, KV row per new token; out of range = dropped
    kv_read_idx: jax.Array  # [B, C] int32, KV rows of context positions 0..C-1
    ctx_len: jax.Array  # [B] int32, context length incl. the new tokens


def real_tokens(inputs: ForwardInputs) -> jax.Array:
    """``[B * T]`` bool: token t of row b is one of the row's ``num_new`` new tokens (not
    padding), in the order of ``tokens.reshape(-1)``."""
    num_pos = inputs.tokens.shape[1]
    return (jnp.arange(num_pos)[None, :] < inputs.num_new[:, None]).reshape(-1)


@jax.tree_util.register_dataclass
@dataclass
class KVPools:
    k: list[jax.Array]  # per attention layer [num_kv_rows, n_kv_heads, head_dim]
    v: list[jax.Array]


@dataclass(frozen=True)
class PoolRows:
    """Rows ``pool[layer, slot[b]]`` of a stacked state pool, not gathered yet: a state-update
    kernel reads them in place; every other form calls ``rows()``. ``write``: the decode
    step writes the rows' new state back in place (a kernel in its decode mode; the caller
    scatters the rows of a form without one)."""

    pool: jax.Array  # [L_rec, S+1, ...]
    slot: jax.Array  # [B]
    layer: int
    write: bool = False

    @property
    def dtype(self):
        return self.pool.dtype

    def rows(self) -> jax.Array:
        return self.pool[self.layer][self.slot]


@jax.tree_util.register_dataclass
@dataclass
class StateRows:
    """Recurrent state gathered per row: one entry per recurrent layer and row."""

    conv: jax.Array  # [L_rec, B, conv_dim, K-1]
    ssm: jax.Array  # [L_rec, B, H, d_a, d_b]

    def layer(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """(conv rows [B, ...], ssm rows [B, ...]) of recurrent layer ``layer``."""
        return self.conv[layer], self.ssm[layer]


@jax.tree_util.register_dataclass
@dataclass
class PoolView:
    """The slot pools themselves, row b's state at ``slot[b]``: handed over ungathered, so a
    state-update kernel reads the rows in place. ``write`` (static; set by ``for_mode`` in
    decode): the forward writes each layer's new state into the pools (``written``)."""

    conv_pool: jax.Array  # [L_rec, S+1, conv_dim, K-1]
    ssm_pool: jax.Array  # [L_rec, S+1, H, d_a, d_b]
    slot: jax.Array  # [B] int
    write: bool = field(default=False, metadata={"static": True})

    def layer(self, layer: int) -> tuple[jax.Array | PoolRows, PoolRows]:
        """(conv rows, ``PoolRows`` of the ssm rows) of recurrent layer ``layer``. The conv
        rows are gathered ``[B, conv_dim, K-1]``, except in a writing view, where they too are
        ``PoolRows`` (a conv kernel writes them in place; any other form gathers them)."""
        ssm = PoolRows(self.ssm_pool, self.slot, layer, self.write)
        if self.write:
            return PoolRows(self.conv_pool, self.slot, layer, True), ssm
        return self.conv_pool[layer][self.slot], ssm

    def written(
        self,
        layer: int,
        conv: jax.Array | None,
        ssm: jax.Array | None = None,
        ssm_pool: jax.Array | None = None,
        conv_pool: jax.Array | None = None,
    ) -> PoolView:
        """This view after recurrent layer ``layer`` wrote its new state: either the conv rows
        ``[B, conv_dim, K-1]`` scattered into ``slot[b]`` or ``conv_pool``, the stacked pool a
        conv kernel returned with the rows already written; the same for the ssm rows
        ``[B, ...]`` or ``ssm_pool`` from a state-update kernel (pools taken as they are).
        Rows at slot 0 write nothing. Pure."""
        target = jnp.where(self.slot != 0, self.slot, self.conv_pool.shape[1])  # 0: dropped

        def scatter(pool: jax.Array, rows: jax.Array) -> jax.Array:
            return pool.at[layer, target].set(rows.astype(pool.dtype), mode="drop")

        if ssm_pool is None:
            ssm_pool = scatter(self.ssm_pool, ssm)
        if conv_pool is None:
            conv_pool = scatter(self.conv_pool, conv)
        return PoolView(conv_pool, ssm_pool, self.slot, self.write)

    def rows(self) -> StateRows:
        """Every layer's rows, gathered."""
        return StateRows(conv=self.conv_pool[:, self.slot], ssm=self.ssm_pool[:, self.slot])


@jax.tree_util.register_dataclass
@dataclass
class StepStates:
    """verify: the state after every position, one array per recurrent layer (never stacked:
    the engine commits layer by layer from the kernels' own outputs)."""

    conv: list[jax.Array]  # per recurrent layer [B, T, conv_dim, K-1]
    ssm: list[jax.Array]  # per recurrent layer [B, T, H, d_a, d_b]


@jax.tree_util.register_dataclass
@dataclass
class ChunkStates:
    """extend: the state after every ``chunk_size`` tokens of each row (or only the chunk
    ``keep_chunk`` names), stacked over the recurrent layers."""

    conv: jax.Array  # [L_rec, B, N, conv_dim, K-1], after (j+1)*chunk tokens
    ssm: jax.Array  # [L_rec, B, N, H, d_a, d_b]


class LayerStates(NamedTuple):
    """One recurrent layer's states after a forward: final ``[B, ...]`` and the trace
    ``[B, S, ...]`` (the state after every step, or every chunk); written in place by a
    kernel, the pools it returned instead (``ssm_pool`` / ``conv_pool``, the rows None)."""

    conv: jax.Array | None
    ssm: jax.Array | None
    conv_trace: jax.Array | None
    ssm_trace: jax.Array | None
    ssm_pool: jax.Array | None = None
    conv_pool: jax.Array | None = None


def gathered(ssm0: jax.Array | PoolRows) -> jax.Array:
    """The rows as an array (gathering ``PoolRows``)."""
    return ssm0.rows() if isinstance(ssm0, PoolRows) else ssm0


def keep_chunk_states(trace: jax.Array, keep_chunk: jax.Array | None) -> jax.Array:
    """``[B, S, ...]`` per-chunk states -> ``[B, 1, ...]``, row b's entry ``keep_chunk[b]``
    (clamped into range); unchanged when ``keep_chunk`` is None or there are no chunks."""
    if keep_chunk is None or trace.shape[1] == 0:
        return trace
    rows = jnp.arange(trace.shape[0])
    return trace[rows, jnp.clip(keep_chunk, 0, trace.shape[1] - 1)][:, None]


@jax.tree_util.register_dataclass
@dataclass
class RecurrentOut:
    final: StateRows | None  # after each row's num_new tokens (None when written in place)
    steps: StepStates | None  # verify only
    chunks: ChunkStates | None  # extend only
    pools: PoolView | None = None  # decode from a PoolView: the pools, every layer written


def for_mode(rec: StateRows | PoolView, mode: str) -> StateRows | PoolView:
    """``rec`` as a forward in ``mode`` reads it: a ``PoolView`` in decode is written in place
    (``PoolView.write``); anything else is returned as it is."""
    if mode == "decode" and isinstance(rec, PoolView):
        return PoolView(rec.conv_pool, rec.ssm_pool, rec.slot, write=True)
    return rec


def after_layer(
    rec: StateRows | PoolView,
    layer: int,
    conv: jax.Array | None,
    ssm: jax.Array | None,
    ssm_pool: jax.Array | None = None,
    conv_pool: jax.Array | None = None,
) -> StateRows | PoolView:
    """``rec`` after recurrent layer ``layer`` left the states ``conv`` / ``ssm`` rows (or the
    pools its kernels wrote, ``conv_pool`` / ``ssm_pool``): a writing ``PoolView`` takes them
    (``PoolView.written``), so the next layer reads the pools this one returned; anything
    else is returned as it is."""
    if isinstance(rec, PoolView) and rec.write:
        return rec.written(layer, conv, ssm, ssm_pool, conv_pool)
    return rec


def recurrent_out(layers: list[LayerStates], rec: StateRows | PoolView, mode: str) -> RecurrentOut:
    """Per-layer states as the ``RecurrentOut`` that ``mode`` promises: ``final`` stacked
    (``[L_rec, B, ...]``); the trace as ``steps`` in verify (kept per layer), as stacked
    ``chunks`` in extend, dropped in decode. With no recurrent layer, ``final`` is ``rec``'s
    (empty) rows and there is no trace. A writing ``PoolView`` (decode, every layer's state
    already in it through ``after_layer``) is returned as ``pools``, with no ``final``."""
    if isinstance(rec, PoolView) and rec.write:
        return RecurrentOut(final=None, steps=None, chunks=None, pools=rec)
    if not layers:
        final = rec if isinstance(rec, StateRows) else rec.rows()
        return RecurrentOut(final=final, steps=None, chunks=None)
    conv_traces, ssm_traces = [s.conv_trace for s in layers], [s.ssm_trace for s in layers]
    return RecurrentOut(
        final=StateRows(
            conv=jnp.stack([s.conv for s in layers]), ssm=jnp.stack([s.ssm for s in layers])
        ),
        steps=StepStates(conv=conv_traces, ssm=ssm_traces) if mode == "verify" else None,
        chunks=(
            ChunkStates(conv=jnp.stack(conv_traces), ssm=jnp.stack(ssm_traces))
            if mode == "extend"
            else None
        ),
    )


class ModelFamily(Protocol):
    """What a family module provides (registered once in ``registry.FAMILIES``); the engine
    and the oracles call only these. ``cfg`` is the family's ``ModelConfig``."""

    def parse_config(self, hf: dict[str, Any]) -> Any: ...

    def load_params(self, cfg: Any, reader: Any, dtype: Any, place: Any = None) -> dict: ...

    def init_params(self, cfg: Any, key: jax.Array, dtype: Any) -> dict: ...

    def weight_plan(self, cfg: Any, params: dict) -> dict: ...

    def forward(
        self,
        params: dict,
        cfg: Any,
        inputs: ForwardInputs,
        kv: KVPools,
        rec: StateRows | PoolView,
        *,
        mode: str,
        chunk_size: int = 64,
        kernels: Kernels = XLA_KERNELS,
        keep_chunk: jax.Array | None = None,
    ) -> tuple[jax.Array, KVPools, RecurrentOut]: ...

    def reference_forward(self, params: dict, cfg: Any, tokens: jax.Array) -> jax.Array: ...

    def compute_logits(self, params: dict, cfg: Any, hidden: jax.Array) -> jax.Array: ...
