"""The engine with kernel_backend="pallas" (the state update in the Pallas kernel; interpret
mode on CPU) gives the same greedy tokens as the XLA path, speculative and not."""

from __future__ import annotations

import numpy as np
import pytest

from lazyspec.engine.engine import Engine
from lazyspec.testing.tiny_models import reference_greedy, small_engine, tiny_model

pytestmark = pytest.mark.pallas


def _engine(model, **kw) -> Engine:
    return small_engine(model, "auto", kernel_backend="pallas", max_total_tokens=1024, **kw)


@pytest.mark.parametrize(
    "family,spec", [("nemotron_h", False), ("qwen3_next", False), ("qwen3_next", True)]
)
def test_pallas_backend_engine_matches_reference(family, spec):
    model = tiny_model(family)
    rng = np.random.default_rng(11)
    prompts = [list(rng.integers(3, 128, size=n)) for n in (20, 37)]
    want = [reference_greedy(model, p, 5, pad_len=256)[0] for p in prompts]
    engine = _engine(
        model,
        max_running_requests=2,
        context_length=128,
        **(dict(speculative_algorithm="NEXTN", speculative_num_steps=1) if spec else {}),
    )
    outs = engine.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": 5, "ignore_eos": True}
    )
    assert [o["output_ids"] for o in outs] == want
    engine.check_integrity()


def test_draft_head_runs_the_engines_kernels(monkeypatch):
    """The draft head's layer gets the step's kernels (the paged attention and the routed
    experts), not the XLA forms: every ``mtp_forward`` call a speculative step traces."""
    from lazyspec.models import qwen3_next

    seen = []
    original = qwen3_next.mtp_forward

    def recording(*args, **kwargs):
        seen.append(kwargs.get("kernels"))
        return original(*args, **kwargs)

    monkeypatch.setattr(qwen3_next, "mtp_forward", recording)
    model = tiny_model("qwen3_next")
    engine = _engine(
        model,
        max_running_requests=3,  # a shape no other test compiles: the steps are traced here
        context_length=96,
        speculative_algorithm="NEXTN",
        speculative_num_steps=2,
    )
    prompt = list(np.random.default_rng(3).integers(3, 128, size=20))
    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    # the extend step's draft extend and chain, the decode step's: each traced once
    assert len(seen) >= 4
    assert all(k is not None and k.backend == "pallas" and k.moe_experts for k in seen), seen
