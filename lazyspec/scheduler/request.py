"""Host-side request state. Plain Python: never enters jit."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import Any

NO_SLOT = 0  # the null slot: "none" for every slot field
TOP_LOGPROBS = 5  # most likely tokens reported per position (top_logprobs_num <= this)
MAX_TEMPERATURE = 100.0  # past this the distribution is uniform to float32 precision anyway
SEED_RANGE = (-(2**63), 2**64 - 1)  # inclusive: any 64-bit seed (batch.seed_bits)
MAX_LOGIT_BIAS = 16  # (token, bias) pairs per request (a fixed width in the step batch)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # inclusive, as OpenAI's
# stop_token_ids a request with min_new_tokens > 0 may give: they and the model's EOS ids
# are masked on the device, in a fixed-width per-row list
MAX_MIN_TOKENS_STOP_IDS = 16
PENALTY_RANGE = (-2.0, 2.0)  # inclusive: frequency_penalty and presence_penalty, as OpenAI's
REPETITION_PENALTY_MAX = 2.0  # repetition_penalty in (0, this], as SGLang's
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")  # constrained decoding, at most one


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    # SGLang's: tokens below min_p x the most likely token's probability are dropped (0 = off)
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    min_new_tokens: int = 0  # EOS and stop_token_ids are masked until this many outputs
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) added to the logits
    # OpenAI: minus frequency * (times the token was output) and presence * (output at all)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # SGLang / HF: a token of the prompt or the outputs has its logit divided by this when
    # positive, multiplied when not (1 = off)
    repetition_penalty: float = 1.0
    # constrained decoding (at most one): a JSON schema, a regex or an EBNF grammar, as text
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @classmethod
    def names(cls) -> set[str]:
        """The parameter names ``from_dict`` takes: the fields."""
        return {f.name for f in fields(cls)}

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> SamplingParams:
        params = dict(params or {})
        known = cls.names()
        unknown = set(params) - known
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        if "stop_token_ids" in params and params["stop_token_ids"] is not None:
            params["stop_token_ids"] = tuple(int(t) for t in params["stop_token_ids"])
        elif "stop_token_ids" in params:
            params["stop_token_ids"] = ()
        if isinstance(params.get("logit_bias"), dict):
            params["logit_bias"] = tuple(
                (int(t), float(b)) for t, b in params["logit_bias"].items()
            )
        elif params.get("logit_bias") is None:
            params.pop("logit_bias", None)
        out = cls(**params)
        out.validate()
        return out

    def validate(self, vocab_size: int | None = None) -> None:
        """ValueError naming the first field out of range (``top_k`` and ``stop_token_ids``
        are checked against the vocabulary when ``vocab_size`` is given)."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 0")
        if not _is_real(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature={self.temperature!r} must be a number in [0, {MAX_TEMPERATURE}]"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        top_k_max = vocab_size if vocab_size is not None else float("inf")
        if not _is_int(self.top_k) or not (self.top_k == -1 or 1 <= self.top_k <= top_k_max):
            raise ValueError(f"top_k={self.top_k!r} must be -1 (off) or in [1, {top_k_max}]")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p!r} must be a number in [0, 1]")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be true or false")
        low, high = SEED_RANGE
        if self.seed is not None and (not _is_int(self.seed) or not low <= self.seed <= high):
            raise ValueError(f"seed={self.seed!r} must be an integer in [{low}, {high}]")
        for token in self.stop_token_ids:
            if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(
                    f"stop_token_ids holds {token!r}, outside the vocabulary [0, {vocab_size})"
                )
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens!r} must be an integer in "
                f"[0, max_new_tokens={self.max_new_tokens}]"
            )
        if self.min_new_tokens > 0 and len(self.stop_token_ids) > MAX_MIN_TOKENS_STOP_IDS:
            raise ValueError(
                f"min_new_tokens > 0 takes at most {MAX_MIN_TOKENS_STOP_IDS} stop_token_ids "
                f"(got {len(self.stop_token_ids)})"
            )
        _validate_logit_bias(self.logit_bias, vocab_size)
        low, high = PENALTY_RANGE
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not low <= value <= high:
                raise ValueError(f"{name}={value!r} must be a number in [{low}, {high}]")
        value = self.repetition_penalty
        if not _is_real(value) or not 0 < value <= REPETITION_PENALTY_MAX:
            raise ValueError(
                f"repetition_penalty={value!r} must be a number in (0, {REPETITION_PENALTY_MAX}]"
            )
        _validate_grammar(self)

    @property
    def has_penalties(self) -> bool:
        """True when a frequency, presence or repetition penalty changes the logits (the
        request's row of the token-count pools must then be exact)."""
        return (
            self.frequency_penalty != 0
            or self.presence_penalty != 0
            or self.repetition_penalty != 1
        )


def _validate_grammar(params: SamplingParams) -> None:
    given = [name for name in GRAMMAR_FIELDS if getattr(params, name) is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema, regex and ebnf (got {given})")
    for name in given:
        if not isinstance(getattr(params, name), str):
            raise ValueError(f"{name}={getattr(params, name)!r} must be a string")


def _validate_logit_bias(pairs: Any, vocab_size: int | None) -> None:
    if not isinstance(pairs, tuple):
        raise ValueError(f"logit_bias={pairs!r} must map token ids to numbers")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(
            f"logit_bias holds {len(pairs)} tokens; at most {MAX_LOGIT_BIAS} are supported"
        )
    low, high = LOGIT_BIAS_RANGE
    tokens = set()
    for pair in pairs:
        token, bias = pair if isinstance(pair, tuple) and len(pair) == 2 else (None, None)
        if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
            raise ValueError(
                f"logit_bias names token {token!r}, outside the vocabulary [0, {vocab_size})"
            )
        if token in tokens:
            raise ValueError(f"logit_bias names token {token} twice")
        tokens.add(token)
        if not _is_real(bias) or not low <= bias <= high:
            raise ValueError(f"logit_bias[{token}]={bias!r} must be a number in [{low}, {high}]")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"  # some prompt tokens not yet scheduled
    DECODE = "decode"  # all prompt tokens scheduled; decode steps run
    FINISHED = "finished"


@dataclass
class ReqSlots:
    """A request's recurrent-state slots (pool ids; NO_SLOT = none). Written only by
    ``SlotPolicy`` (policy.py); everyone else reads.

    ``keep`` holds the state after exactly ``last_track_len`` tokens once a checkpoint has
    settled (``last_track_len`` None = no checkpoint of this request yet); ``spare`` is the
    ping-pong scratch (extra_buffer) or the lazily borrowed spare (extra_buffer_lazy);
    ``keep_clobbered`` says an in-place write left ``keep`` past ``last_track_len`` (it may
    not be donated); ``chunk_track_len`` is the checkpoint a planned prefill chunk (not the
    last) writes into ``keep``, inserted before the next chunk is planned; ``source`` is
    where the next extend reads its initial state; ``retired`` are slots of a retracted
    request that a step still in flight may write (freed when that step is processed;
    never counted as the request's own).
    """

    working: int = NO_SLOT
    keep: int = NO_SLOT
    spare: int = NO_SLOT
    last_track_len: int | None = None
    keep_clobbered: bool = False
    chunk_track_len: int | None = None
    source: int = NO_SLOT
    retired: tuple[int, ...] = ()

    def owned(self) -> list[int]:
        """The distinct slots the request holds, sorted."""
        return sorted({self.working, self.keep, self.spare} - {NO_SLOT})


@dataclass
class Req:
    """One request: its tokens, sampling, progress and resources (host only)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    # prompt logprobs from this token index on (None: none); token 0 has none
    logprob_start_len: int | None = None
    input_logprobs: list[float] = field(default_factory=list)  # from max(start, 1) on
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    arrival: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    finish_reason: dict[str, Any] | None = None
    # resources
    req_row: int = 0
    slots: ReqSlots = field(default_factory=ReqSlots)
    prefix_node: Any = None
    prefix_len: int = 0
    cached_tokens: int = 0
    own_pages: Any = None  # np.ndarray of the KV pages this request allocated
    # (buffer, view): ``RequestCache.grow`` appends pages into the buffer while ``own_pages``
    # is still the view of it it last set (``cache._append_pages``)
    page_buffer: Any = None
    # progress
    fill_len: int = 0  # tokens of ``fill_ids`` scheduled for prefill
    seq_len: int = 0  # tokens whose state + KV are committed (processed results)
    inflight_decode: int = 0  # decode steps launched but not yet processed
    spec_verify_ct: int = 0
    num_retractions: int = 0  # times retracted to free KV (resumed by recompute)
    accept_hist: list[int] = field(default_factory=list)

    fill_ids: list[int] = field(
        default_factory=list
    )  # tokens the prefill covers (fixed at admission)
    sampling_row: Any = None  # batch.SamplingRow: the sampling values in batch dtypes
    grammar: Any = None  # grammar.RequestGrammar when the output is constrained
    # the draft tokens the next verify step reads (the last step's, fetched for grammar rows)
    next_drafts: list[int] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def next_prompt_logprob(self) -> int | None:
        """Index of the next prompt token whose logprob is still to be computed (a prefill
        computes it at the position before); None when none is (left)."""
        if self.logprob_start_len is None:
            return None
        index = max(self.logprob_start_len, 1) + len(self.input_logprobs)
        return index if index < len(self.input_ids) else None

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED


def input_token_logprobs(req: Req) -> list[tuple[float | None, int]]:
    """(logprob, token id) of ``req``'s prompt from its ``logprob_start_len`` on (computed so
    far); the first prompt token has no logprob (None)."""
    start = req.logprob_start_len
    logprobs = [None] * (start == 0) + list(req.input_logprobs)
    return list(zip(logprobs, req.input_ids[start:]))
