"""NewTokenRatio: the fraction of its remaining ``max_new_tokens`` a request is expected to use.

Host-only (no jax). Admission counts a request's future KV as its prompt plus
``min(max_new_tokens - outputs, CLIP_MAX_NEW_TOKENS) * ratio`` instead of reserving every
token it may produce; pages are allocated as decode reaches them, and a decode step that
cannot get its pages retracts requests (``Scheduler._retract``). The ratio follows SGLang's
``new_token_ratio``: it starts at ``init`` (0.7 x ``schedule_conservativeness``, at most
1), decays by ``(init - min) / NEW_TOKEN_RATIO_DECAY_STEPS`` every decode step down to
``min`` (``init x MIN_NEW_TOKEN_RATIO_FACTOR``), jumps to what the running batch actually
needs after a retraction, and is reset to ``init`` when nothing runs.
"""

from __future__ import annotations

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
# after a retraction every remaining request is assumed to decode this many more tokens
RETRACT_DECODE_STEPS = 20
# a request's remaining max_new_tokens is counted up to this many tokens
CLIP_MAX_NEW_TOKENS = 4096


class NewTokenRatio:
    def __init__(self, schedule_conservativeness: float = 1.0) -> None:
        self.init = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self.min = min(self.init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.decay = (self.init - self.min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.init

    def estimate(self, remaining_new_tokens: int) -> int:
        """Tokens a request with ``remaining_new_tokens`` still to go is expected to add
        (a query)."""
        return int(min(max(remaining_new_tokens, 0), CLIP_MAX_NEW_TOKENS) * self.value)

    def step(self) -> None:
        """Mutates: one decode step without a retraction."""
        self.value = max(self.value - self.decay, self.min)

    def after_retraction(self, num_output_tokens: int, num_max_new_tokens: int, num_reqs: int):
        """Mutates: the ratio the requests left running need (their outputs so far plus
        ``RETRACT_DECODE_STEPS`` each, over their ``max_new_tokens``), at most 1."""
        needed = num_output_tokens + RETRACT_DECODE_STEPS * num_reqs
        self.value = min(1.0, needed / max(num_max_new_tokens, 1))

    def reset(self) -> None:
        """Mutates: back to ``init`` (nothing is running)."""
        self.value = self.init
