"""The workloads of the reuse benchmark (``scripts/bench_reuse.py``): who sends which prompt
when, as plain token lists (no jax).

A workload opens with ``first()`` (the requests sent at once) and answers each finished
request with ``follow()`` (the next request of the same conversation, or None). Every request
carries whether it counts toward the reuse figures: a request that could hit the cache if
the cache kept what it should (a later turn, or a later member of a shared-prefix group).

| workload  | shape                                                                          |
|-----------|--------------------------------------------------------------------------------|
| multiturn | the source document's: N conversations x T turns; turn k+1 = turn k's prompt + |
|           | its output + new user tokens                                                   |
| fewshot   | G shared few-shot prefixes, each followed by its own question (one turn)       |
| agentic   | one shared system prompt; each task loops output (a tool call) + a tool result |
| random    | unrelated prompts, one turn (nothing to reuse: the cache's overhead alone)     |

Lengths vary by +-25 % per request (seeded), so seeds change the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORKLOADS = ("multiturn", "fewshot", "agentic", "random")


@dataclass(frozen=True)
class Shape:
    conversations: int  # conversations (multiturn, agentic) or requests (fewshot, random)
    turns: int
    first_len: int  # turn-1 prompt tokens (fewshot: the shared prefix; agentic: the system prompt)
    turn_len: int  # new user tokens per turn (fewshot: the question; agentic: the task)
    output_len: int
    groups: int = 4  # fewshot: shared prefixes
    tool_len: int = 120  # agentic: tool-result tokens per turn


@dataclass
class Request:
    conversation: int
    turn: int
    prompt: list[int]
    max_new_tokens: int
    counted: bool  # counts toward the reuse figures


class Workload:
    def __init__(self, name: str, shape: Shape, vocab: int, seed: int) -> None:
        if name not in WORKLOADS:
            raise ValueError(f"workload {name!r} is not one of {WORKLOADS}")
        self.name, self.shape, self.vocab = name, shape, vocab
        self.rng = np.random.default_rng(seed)
        self._shared = [self._tokens(shape.first_len, jitter=False) for _ in range(shape.groups)]

    def _jitter(self, n: int) -> int:
        return max(1, int(round(n * self.rng.uniform(0.75, 1.25))))

    def _tokens(self, n: int, jitter: bool = True) -> list[int]:
        size = self._jitter(n) if jitter else n
        return [int(t) for t in self.rng.integers(3, self.vocab, size=size)]

    def _request(self, conversation: int, turn: int, prompt: list[int], counted: bool):
        return Request(conversation, turn, prompt, self._jitter(self.shape.output_len), counted)

    def first(self) -> list[Request]:
        s = self.shape
        out = []
        for c in range(s.conversations):
            if self.name == "multiturn":
                out.append(self._request(c, 1, self._tokens(s.first_len), False))
            elif self.name == "fewshot":
                group = c % s.groups
                prompt = self._shared[group] + self._tokens(s.turn_len)
                out.append(self._request(c, 1, prompt, c >= s.groups))
            elif self.name == "agentic":
                prompt = self._shared[0] + self._tokens(s.turn_len)
                out.append(self._request(c, 1, prompt, c > 0))
            else:
                out.append(self._request(c, 1, self._tokens(s.first_len + s.turn_len), True))
        return out

    def follow(self, done: Request, output_ids: list[int]) -> Request | None:
        """The next request after ``done`` finished with ``output_ids``, or None."""
        s = self.shape
        if self.name not in ("multiturn", "agentic") or done.turn >= s.turns:
            return None
        new = self._tokens(s.turn_len if self.name == "multiturn" else s.tool_len)
        prompt = done.prompt + output_ids + new
        return self._request(done.conversation, done.turn + 1, prompt, True)


DEFAULT_SHAPES = {
    # the source document's benchmark: 48 conversations x 3 turns
    "multiturn": Shape(conversations=48, turns=3, first_len=200, turn_len=60, output_len=40),
    "fewshot": Shape(conversations=48, turns=1, first_len=400, turn_len=60, output_len=32),
    "agentic": Shape(conversations=24, turns=4, first_len=300, turn_len=60, output_len=32),
    "random": Shape(conversations=48, turns=1, first_len=200, turn_len=60, output_len=32),
}
