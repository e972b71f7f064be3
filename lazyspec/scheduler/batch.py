"""Host batches: a scheduled step's rows as numpy arrays padded to a bucket shape.

One builder per step kind (``build_extend``, ``build_decode``) fills a typed batch from the
scheduled requests and their ``RowRecord``s; padding rows point at the drop sentinels
(request row, working and checkpoint slot) and the null slot / page, so the device step
changes nothing for them. Nothing in a batch grows with the context: a step reads its rows'
KV indices from the device's request table, after applying the table updates it carries
(``table_updates``; see ``RequestCache.take_updates``). The engine registers these
dataclasses as pytrees and hands them to the jitted steps (``(params, pools, batch)``),
moved to the device packed into one int32 array and unpacked there.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, fields

import numpy as np

from lazyspec.scheduler.layout import TABLE_UPDATES_PER_STEP, Layout, bucket
from lazyspec.scheduler.policy import RowRecord
from lazyspec.scheduler.request import (
    MAX_LOGIT_BIAS,
    MAX_MIN_TOKENS_STOP_IDS,
    NO_SLOT,
    Req,
)

# the per-row masked-id list: a request's stop_token_ids and the model's EOS ids
MASK_IDS = 2 * MAX_MIN_TOKENS_STOP_IDS
# distinct token ids one CountSeed carries (a longer history takes several)
COUNT_SEED_TOKENS = 1024
NO_PROMPT_LOGPROBS = 2**30  # ExtendBatch.logprob_start of a row that wants none


@dataclass
class SamplingRows:
    temperature: np.ndarray  # [B] float32, 0 = greedy
    top_p: np.ndarray  # [B] float32
    top_k: np.ndarray  # [B] int32, <= 0 = off
    # tokens below min_p x the most likely one's probability are dropped (0 = off)
    min_p: np.ndarray  # [B] float32
    seed: np.ndarray  # [B] uint32
    # EOS / stop ids (mask_ids, -1 = none) get -inf logits at the positions p with
    # p + 1 < min_len (prompt length + min_new_tokens: fewer outputs than that so far)
    min_len: np.ndarray  # [B] int32
    mask_ids: np.ndarray  # [B, MASK_IDS] int32
    bias_ids: np.ndarray  # [B, MAX_LOGIT_BIAS] int32, -1 = none
    bias_values: np.ndarray  # [B, MAX_LOGIT_BIAS] float32, added to the logits
    # penalties over the request row's token counts (off: 0, 0, 1)
    frequency_penalty: np.ndarray  # [B] float32
    presence_penalty: np.ndarray  # [B] float32
    repetition_penalty: np.ndarray  # [B] float32
    # the row has a grammar: its logits outside the allowed-token bitmask (the device's
    # ``Pools.vocab_mask`` row, written by the host before the step) are -inf
    constrained: np.ndarray  # [B] bool


@dataclass
class ExtendBatch:
    req_row: np.ndarray  # [B] (sentinel = padding)
    tokens: np.ndarray  # [B, T]
    start_pos: np.ndarray  # [B]
    num_new: np.ndarray  # [B]
    table_updates: np.ndarray  # [3, U] request-table writes (row, position, KV row)
    state_src_slot: np.ndarray  # [B] initial state (null slot = zeros)
    working_slot: np.ndarray  # [B] (sentinel = padding)
    track_slot: np.ndarray  # [B] (sentinel = no checkpoint)
    track_chunk: np.ndarray  # [B] chunk index of the checkpoint state
    copy_slot: np.ndarray  # [B] also receives the final state (sentinel = none)
    is_last_chunk: np.ndarray  # [B] bool: the prompt ends in this chunk (sample + draft)
    next_token: np.ndarray  # [B] first token of the next chunk (MTP input), when not last
    # logprobs of the chunk's next tokens from this token index on (NO_PROMPT_LOGPROBS: none)
    logprob_start: np.ndarray  # [B] int32
    sampling: SamplingRows


@dataclass
class DecodeBatch:
    req_row: np.ndarray  # [B] (sentinel = padding)
    table_updates: np.ndarray  # [3, U] request-table writes (row, position, KV row)
    working_slot: np.ndarray  # [B] (sentinel = padding)
    track_slot: np.ndarray  # [B] checkpoint target if a boundary is crossed (sentinel = none)
    track_interval: np.ndarray  # [] int32 (traced: no recompile per value)
    sampling: SamplingRows
    # D: tokens the step takes per request (static: one program per value)
    num_verify: int = 1
    # every row is ``SamplingRow.argmax_only`` and asks for no logprobs: the step takes the
    # argmax of the raw logits and skips the other sampling stages and the logprobs (zeros
    # in their place), whose skipping by ``lax.cond`` would make a GPU's dispatch wait
    # (static: one program per value)
    greedy: bool = False


FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class SamplingRow:
    """One request's sampling values in the batch dtypes. ``sampling_row`` converts them
    once, when the scheduler admits the request, so a value that does not fit fails that
    request there; filling a batch then only copies values that already fit."""

    temperature: np.float32
    top_p: np.float32
    top_k: np.int32
    min_p: np.float32
    seed: np.uint32
    min_len: np.int32
    mask_ids: np.ndarray  # [MASK_IDS] int32
    bias_ids: np.ndarray  # [MAX_LOGIT_BIAS] int32
    bias_values: np.ndarray  # [MAX_LOGIT_BIAS] float32
    frequency_penalty: np.float32
    presence_penalty: np.float32
    repetition_penalty: np.float32
    constrained: bool  # the request has a grammar
    # greedy with nothing that changes the raw logits' argmax (no bias, penalty, min-tokens
    # mask or grammar; top-k / top-p / min-p do not change a greedy row's token); set by
    # ``sampling_row`` from the values above
    argmax_only: bool = False


def seed_bits(seed: int) -> int:
    """A seed of up to 64 bits (negative ones taken mod 2**64) as the 32 bits the sampler
    keys on: the low word xor a hash of the high word (MurmurHash3's finalizer, which maps
    0 to 0), so every bit counts and seeds below 2**32 keep their value."""
    value = seed % 2**64
    high = value >> 32
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        high = ((high ^ (high >> shift)) * factor) & 0xFFFFFFFF
    return (value & 0xFFFFFFFF) ^ high ^ (high >> 16)


def sampling_row(req: Req, eos_ids: tuple[int, ...] = ()) -> SamplingRow:
    """``req``'s SamplingRow; ValueError / OverflowError if a value does not fit its dtype
    (the default seed is the CRC-32 of the request id). ``eos_ids`` are the model's, masked
    with the stop ids while ``min_new_tokens`` is not reached."""
    params = req.sampling
    if not (abs(params.temperature) <= FLOAT32_MAX and abs(params.top_p) <= FLOAT32_MAX):
        raise ValueError(f"temperature / top_p do not fit float32: {params}")
    temperature, top_p = np.float32(params.temperature), np.float32(params.top_p)
    seed = params.seed if params.seed is not None else zlib.crc32(req.rid.encode())
    mask_ids = np.full(MASK_IDS, -1, np.int32)
    if params.min_new_tokens > 0:
        masked = sorted(set(params.stop_token_ids) | set(eos_ids))
        if len(masked) > MASK_IDS:
            raise ValueError(f"{len(masked)} EOS / stop ids exceed the {MASK_IDS} maskable")
        mask_ids[: len(masked)] = masked
    bias_ids = np.full(MAX_LOGIT_BIAS, -1, np.int32)
    bias_values = np.zeros(MAX_LOGIT_BIAS, np.float32)
    for i, (token, bias) in enumerate(params.logit_bias):
        bias_ids[i], bias_values[i] = token, bias
    penalties = tuple(
        np.float32(value)
        for value in (
            params.frequency_penalty,
            params.presence_penalty,
            params.repetition_penalty,
        )
    )
    constrained = req.grammar is not None
    argmax_only = bool(
        temperature == 0
        and not constrained
        and (bias_ids < 0).all()
        and (mask_ids < 0).all()
        and penalties == (0, 0, 1)
    )
    return SamplingRow(
        temperature,
        top_p,
        np.int32(params.top_k),
        np.float32(params.min_p),
        np.uint32(seed_bits(seed)),
        np.int32(len(req.input_ids) + params.min_new_tokens),
        mask_ids,
        bias_ids,
        bias_values,
        *penalties,
        constrained,
        argmax_only,
    )


def greedy_decodable(req: Req) -> bool:
    """Whether ``req``'s decode steps may take the argmax of the raw logits alone
    (``DecodeBatch.greedy``): its ``SamplingRow.argmax_only`` and no logprobs asked."""
    return req.sampling_row.argmax_only and not req.return_logprob


_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingRows))


class SamplingMemo:
    """The decode batches' sampling arrays, kept while the same requests fill the same rows.

    A decode batch's requests change only when one joins or ends, and filling the arrays
    is host work per request and field on every step (a fifth of the batch-64 schedule on
    the CPU). The key is the requests' ``sampling_row`` objects, frozen and set once at
    admission, so an equal key means equal values. The arrays given are read-only: a
    batch that wrote to them would change the next one's."""

    def __init__(self) -> None:
        self._rows: tuple[SamplingRow, ...] = ()
        self._num_rows = -1
        self._arrays: SamplingRows | None = None

    def get(self, num_rows: int, reqs: list[Req]) -> SamplingRows:
        values = tuple(req.sampling_row for req in reqs)
        same = num_rows == self._num_rows and len(values) == len(self._rows)
        if not (same and all(a is b for a, b in zip(values, self._rows))):
            arrays = _sampling(num_rows, reqs)
            for array in vars(arrays).values():
                array.flags.writeable = False
            self._rows, self._num_rows, self._arrays = values, num_rows, arrays
        return self._arrays


def neutral_sampling(num_rows: int) -> SamplingRows:
    """Sampling arrays of ``num_rows`` rows of the neutral values: greedy, no filter, no
    bias, no penalty, no grammar."""
    return SamplingRows(
        temperature=np.zeros(num_rows, np.float32),
        top_p=np.ones(num_rows, np.float32),
        top_k=np.full(num_rows, -1, np.int32),
        min_p=np.zeros(num_rows, np.float32),
        seed=np.zeros(num_rows, np.uint32),
        min_len=np.zeros(num_rows, np.int32),
        mask_ids=np.full((num_rows, MASK_IDS), -1, np.int32),
        bias_ids=np.full((num_rows, MAX_LOGIT_BIAS), -1, np.int32),
        bias_values=np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32),
        frequency_penalty=np.zeros(num_rows, np.float32),
        presence_penalty=np.zeros(num_rows, np.float32),
        repetition_penalty=np.ones(num_rows, np.float32),
        constrained=np.zeros(num_rows, bool),
    )


def _sampling(num_rows: int, reqs: list[Req]) -> SamplingRows:
    """The batch's sampling arrays: each request's ``sampling_row`` values in its row, the
    neutral values in the padding rows (``neutral_sampling``)."""
    rows = neutral_sampling(num_rows)
    if reqs:
        values = [req.sampling_row for req in reqs]
        for name in _SAMPLING_FIELDS:
            getattr(rows, name)[: len(reqs)] = [getattr(row, name) for row in values]
    return rows


@dataclass
class CountSeed:
    """Part of one request row's token history, written into the device's token-count pools
    before a step (``count_seeds``): a fixed number of distinct token ids (-1 = padding)
    with their output counts and whether the prompt holds them."""

    req_row: np.ndarray  # [] int32
    reset: np.ndarray  # [] bool: zero the row first (the request's first seed)
    token_ids: np.ndarray  # [COUNT_SEED_TOKENS] int32, -1 = padding
    output_counts: np.ndarray  # [COUNT_SEED_TOKENS] int32, times output so far
    in_prompt: np.ndarray  # [COUNT_SEED_TOKENS] bool


def count_seeds(req: Req) -> list[CountSeed]:
    """The seeds that set ``req``'s row of the token-count pools to its history: the prompt
    (``input_ids``) marked and the outputs so far (a request resumed after a retraction
    has some) counted. The first resets the row; at least one seed is returned."""
    prompt = np.asarray(req.input_ids, np.int64)
    outputs = np.asarray(req.output_ids, np.int64)
    token_ids = np.union1d(prompt, outputs)
    output_ids, counts = np.unique(outputs, return_counts=True)
    output_counts = np.zeros(token_ids.size, np.int32)
    output_counts[np.searchsorted(token_ids, output_ids)] = counts
    in_prompt = np.isin(token_ids, prompt)
    seeds = []
    for start in range(0, max(token_ids.size, 1), COUNT_SEED_TOKENS):
        stop = min(start + COUNT_SEED_TOKENS, token_ids.size)
        seed = CountSeed(
            req_row=np.asarray(req.req_row, np.int32),
            reset=np.asarray(start == 0),
            token_ids=np.full(COUNT_SEED_TOKENS, -1, np.int32),
            output_counts=np.zeros(COUNT_SEED_TOKENS, np.int32),
            in_prompt=np.zeros(COUNT_SEED_TOKENS, bool),
        )
        seed.token_ids[: stop - start] = token_ids[start:stop]
        seed.output_counts[: stop - start] = output_counts[start:stop]
        seed.in_prompt[: stop - start] = in_prompt[start:stop]
        seeds.append(seed)
    return seeds


def empty_count_seed(layout: Layout) -> CountSeed:
    """A seed that writes nothing (the drop-sentinel row; warm-up compiles with it)."""
    return CountSeed(
        req_row=np.asarray(layout.sentinel_row, np.int32),
        reset=np.asarray(False),
        token_ids=np.full(COUNT_SEED_TOKENS, -1, np.int32),
        output_counts=np.zeros(COUNT_SEED_TOKENS, np.int32),
        in_prompt=np.zeros(COUNT_SEED_TOKENS, bool),
    )


def table_updates(layout: Layout, updates: np.ndarray | None, length: int) -> np.ndarray:
    """``updates`` ([3, n] (row, position, KV row), n <= length; None = none) padded to
    ``[3, length]`` with writes to the drop-sentinel row."""
    padded = np.zeros((3, length), np.int32)
    padded[0] = layout.sentinel_row
    if updates is not None:
        assert updates.shape[1] <= length, (updates.shape, length)
        padded[:, : updates.shape[1]] = updates
    return padded


def split_table_updates(layout: Layout, updates: np.ndarray) -> tuple[np.ndarray, list]:
    """A step's request-table updates ``[3, n]``: the part the step carries (at most
    ``TABLE_UPDATES_PER_STEP``) and the rest as padded ``[3, table_chunk_len]`` chunks,
    applied before the step. Each entry occurs once, so the parts commute."""
    carried, rest = updates[:, :TABLE_UPDATES_PER_STEP], updates[:, TABLE_UPDATES_PER_STEP:]
    size = layout.table_chunk_len
    chunks = [
        table_updates(layout, rest[:, i : i + size], size) for i in range(0, rest.shape[1], size)
    ]
    return carried, chunks


def build_extend(
    layout: Layout,
    records: list[RowRecord],
    updates: np.ndarray | None = None,
    num_rows: int | None = None,
    length: int | None = None,
) -> ExtendBatch:
    """The extend batch of ``records`` (one prefill chunk each, from ``record.start``)
    carrying ``updates`` (at most ``TABLE_UPDATES_PER_STEP``); bucket shapes picked from
    the layout unless given (warm-up builds empty ones)."""
    length = length or layout.extend_length(max(r.num_new for r in records))
    num_rows = num_rows or bucket(len(records), layout.extend_rows(length))
    reqs = [r.req for r in records]
    batch = ExtendBatch(
        req_row=np.full(num_rows, layout.sentinel_row, np.int32),
        tokens=np.zeros((num_rows, length), np.int32),
        start_pos=np.zeros(num_rows, np.int32),
        num_new=np.zeros(num_rows, np.int32),
        table_updates=table_updates(layout, updates, TABLE_UPDATES_PER_STEP),
        state_src_slot=np.full(num_rows, NO_SLOT, np.int32),
        working_slot=np.full(num_rows, layout.sentinel_slot, np.int32),
        track_slot=np.full(num_rows, layout.sentinel_slot, np.int32),
        track_chunk=np.zeros(num_rows, np.int32),
        copy_slot=np.full(num_rows, layout.sentinel_slot, np.int32),
        is_last_chunk=np.zeros(num_rows, bool),
        next_token=np.zeros(num_rows, np.int32),
        logprob_start=np.full(num_rows, NO_PROMPT_LOGPROBS, np.int32),
        sampling=_sampling(num_rows, reqs),
    )
    for b, record in enumerate(records):
        req, start, num_new = record.req, record.start, record.num_new
        batch.req_row[b] = req.req_row
        batch.tokens[b, :num_new] = req.fill_ids[start : start + num_new]
        batch.start_pos[b] = start
        batch.num_new[b] = num_new
        batch.state_src_slot[b] = record.source_slot
        batch.working_slot[b] = req.slots.working
        if record.target_slot != NO_SLOT:
            batch.track_slot[b] = record.target_slot
            batch.track_chunk[b] = record.track_chunk
        if record.copy_slot != NO_SLOT:
            batch.copy_slot[b] = record.copy_slot
        batch.is_last_chunk[b] = record.is_last_chunk
        if not record.is_last_chunk:
            batch.next_token[b] = req.fill_ids[start + num_new]
        if req.next_prompt_logprob is not None:
            batch.logprob_start[b] = req.next_prompt_logprob
    return batch


def build_decode(
    layout: Layout,
    records: list[RowRecord],
    updates: np.ndarray | None = None,
    num_rows: int | None = None,
    num_verify: int | None = None,
    greedy: bool | None = None,
    sampling_memo: SamplingMemo | None = None,
) -> DecodeBatch:
    """The decode batch of ``records`` (D verify positions per row, read on the device;
    ``num_verify``, by default ``layout.decode_num_verify`` of the records) carrying
    ``updates`` (at most ``TABLE_UPDATES_PER_STEP``); ``greedy`` by default whether every
    request is ``greedy_decodable``. Its sampling arrays come from ``sampling_memo`` if
    given (read-only then)."""
    if num_verify is None:
        num_verify = layout.decode_num_verify(len(records))
    if num_rows is None:
        num_rows = layout.decode_rows(bucket(len(records), layout.decode_buckets), num_verify)
    reqs = [r.req for r in records]
    if greedy is None:
        greedy = all(greedy_decodable(req) for req in reqs)
    batch = DecodeBatch(
        req_row=np.full(num_rows, layout.sentinel_row, np.int32),
        table_updates=table_updates(layout, updates, TABLE_UPDATES_PER_STEP),
        working_slot=np.full(num_rows, layout.sentinel_slot, np.int32),
        track_slot=np.full(num_rows, layout.sentinel_slot, np.int32),
        track_interval=np.asarray(layout.track_interval, np.int32),
        sampling=(sampling_memo.get if sampling_memo else _sampling)(num_rows, reqs),
        num_verify=num_verify,
        greedy=greedy,
    )
    for b, record in enumerate(records):
        req = record.req
        batch.req_row[b] = req.req_row
        batch.working_slot[b] = req.slots.working
        if record.target_slot != NO_SLOT:
            batch.track_slot[b] = record.target_slot
    return batch


@dataclass
class StepPlan:
    kind: str  # "extend" | "decode"
    records: list[RowRecord]
    batch: ExtendBatch | DecodeBatch
    # request-table updates past the batch's own bucket, [3, layout.table_chunk_len] each,
    # applied on the device before the step (usually none)
    table_chunks: list[np.ndarray] = field(default_factory=list)
    # the token histories of the rows admitted since the last plan (requests with
    # penalties), written into the token-count pools before the step
    count_seeds: list[CountSeed] = field(default_factory=list)
    prompt_logprobs: bool = False  # a row wants prompt logprobs: read them back
    # the requests with a grammar whose rows the step samples: their allowed-token bitmasks
    # (``Scheduler.grammar_masks``) are written on the device before the step samples
    grammar_reqs: list[Req] = field(default_factory=list)


def mean_accept_length(accept_counts: np.ndarray) -> float | None:
    """Mean tokens a verify step committed, from ``accept_counts`` (``[k]`` = verify steps
    that committed k tokens; ``Scheduler.accept_counts`` or a difference of two readings);
    None before any."""
    steps = int(accept_counts.sum())
    return float(np.dot(np.arange(len(accept_counts)), accept_counts) / steps) if steps else None
