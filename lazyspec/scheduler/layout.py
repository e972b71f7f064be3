"""The memory plan: every size, sentinel and bucket of an engine, computed once.

``plan_memory(engine_cfg, model_cfg) -> Layout`` is a pure function of the two configs.
The scheduler, the host batch builders, the runner's pools and the jitted steps all read
their sizes from the one ``Layout`` (the steps through ``StepStatic``, its device subset).

Ids and their sentinels (DESIGN §3):

| id space      | real ids             | null (zeros, never written) | drop sentinel           |
|---------------|----------------------|-----------------------------|-------------------------|
| state slot    | 1..num_slots         | ``NULL_SLOT`` = 0           | ``sentinel_slot``       |
| request row   | 1..max_running       | 0                           | ``sentinel_row``        |
| KV row        | page_size..kv_rows-1 | page 0 = rows 0..page_size-1| ``sentinel_kv_row``     |

Scatters to a drop sentinel are discarded (``mode="drop"``: the id is one past the pool),
so padded rows and rows that must not write point there; reads from padded rows use the
null slot / page, which hold zeros.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

from lazyspec.scheduler.request import NO_SLOT
from lazyspec.scheduler.strategy import Strategy

logger = logging.getLogger(__name__)

NULL_SLOT = NO_SLOT
# requests one extend step prefills at its longest chunk when the engine's prefill token
# budget (``max_prefill_tokens``) is left unset on CPU (``default_prefill_tokens``)
MAX_EXTEND_ROWS = 4
# the prefill token budget of an extend step on an accelerator when it is left unset
ACCELERATOR_PREFILL_TOKENS = 8192
DEFAULT_MAX_RUNNING = 16
# default pool: room for extra_buffer's 3 pinned slots per request plus as many cached
# checkpoints again (independent of the strategy, so shapes are shared)
DEFAULT_SLOTS_PER_RUNNING = 6
# Decode steps a request may run past its last token before the host sees it finish: the
# overlapped loop launches one more step, each step writes up to D tokens, and one step of
# slack keeps the write positions inside the row.
RUN_PAST_STEPS = 3
# Request-table updates (entry writes) a step carries itself; more go to the device first in
# chunks of a context row each (Runner.launch), so no count of updates overflows.
TABLE_UPDATES_PER_STEP = 256
# Fewest tokens a decode program runs. With one, every projection is a vector-matrix dot,
# which XLA on GPUs rewrites into an elementwise product of the weight's size, written out
# and read back by a reduction: three times the weight's bytes. Two rows keep them
# matmuls; the padding row is routed to row 0's experts (``moe.padding_follows_token_zero``),
# so it reads no other weight.
MIN_DECODE_TOKENS = 2
# state slots one host-tier copy program moves per call (its KV rows: a prefill chunk's);
# a longer copy takes several calls
TRANSFER_SLOTS = 4


class IdSpaces:
    """The pools' entries and drop sentinels of the three id spaces (module docstring), for
    a record of ``num_slots``, ``max_running`` and ``num_kv_rows``: ``Layout`` and the
    steps' ``StepStatic``, its device subset."""

    @property
    def num_slot_rows(self) -> int:
        """Entries of each state pool, the null slot's included."""
        return self.num_slots + 1

    @property
    def num_req_rows(self) -> int:
        """Entries of each per-request table, the null row's included."""
        return self.max_running + 1

    # each id space's drop sentinel is one past its pool: the pool's number of entries
    sentinel_slot = num_slot_rows
    sentinel_row = num_req_rows

    @property
    def sentinel_kv_row(self) -> int:
        return self.num_kv_rows


@dataclass(frozen=True)
class Layout(IdSpaces):
    strategy: Strategy
    num_slots: int  # state slots (ids 1..num_slots)
    max_running: int  # running requests = request rows (ids 1..max_running)
    requested_running: int  # what the config asked for (max_running may be capped)
    num_pages: int  # KV pages (ids 1..num_pages)
    page_size: int
    context_len: int  # longest sequence, a whole number of pages
    num_verify: int  # D: tokens a decode step processes per request
    chunk_size: int  # chunked-prefill scan chunk
    chunked_prefill: int  # most prompt tokens one request prefills per step
    track_interval: int
    extend_lengths: tuple[int, ...]  # tokens a row of an extend step (buckets)
    prefill_tokens: int  # rows x tokens of an extend step at most (one row always fits)
    decode_buckets: tuple[int, ...]  # rows per decode step
    # decode batches of more than this many requests take one token per request (no
    # speculation); None: every decode step takes num_verify
    spec_max_batch: int | None = None
    # K: decode steps one program runs back to back without speculation
    # (``num_continuous_decode_steps``); each row then writes K positions a step
    decode_steps: int = 1
    host_tier: bool = False  # the radix cache keeps a host tier (copy programs in the table)

    @property
    def num_kv_rows(self) -> int:
        """KV rows in each pool, page 0 (the null page) included."""
        return (self.num_pages + 1) * self.page_size

    # ---- derived sizes ---------------------------------------------------------------

    @property
    def prefill_track_grid(self) -> int:
        """G: prefill checkpoints sit at ``start + (num_new // G) * G`` of each chunk, the
        least length that is a whole number of scan chunks and of pages."""
        return math.lcm(self.chunk_size, self.page_size)

    @property
    def run_past_headroom(self) -> int:
        """Tokens a request may be written past its end (see RUN_PAST_STEPS)."""
        return RUN_PAST_STEPS * self.decode_positions

    @property
    def decode_positions(self) -> int:
        """Most positions a decode step writes per request: D with speculation, else K
        (``decode_steps``)."""
        return max(self.num_verify, self.decode_steps)

    @property
    def max_request_len(self) -> int:
        """Longest request (prompt + max new tokens): the context less the run-past headroom."""
        return self.context_len - self.run_past_headroom

    def decode_num_verify(self, num_reqs: int) -> int:
        """The positions per request (the batch's ``num_verify``) of a decode step over
        ``num_reqs`` requests: with speculation D, or 1 past ``spec_max_batch``; without,
        K (``decode_steps``: K one-token steps in one program)."""
        if self.spec_max_batch is not None and num_reqs > self.spec_max_batch:
            return 1
        return self.num_verify if self.num_verify > 1 else self.decode_steps

    def decode_rows(self, rows: int, num_verify: int) -> int:
        """Rows of the decode program of a ``rows`` bucket at ``num_verify`` positions per
        row: the bucket's, padded so that each forward pass runs ``MIN_DECODE_TOKENS``
        tokens (a verify's pass runs all its positions; K steps run one a pass)."""
        per_pass = num_verify if self.num_verify > 1 else 1
        return max(rows, -(-MIN_DECODE_TOKENS // per_pass))

    @property
    def decode_shapes(self) -> tuple[tuple[int, int], ...]:
        """(rows, D) of every decode program a batch can take: a bucket holds the batches
        of more requests than the bucket below it, up to its own (rows as
        ``decode_rows``)."""
        shapes = {}
        below = 0
        for rows in self.decode_buckets:
            for num_verify in (self.decode_num_verify(below + 1), self.decode_num_verify(rows)):
                shapes[(self.decode_rows(rows, num_verify), num_verify)] = None
            below = rows
        return tuple(shapes)

    @property
    def num_draft_positions(self) -> int:
        """Width of the per-request draft table (at least 1, so shapes never vanish)."""
        return max(1, self.num_verify - 1)

    @property
    def table_chunk_len(self) -> int:
        """Updates in each chunk applied before a step (past the step's own bucket)."""
        return self.context_len

    def extend_rows(self, length: int) -> tuple[int, ...]:
        """The row buckets of extend steps whose rows are ``length`` tokens long: powers
        of two up to ``_most_rows(length)``."""
        return powers_of_two_up_to(self._most_rows(length))

    def _most_rows(self, length: int) -> int:
        """As many rows of ``length`` tokens as the prefill token budget holds (one at
        least, no more than the running requests)."""
        return min(self.max_running, max(1, self.prefill_tokens // length))

    @property
    def extend_shapes(self) -> tuple[tuple[int, int], ...]:
        """(rows, tokens) of every extend program, shorter rows first."""
        return tuple((r, n) for n in self.extend_lengths for r in self.extend_rows(n))

    def extend_length(self, num_new: int) -> int:
        """The length bucket of an extend step whose longest chunk is ``num_new`` tokens."""
        return bucket(num_new, self.extend_lengths)

    def extend_count(self, chunks: Iterable[int]) -> int:
        """How many of ``chunks`` (prefill chunks' tokens, in queue order) one extend step
        takes: the first, then each next one while the step's rows still fit the prefill
        token budget at its longest chunk's length."""
        count = longest = 0
        for num_new in chunks:
            longest = max(longest, num_new)
            if not self.extend_takes(count, longest):
                break
            count += 1
        return count

    def extend_takes(self, count: int, longest: int) -> bool:
        """Whether an extend step of ``count`` chunks takes one more, its longest chunk then
        ``longest`` tokens: always a first, then while its rows fit the prefill token budget
        at that length."""
        return not count or count < self._most_rows(self.extend_length(longest))

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def transfer_rows(self) -> int:
        """KV rows one host-tier copy program moves per call (whole pages)."""
        return self.chunked_prefill

    def host_pools(self, ratio: float, gigabytes: float, slot_bytes: int, token_bytes: int):
        """(host slots, host pages) of the host tier: ``ratio`` times the device pools, or
        with ``gigabytes`` > 0 that many GB (10**9 bytes, as SGLang's ``--hicache-size``)
        split between slots and pages as the device's bytes are (``token_bytes``: KV bytes
        of a token, the draft head's included)."""
        if gigabytes > 0:
            ratio = gigabytes * 1e9 / (self.num_slots * slot_bytes + self.kv_tokens * token_bytes)
        return max(int(self.num_slots * ratio), 1), max(int(self.num_pages * ratio), 1)

    def memory_plan(self, slot_bytes: int, kv_bytes_per_token: int) -> dict:
        """The start-up report (bytes come from the runner's abstract pools)."""
        pinned = self.strategy.pinned_slots
        return {
            "strategy": self.strategy.name,
            "bytes_per_state_slot": slot_bytes,
            "state_slots": self.num_slots,
            "slots_per_running_request": pinned,
            "transient_spare_slots": self.strategy.transient_slots,
            "max_running_requests": self.max_running,
            "slots_left_for_cached_checkpoints": self.num_slots - pinned * self.max_running,
            "kv_tokens": self.kv_tokens,
            "kv_bytes_per_token": kv_bytes_per_token,
            "context_length": self.context_len,  # KV rows per request, headroom included
            "max_request_len": self.max_request_len,  # /v1/models' max_model_len
        }


def default_prefill_tokens(platform: str, chunked_prefill: int) -> int:
    """Prompt tokens (rows x tokens) one extend step takes at most when
    ``max_prefill_tokens`` is unset. On CPU ``MAX_EXTEND_ROWS`` chunks of the longest
    length. On an accelerator ``ACCELERATOR_PREFILL_TOKENS`` (SGLang's chunk on large
    GPUs), or one chunk if that is longer: a burst of short prompts prefills in a few
    steps (64 prompts of 290 tokens in 4 steps of 16 rows, not 16 steps of 4)."""
    if platform == "cpu":
        return MAX_EXTEND_ROWS * chunked_prefill
    return max(ACCELERATOR_PREFILL_TOKENS, chunked_prefill)


def bucket(n: int, options: tuple[int, ...]) -> int:
    """The smallest option >= n."""
    for option in options:
        if option >= n:
            return option
    raise ValueError(f"{n} exceeds the largest bucket {options[-1]}")


def powers_of_two_up_to(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``limit``, then ``limit`` itself."""
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= 2
    out.append(limit)
    return tuple(sorted(set(out)))


def plan_memory(engine_cfg, model_cfg) -> Layout:
    """The layout for an ``EngineConfig`` and a ``ModelConfig`` (pure; no allocation).

    The running-request cap is lowered when the slot pool cannot give every running
    request its peak number of slots (``Layout.requested_running`` keeps the ask)."""
    c = engine_cfg
    strategy = c.strategy
    requested = c.max_running_requests or DEFAULT_MAX_RUNNING
    num_slots = c.max_mamba_cache_size or requested * DEFAULT_SLOTS_PER_RUNNING
    max_running = requested
    cap = num_slots // strategy.peak_slots
    if cap < requested:
        max_running = max(cap, 1)
    context = c.context_length or min(model_cfg.max_position_embeddings, c.max_total_tokens)
    context = -(-context // c.page_size) * c.page_size
    lengths = tuple(
        n * c.mamba_chunk_size
        for n in powers_of_two_up_to(c.chunked_prefill_size // c.mamba_chunk_size)
    )
    return Layout(
        strategy=strategy,
        num_slots=num_slots,
        max_running=max_running,
        requested_running=requested,
        num_pages=-(-c.max_total_tokens // c.page_size),
        page_size=c.page_size,
        context_len=context,
        num_verify=c.num_verify_tokens,
        chunk_size=c.mamba_chunk_size,
        chunked_prefill=c.chunked_prefill_size,
        track_interval=c.mamba_track_interval,
        extend_lengths=lengths,
        # an engine resolves the budget for its platform (``EngineConfig.for_platform``)
        prefill_tokens=c.max_prefill_tokens
        or default_prefill_tokens("cpu", c.chunked_prefill_size),
        decode_buckets=powers_of_two_up_to(max_running),
        spec_max_batch=c.speculative_disable_by_batch_size,
        decode_steps=c.decode_steps,
        host_tier=c.enable_hierarchical_cache and not c.disable_radix_cache,
    )
