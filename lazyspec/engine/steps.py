"""The jitted device steps: ``(params, pools, batch) -> (outputs, pools)``, pools donated.

Two step kinds, both written for an overlapped host loop (the host never needs step n's
results to build step n+1):
* ``extend``: a prefill chunk per row. Reads the initial recurrent state from
  ``state_src_slot`` (slot 0 = zeros, the node slot of a cache hit = copy-on-write, or the
  row's own working slot for a later chunk), writes the final state into ``working_slot``
  (and ``copy_slot``: no_buffer's prefill-end copy) and the chunk's checkpoint (a
  chunk-boundary state on the prefill grid) into ``track_slot``.
* ``decode``: D tokens per row (D=1 without speculation; D = draft tokens + 1 with it), read
  from device-side per-request arrays (``last_token``, ``drafts``, ``seq_len``), so accepted
  tokens feed the next step without a host round trip. With D = 1 the model runs in decode
  mode on the pools: each recurrent layer writes its new state straight into the row's
  working slot (the update kernel's decode mode, aliased; a masked scatter in the jnp
  forms), and a row whose length crosses a multiple of the track interval then copies its
  working slot into its planned checkpoint slot, pool to pool (``state_copy``). With D > 1
  (verify) the layers write the state after every position into per-row scratch and the
  commit is two masked scatters from it (DESIGN §7).
  A decode step is also split in two programs, ``decode_forward`` (everything that needs no
  grammar mask: with D = 1 the in-place update and the checkpoint copy too, since such a
  step advances every row by exactly one token) and ``decode_finish`` (sampling under the
  masks, the verify commit, drafts), so that the host fills the masks of a batch with
  grammar rows while the forward runs; ``decode_step`` is the two fused.

Both steps first apply the request-table updates their batch carries to
``pools.req_to_token`` and then gather their rows' KV indices from it (``_read_table``):
the host sends table deltas, never whole rows.

The state commit (gather, scatter, checkpoint copy) is ``state_commit``'s.

Every scatter uses an out-of-range sentinel with ``mode="drop"`` for rows that must not
write, so slot 0, page 0 and request row 0 are never written.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from lazyspec.engine import packing  # noqa: F401  (registers the host batches as pytrees)
from lazyspec.engine.draft_vocab import draft_argmax
from lazyspec.engine.sampling import (
    TokenHistory,
    greedy_verify,
    processed_logits,
    prompt_logprobs,
    sample_from,
    target_probs,
    token_logprobs,
    top_logprobs,
    verify_and_sample,
    verify_history,
)
from lazyspec.engine.shard_kernels import per_shard
from lazyspec.engine.sharding import ShardingPlan
from lazyspec.engine.state_commit import (
    commit_picked,
    commit_verify,
    copy_checkpoint,
    gather_state,
    scatter_state,
)
from lazyspec.kernels.backend import Kernels, kernels_for
from lazyspec.kernels.tuning import Tuning
from lazyspec.models.interface import ForwardInputs, KVPools, PoolView, StepStates
from lazyspec.scheduler.batch import CountSeed, DecodeBatch, ExtendBatch
from lazyspec.scheduler.layout import IdSpaces
from lazyspec.scheduler.request import TOP_LOGPROBS

NO_DRAFT = -1  # pools.drafts: no draft for this position (verify rejects it)


@jax.tree_util.register_dataclass
@dataclass
class Pools:
    kv: KVPools
    mtp_kv: KVPools | None
    conv: jax.Array  # [L_rec, num_slots + 1, conv_dim, K-1]
    ssm: jax.Array  # [L_rec, num_slots + 1, H, d_a, d_b]
    seq_len: jax.Array  # [max_running + 1] int32, tokens covered by the working state
    last_token: jax.Array  # [max_running + 1] int32, next input token
    drafts: jax.Array  # [max_running + 1, max(1, S)] int32, draft tokens for the next verify
    req_to_token: jax.Array  # [max_running + 1, context_len] int32, the host table's copy
    # the penalties' token history per request row: exact for a request with penalties
    # (seeded when it is admitted, ``seed_counts``); other rows' values are never used (a
    # greedy decode step writes none)
    output_counts: jax.Array  # [max_running + 1, vocab] int32, times each token was output
    in_prompt: jax.Array  # [max_running + 1, vocab] bool, the prompt holds the token
    # allowed-token bitmasks of the rows with a grammar, per verify position (xgrammar's
    # int32 words), written by the host before each step that reads them
    vocab_mask: jax.Array  # [max_running + 1, D, ceil(V / 32)] int32


@dataclass(frozen=True)
class StepStatic(IdSpaces):
    """Static (compile-time) settings shared by all steps of one engine: the device subset of
    the engine's ``Layout`` (whose table names the ids and their sentinels)."""

    num_slots: int  # real slots 1..num_slots
    max_running: int  # real request rows 1..max_running
    num_kv_rows: int  # KV rows per pool, the null page's included
    chunk_size: int
    num_verify: int  # D
    spec: bool
    backend: str
    moe_runner: str = "auto"  # EngineConfig.moe_runner_backend
    sharding: ShardingPlan | None = None  # the runner's; the kernels run per shard of it
    tuning: Tuning | None = None  # the kernels' (None: the device's table, ``kernels_for``)
    page_size: int = 1  # KV pool rows a page (the TPU attention fetches whole pages)

    @property
    def kernels(self) -> Kernels:
        """The kernels of ``backend`` with ``tuning``, each run per shard of ``sharding``'s
        mesh (``shard_kernels.per_shard``); resolved once (both functions cache)."""
        kernels = kernels_for(
            self.backend, moe_runner=self.moe_runner, tuning=self.tuning, page_size=self.page_size
        )
        return kernels if self.sharding is None else per_shard(kernels, self.sharding)


def apply_table_updates(table: jax.Array, updates: jax.Array) -> jax.Array:
    """``table[row, position] = kv_row`` for each column of ``updates`` ``[3, U]``; columns
    whose row is the drop sentinel (one past the table) write nothing. Each (row, position)
    occurs once, so the result does not depend on the scatter's order."""
    return table.at[updates[0], updates[1]].set(updates[2], mode="drop")


def seed_counts(
    output_counts: jax.Array, in_prompt: jax.Array, seed: CountSeed
) -> tuple[jax.Array, jax.Array]:
    """Write one ``CountSeed`` into the token-count pools (both donated): zero its row first
    when ``seed.reset``, then set its tokens' counts and prompt marks. A seed of the
    drop-sentinel row writes nothing."""
    drop_row = output_counts.shape[0]
    reset_row = jnp.where(seed.reset, seed.req_row, drop_row)
    output_counts = output_counts.at[reset_row].set(0, mode="drop")
    in_prompt = in_prompt.at[reset_row].set(False, mode="drop")
    token_ids = jnp.where(seed.token_ids >= 0, seed.token_ids, output_counts.shape[1])
    output_counts = output_counts.at[seed.req_row, token_ids].set(seed.output_counts, mode="drop")
    in_prompt = in_prompt.at[seed.req_row, token_ids].set(seed.in_prompt, mode="drop")
    return output_counts, in_prompt


def _count_outputs(output_counts: jax.Array, rows: jax.Array, tokens: jax.Array) -> jax.Array:
    """``output_counts[rows[b], tokens[b, t]] += 1`` for every token >= 0 (-1: none; rows at
    the drop sentinel write nothing)."""
    tokens = jnp.where(tokens >= 0, tokens, output_counts.shape[1])
    return output_counts.at[rows[:, None], tokens].add(1, mode="drop")


def apply_vocab_masks(vocab_mask: jax.Array, rows: jax.Array, masks: jax.Array) -> jax.Array:
    """``vocab_mask[rows[i]] = masks[i]`` (``masks [K, D, W]``); rows past the table (the
    drop sentinel) write nothing."""
    return vocab_mask.at[rows].set(masks, mode="drop")


def _read_table(static: StepStatic, pools: Pools, batch: ExtendBatch | DecodeBatch):
    """The request table after the batch's updates, and each row's KV indices ``[B, C]``
    (padding rows read the null row 0: the null page)."""
    table = apply_table_updates(pools.req_to_token, batch.table_updates)
    rows = jnp.where(batch.req_row <= static.max_running, batch.req_row, 0)
    return table, table[rows]


def extend_step(
    fam: ModuleType, cfg: Any, static: StepStatic, params, pools: Pools, batch: ExtendBatch
):
    num_rows, num_tokens = batch.tokens.shape
    real = batch.num_new > 0
    table, kv_read_idx = _read_table(static, pools, batch)
    t_idx = jnp.arange(num_tokens)[None, :]
    positions = batch.start_pos[:, None] + t_idx
    valid = t_idx < batch.num_new[:, None]
    write_idx = jnp.take_along_axis(kv_read_idx, jnp.where(valid, positions, 0), axis=1)
    write_idx = jnp.where(valid, write_idx, static.sentinel_kv_row)
    inputs = ForwardInputs(
        tokens=batch.tokens,
        positions=positions,
        num_new=batch.num_new,
        kv_write_idx=write_idx,
        kv_read_idx=kv_read_idx,
        ctx_len=batch.start_pos + batch.num_new,
    )
    rec = gather_state(pools, batch.state_src_slot)
    with jax.named_scope("target_extend"):
        hidden, kv, out = fam.forward(
            params,
            cfg,
            inputs,
            pools.kv,
            rec,
            mode="extend",
            chunk_size=static.chunk_size,
            kernels=static.kernels,
            keep_chunk=batch.track_chunk,
        )
    with jax.named_scope("state_commit"):
        conv, ssm = scatter_state(
            pools.conv, pools.ssm, batch.working_slot, out.final.conv, out.final.ssm
        )
        conv, ssm = scatter_state(conv, ssm, batch.copy_slot, out.final.conv, out.final.ssm)
        conv, ssm = commit_picked(
            static, conv, ssm, out.chunks, batch.track_slot, jnp.zeros_like(batch.track_chunk)
        )  # the one kept chunk state
    rows = jnp.arange(num_rows)
    last = jnp.maximum(batch.num_new - 1, 0)
    with jax.named_scope("lm_head"):
        logits = fam.compute_logits(params, cfg, hidden[rows, last][:, None])  # [B, 1, V]
    last_pos = batch.start_pos + last
    read_row = jnp.where(batch.req_row <= static.max_running, batch.req_row, 0)
    history = TokenHistory(
        output_counts=pools.output_counts[read_row][:, None], in_prompt=pools.in_prompt[read_row]
    )
    allowed = pools.vocab_mask[jnp.minimum(batch.req_row, static.max_running), :1]  # [B, 1, W]
    with jax.named_scope("sampling"):
        processed = processed_logits(logits, batch.sampling, last_pos[:, None], history, allowed)
        probs = target_probs(processed, batch.sampling)[:, 0]
        token = sample_from(probs, batch.sampling.seed, last_pos, batch.sampling.temperature == 0)
        logprob = token_logprobs(logits, token[:, None])[:, 0]
    sentinel_row = static.sentinel_row
    row = jnp.where(real, batch.req_row, sentinel_row)
    done = real & batch.is_last_chunk  # rows whose prompt this step finishes
    done_row = jnp.where(done, batch.req_row, sentinel_row)
    drafting = None
    if static.spec:
        next_tokens = jnp.concatenate([batch.tokens[:, 1:], batch.tokens[:, :1]], axis=1)
        tail = jnp.where(batch.is_last_chunk, token, batch.next_token)
        next_tokens = jnp.where(t_idx == last[:, None], tail[:, None], next_tokens)
        drafting = (next_tokens, last, done)
    seq_len = batch.start_pos + batch.num_new
    results = _RowResults(row, seq_len, done_row, token, token[:, None], drafting)
    pools = dataclasses.replace(pools, kv=kv, conv=conv, ssm=ssm, req_to_token=table)
    new_drafts, new_pools = _record_rows(fam, cfg, static, params, pools, hidden, inputs, results)
    with jax.named_scope("sampling"):
        top_values, top_ids = top_logprobs(logits[:, 0])
    with jax.named_scope("prompt_logprobs"):
        prompt_lp, prompt_top, prompt_top_ids = prompt_logprobs(
            fam, cfg, params, hidden, batch, positions
        )
    outputs = {
        "token": token,
        "logprob": logprob,
        "top_logprobs": top_values,
        "top_ids": top_ids,
        "prompt_logprobs": prompt_lp,
        "prompt_top_logprobs": prompt_top,
        "prompt_top_ids": prompt_top_ids,
        "drafts": new_drafts,  # the next verify's drafts (grammar rows' masks need them)
    }
    return outputs, new_pools


@dataclass
class _RowResults:
    """What a step leaves in its request rows' pools (``_record_rows``); rows at the drop
    sentinel write nothing."""

    len_row: jax.Array  # [B] the rows whose seq_len is written
    seq_len: jax.Array  # [B] tokens each row covers after the step
    token_row: jax.Array  # [B] the rows whose last token, output counts and drafts are written
    last_token: jax.Array  # [B] each row's next input token
    counted: jax.Array | None  # [B, T] tokens output (-1: none); None: the counts stay as they are
    # with speculation, ``_next_drafts``' (next_tokens, pick, live); None: no drafting
    drafting: tuple | None


def _record_rows(
    fam, cfg, static: StepStatic, params, pools: Pools, hidden, inputs, results: _RowResults
) -> tuple[jax.Array, Pools]:
    """The step's ``results`` written into its request rows, the one place both steps write
    them: seq_len, last token, output counts and, drafting, the MTP head's KV and next
    drafts (``_next_drafts`` over the step's ``hidden`` and ``inputs``). Returns (the next
    drafts ``[B, S]``, ``[B, 0]`` without a chain; the pools, the others as given)."""
    seq_len = pools.seq_len.at[results.len_row].set(results.seq_len, mode="drop")
    token_row = results.token_row
    last_token = pools.last_token.at[token_row].set(results.last_token, mode="drop")
    counts = pools.output_counts
    if results.counted is not None:
        counts = _count_outputs(counts, token_row, results.counted)
    pools = dataclasses.replace(pools, seq_len=seq_len, last_token=last_token, output_counts=counts)
    if results.drafting is None:
        return jnp.zeros((token_row.shape[0], 0), jnp.int32), pools
    next_tokens, pick, live = results.drafting
    chain, drafts, mtp_kv = _next_drafts(
        fam, cfg, static, params, pools, hidden, next_tokens, inputs, pick, live, token_row
    )
    return chain, dataclasses.replace(pools, drafts=drafts, mtp_kv=mtp_kv)


def _next_drafts(
    fam,
    cfg,
    static: StepStatic,
    params,
    pools: Pools,
    hidden,
    next_tokens,
    inputs,
    pick,
    live,
    dest,
):
    """The MTP head over a step's positions (``hidden`` the target's hidden states
    ``[B, T, H]``, ``next_tokens`` each position's successor, ``inputs`` the step's: its KV
    writes), then the next drafts of the rows ``live`` from their positions ``pick``
    (``_draft_chain``), written into the drafts pool at request rows ``dest`` (the drop
    sentinel: nowhere). ``pick`` None: no chain runs and those rows' drafts are
    ``NO_DRAFT``. Returns (drafts ``[B, S]``, or ``[B, 0]`` without a chain; the drafts
    pool; mtp_kv)."""
    with jax.named_scope("draft_extend"):
        mtp_hidden, mtp_kv = fam.mtp_forward(
            params, cfg, hidden, next_tokens, inputs, pools.mtp_kv, kernels=static.kernels
        )
    if pick is None:
        no_chain = jnp.zeros((live.shape[0], 0), jnp.int32)
        return no_chain, pools.drafts.at[dest].set(NO_DRAFT, mode="drop"), mtp_kv
    chain, mtp_kv = _draft_chain(fam, cfg, static, params, mtp_kv, mtp_hidden, inputs, pick, live)
    return chain, pools.drafts.at[dest].set(chain, mode="drop"), mtp_kv


def _draft_chain(fam, cfg, static: StepStatic, params, mtp_kv, mtp_hidden, inputs, pick, real):
    """Greedy chain drafting with the MTP head, from each row's position ``pick`` of the
    step (``inputs``, whose MTP hidden states are ``mtp_hidden``).

    The MTP hidden at that position gives draft 1. Each further draft runs the MTP layer
    one position ahead on (previous MTP hidden, previous draft). Each draft is the argmax
    over the whole vocabulary, or over a speculative token map's ids when the params hold
    its reduced lm_head (``draft_vocab.draft_argmax``). Rows not ``real`` write no KV.
    Returns (drafts [B, S], mtp_kv).
    """
    num_steps = static.num_verify - 1
    rows = jnp.arange(pick.shape[0])
    kv_read_idx = inputs.kv_read_idx
    drafts = []
    hidden, pos = mtp_hidden[rows, pick], inputs.positions[rows, pick]
    for step in range(num_steps):
        draft = draft_argmax(fam, cfg, params, hidden)
        drafts.append(draft)
        if step == num_steps - 1:
            break
        pos = pos + 1
        write = jnp.take_along_axis(kv_read_idx, pos[:, None], axis=1)
        write = jnp.where(real[:, None], write, static.sentinel_kv_row)
        inputs = ForwardInputs(
            tokens=draft[:, None],
            positions=pos[:, None],
            num_new=real.astype(jnp.int32),
            kv_write_idx=write,
            kv_read_idx=kv_read_idx,
            ctx_len=pos + 1,
        )
        out_hidden, mtp_kv = fam.mtp_forward(
            params, cfg, hidden[:, None], draft[:, None], inputs, mtp_kv, kernels=static.kernels
        )
        hidden = out_hidden[:, 0]
    return jnp.stack(drafts, axis=1), mtp_kv


@jax.tree_util.register_dataclass
@dataclass
class DecodeCarry:
    """What a decode forward hands its sample-and-commit program: device arrays that
    live from one program to the next (``decode_forward`` -> ``decode_finish``)."""

    hidden: jax.Array  # [B, D, hidden] the target's last hidden states (the MTP head's input)
    logits: jax.Array  # [B, D, V] raw logits
    # the recurrent state after every verify position, per layer; None with D = 1 (the
    # forward wrote the state pools in place)
    steps: StepStates | None


@dataclass
class _DecodeRows:
    """A decode batch's per-row view of the pools (both programs compute it the same: the
    forward changes none of what it reads but the table, whose updates are idempotent)."""

    real: jax.Array  # [B] the row is a request's (not padding)
    row: jax.Array  # [B] request row, padding clamped to a real index
    table: jax.Array  # the request table after the batch's updates
    kv_read_idx: jax.Array  # [B, context_len]
    pre: jax.Array  # [B] tokens covered before the step
    drafts: jax.Array  # [B, D-1] the drafts the step verifies
    positions: jax.Array  # [B, D]
    inputs: ForwardInputs


def _decode_rows(
    static: StepStatic, pools: Pools, batch: DecodeBatch, read: tuple | None = None
) -> _DecodeRows:
    """The batch's rows; ``read``: (table, KV indices) of an earlier step of the same
    program, whose table updates are applied already."""
    num_pos = batch.num_verify
    real = batch.req_row <= static.max_running
    row = jnp.minimum(batch.req_row, static.max_running)
    table, kv_read_idx = _read_table(static, pools, batch) if read is None else read
    pre = pools.seq_len[row]
    drafts = pools.drafts[row][:, : num_pos - 1]
    # a NO_DRAFT position (after a step without speculation) runs on token 0 and is
    # rejected (``verify_and_sample``)
    inputs_drafts = jnp.maximum(drafts, 0)
    tokens = jnp.concatenate([pools.last_token[row][:, None], inputs_drafts], axis=1)
    positions = pre[:, None] + jnp.arange(num_pos)[None, :]
    write_idx = jnp.take_along_axis(kv_read_idx, positions, axis=1)
    write_idx = jnp.where(real[:, None], write_idx, static.sentinel_kv_row)
    inputs = ForwardInputs(
        tokens=tokens,
        positions=positions,
        num_new=jnp.where(real, num_pos, 0),
        kv_write_idx=write_idx,
        kv_read_idx=kv_read_idx,
        ctx_len=pre + num_pos,
    )
    return _DecodeRows(real, row, table, kv_read_idx, pre, drafts, positions, inputs)


def decode_forward(
    fam: ModuleType, cfg: Any, static: StepStatic, params, pools: Pools, batch: DecodeBatch
) -> tuple[DecodeCarry, Pools]:
    """The part of a decode step that needs no grammar mask: the table updates, the target
    forward (KV writes; with D = 1 the state written in place and a crossing row's
    checkpoint copied, otherwise the state after every position in the carry) and the
    logits. Of the pools it changes the KV pools, the request table and, with D = 1, the
    state pools."""
    return _decode_forward(
        fam, cfg, static, params, pools, batch, _decode_rows(static, pools, batch)
    )


def _decode_forward(fam, cfg, static: StepStatic, params, pools: Pools, batch, rows: _DecodeRows):
    """``decode_forward`` given the batch's ``rows``."""
    # the pools themselves, each row at its working slot: the Pallas update reads them in
    # place (the XLA forms gather inside the layer); padding rows read the null slot. One
    # position per row (no speculation): decode writes the working slots in place
    in_place = batch.num_verify == 1
    rec = PoolView(
        conv_pool=pools.conv, ssm_pool=pools.ssm, slot=jnp.where(rows.real, batch.working_slot, 0)
    )
    with jax.named_scope("target_decode" if in_place else "target_verify"):
        hidden, kv, out = fam.forward(
            params,
            cfg,
            rows.inputs,
            pools.kv,
            rec,
            mode="decode" if in_place else "verify",
            chunk_size=static.chunk_size,
            kernels=static.kernels,
        )
    with jax.named_scope("lm_head"):
        logits = fam.compute_logits(params, cfg, hidden)  # [B, D, V]
    pools = dataclasses.replace(pools, kv=kv, req_to_token=rows.table)
    if not in_place:
        return DecodeCarry(hidden=hidden, logits=logits, steps=out.steps), pools
    # every real row advances by exactly one token: whether it crosses is known now
    interval = batch.track_interval
    crossed = rows.real & (rows.pre // interval != (rows.pre + 1) // interval)
    with jax.named_scope("state_commit"):
        conv, ssm = copy_checkpoint(static, out.pools, batch, crossed)
    pools = dataclasses.replace(pools, conv=conv, ssm=ssm)
    return DecodeCarry(hidden=hidden, logits=logits, steps=None), pools


def decode_step(
    fam: ModuleType, cfg: Any, static: StepStatic, params, pools: Pools, batch: DecodeBatch
):
    """One fused decode step: ``decode_forward`` then ``decode_finish`` in one program (the
    grammar masks of its rows already written); the rows' view is computed once. Without
    speculation a batch of ``num_verify`` K > 1 runs K such steps (``_decode_steps``)."""
    if batch.num_verify > 1 and not static.spec:
        return _decode_steps(fam, cfg, static, params, pools, batch)
    rows = _decode_rows(static, pools, batch)
    carry, pools = _decode_forward(fam, cfg, static, params, pools, batch, rows)
    return _decode_finish(fam, cfg, static, params, pools, batch, carry, rows)


def _decode_steps(
    fam: ModuleType, cfg: Any, static: StepStatic, params, pools: Pools, batch: DecodeBatch
):
    """K = ``batch.num_verify`` one-token decode steps back to back in one program
    (``num_continuous_decode_steps``, no speculation): each is the step of a one-position
    batch, reading the ``seq_len`` and ``last_token`` the one before it wrote, writing its
    state in place and copying a crossing row's checkpoint as it crosses. The table updates
    apply once. The outputs are a K-position verify's with every position accepted (tokens,
    logprobs and top logprobs ``[B, K, ...]``, ``accept_len`` K, ``crossed`` if any step
    crossed, ``pre`` the first step's), so the host settles them as one."""
    one = dataclasses.replace(batch, num_verify=1)
    steps, read = [], None
    for _ in range(batch.num_verify):
        rows = _decode_rows(static, pools, one, read)
        read = (rows.table, rows.kv_read_idx)
        carry, pools = _decode_forward(fam, cfg, static, params, pools, one, rows)
        out, pools = _decode_finish(fam, cfg, static, params, pools, one, carry, rows)
        steps.append(out)
    outputs = {
        name: jnp.concatenate([out[name] for out in steps], axis=1)
        for name in ("tokens", "logprobs", "top_logprobs", "top_ids")
    }
    outputs["accept_len"] = sum(out["accept_len"] for out in steps)
    outputs["crossed"] = functools.reduce(jnp.logical_or, [out["crossed"] for out in steps])
    outputs["pre"] = steps[0]["pre"]
    outputs["drafts"] = steps[-1]["drafts"]
    return outputs, pools


def decode_finish(
    fam: ModuleType,
    cfg: Any,
    static: StepStatic,
    params,
    pools: Pools,
    batch: DecodeBatch,
    carry: DecodeCarry,
):
    """The rest of a decode step after ``decode_forward``: the processed logits under the
    rows' grammar masks (``pools.vocab_mask``, read here: written between the two programs),
    verify / accept and sampling, the state commit, ``seq_len`` / ``last_token`` / counts
    and the MTP draft chain. Returns (outputs, pools)."""
    view = _decode_rows(static, pools, batch)
    return _decode_finish(fam, cfg, static, params, pools, batch, carry, view)


def _decode_finish(
    fam, cfg, static: StepStatic, params, pools: Pools, batch, carry: DecodeCarry, view
):
    """``decode_finish`` given the batch's rows (``view``: what ``_decode_rows`` gives for
    the pools before or after the forward, which changes none of it)."""
    num_rows = batch.req_row.shape[0]
    num_pos = batch.num_verify
    real, row, pre, drafts, positions = view.real, view.row, view.pre, view.drafts, view.positions
    inputs = view.inputs
    hidden, logits, steps = carry.hidden, carry.logits, carry.steps
    # the forward left seq_len / last_token / drafts as it found them: these are its rows
    with jax.named_scope("sampling"):
        if batch.greedy:
            out_tokens, accept_len = greedy_verify(logits, drafts)
        else:
            history = verify_history(
                pools.output_counts[row], pools.in_prompt[row], drafts, num_pos
            )
            allowed = pools.vocab_mask[row][:, :num_pos]  # [B, D, W]
            out_tokens, accept_len = verify_and_sample(
                logits, drafts, positions, batch.sampling, history, allowed
            )
        if batch.greedy:  # no row asked for them: no log-softmax over the vocabulary
            logprobs = jnp.zeros(out_tokens.shape, jnp.float32)
        else:
            logprobs = token_logprobs(logits, out_tokens)
    interval = batch.track_interval
    post = pre + accept_len
    crossed = real & (pre // interval != post // interval)
    with jax.named_scope("state_commit"):
        if steps is None:  # decode_forward wrote the state and copied the checkpoints
            conv, ssm = pools.conv, pools.ssm
        else:
            conv, ssm = commit_verify(static, pools, steps, batch, accept_len, pre, crossed)
    dest = jnp.where(real, batch.req_row, static.sentinel_row)
    bonus = out_tokens[jnp.arange(num_rows), accept_len - 1]
    drafting = None
    if static.spec:
        next_tokens = jnp.where(out_tokens >= 0, out_tokens, 0)
        # with speculation off for this batch (``Layout.spec_max_batch``) the draft head's KV
        # still follows every token (only its K / V projections are live), so drafting
        # resumes where a later step speculates; that step's drafts are NO_DRAFT
        drafting = (next_tokens, None if num_pos == 1 else accept_len - 1, real)
    # a greedy batch's rows have no penalty to read their output counts
    counted = None if batch.greedy else out_tokens
    results = _RowResults(dest, post, dest, bonus, counted, drafting)
    pools = dataclasses.replace(pools, conv=conv, ssm=ssm)
    chain, new_pools = _record_rows(fam, cfg, static, params, pools, hidden, inputs, results)
    with jax.named_scope("sampling"):
        if batch.greedy:  # no row asked for them
            top_values = jnp.zeros((num_rows, num_pos, TOP_LOGPROBS), jnp.float32)
            top_ids = jnp.zeros((num_rows, num_pos, TOP_LOGPROBS), jnp.int32)
        else:
            top_values, top_ids = top_logprobs(logits)
    outputs = {
        "tokens": out_tokens,
        "accept_len": accept_len,
        "logprobs": logprobs,
        "top_logprobs": top_values,
        "top_ids": top_ids,
        "crossed": crossed,
        "pre": pre,
        "drafts": chain,  # the next verify's drafts (grammar rows' masks need them)
    }
    return outputs, new_pools
