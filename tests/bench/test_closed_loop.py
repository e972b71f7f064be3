"""``ClosedLoop`` against a scripted engine: which step finishes what, TTFTs, reuse."""

from __future__ import annotations

from types import SimpleNamespace

from lazyspec.bench.closed_loop import ClosedLoop


class ScriptedEngine:
    """Each request gets one output token a step and finishes after ``max_new_tokens``;
    the cached tokens are given per prompt's first token."""

    def __init__(self, cached: dict[int, int]) -> None:
        self.cached, self.reqs, self.num_steps = cached, [], 0

    def add_request(self, input_ids, sampling_params):
        req = SimpleNamespace(
            rid=len(self.reqs),
            input_ids=list(input_ids),
            output_ids=[],
            finished=False,
            cached_tokens=self.cached.get(input_ids[0], 0),
            budget=sampling_params["max_new_tokens"],
        )
        self.reqs.append(req)
        return req

    def step(self) -> None:
        self.num_steps += 1
        for req in self.reqs:
            if not req.finished:
                req.output_ids.append(self.num_steps)
                req.finished = len(req.output_ids) == req.budget


def test_step_returns_finished_requests_with_their_tags_and_counts() -> None:
    loop = ClosedLoop(ScriptedEngine(cached={7: 3}))
    loop.submit([5, 1, 1, 1], 2, "a")
    loop.submit([7, 1, 1, 1, 1, 1], 1, "b")
    assert len(loop) == 2
    first = loop.step()
    assert [tag for _, tag in first] == ["b"] and len(loop) == 1
    loop.count_reuse(first[0][0])
    second = loop.step()
    assert [(req.output_ids, tag) for req, tag in second] == [([1, 2], "a")]
    assert len(loop) == 0 and loop.step() == []
    assert loop.num_out == 3 and len(loop.ttfts) == 2
    assert all(t >= 0 for t in loop.ttfts)
    # only "b" was counted: 3 of its 6 prompt tokens from the cache
    assert (loop.counted, loop.hits, loop.cached_tokens, loop.prompt_tokens) == (1, 1, 3, 6)
    assert loop.reuse == 0.5


def test_reuse_of_nothing_counted_is_zero() -> None:
    assert ClosedLoop(ScriptedEngine(cached={})).reuse == 0.0
