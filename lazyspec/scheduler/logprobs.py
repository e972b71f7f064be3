"""Reading a step's logprob outputs into a request (host side, numpy only)."""

from __future__ import annotations

import numpy as np

from lazyspec.scheduler.request import Req


def take_prompt_logprobs(req: Req, start: int, num_new: int, results, b: int) -> None:
    """Mutates ``req``: append the logprobs of the prompt tokens this chunk's positions
    predict (position q gives token q + 1), from its next missing one on."""
    for q in range(start, start + num_new):
        if q + 1 != req.next_prompt_logprob:
            continue
        t = q - start
        req.input_logprobs.append(float(results["prompt_logprobs"][b, t]))
        values, ids = results["prompt_top_logprobs"][b, t], results["prompt_top_ids"][b, t]
        req.input_top_logprobs.append([(float(v), int(i)) for v, i in zip(values, ids)])


def top_pairs(results: dict[str, np.ndarray], b: int, i: int | None) -> list[tuple[float, int]]:
    """The step's top-k (logprob, token id) pairs of row b (position i of a decode step)."""
    values = results["top_logprobs"][b] if i is None else results["top_logprobs"][b, i]
    ids = results["top_ids"][b] if i is None else results["top_ids"][b, i]
    return [(float(v), int(t)) for v, t in zip(values, ids)]
