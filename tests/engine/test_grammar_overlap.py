"""Grammar requests under the overlapped loop: a decode step with grammar rows runs as two
programs (forward, then sampling and commit), the masks filled between them once the step
in flight is processed.

Served with overlap on, grammar requests and the unconstrained requests batched with them
give the tokens of the loop without overlap (every strategy that overlaps, speculation on
and off, under retraction too), the unconstrained ones those of a run without any grammar
request; the runner's calls come in the overlapped order. llguidance (the default backend)
runs every case, xgrammar those with speculation.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest

from lazyspec.engine.engine import Engine
from lazyspec.testing.char_tokenizer import char_tokenizer
from lazyspec.testing.sinks import assert_null_sinks_zero
from lazyspec.testing.tiny_models import small_engine, tiny_model
from tests.engine.test_structured_output import REGEX, SCHEMA

CONSTRAINED = 3  # the first requests of ``_requests`` have a grammar


@pytest.fixture(scope="module")
def model():
    base = tiny_model("qwen3_next")
    return SimpleNamespace(**{**vars(base), "tokenizer": char_tokenizer()})


def _engine(model, strategy: str, spec: bool, overlap: bool, **kw) -> Engine:
    return small_engine(model, strategy, overlap, spec, **{"max_running_requests": 6, **kw})


def _requests() -> list[tuple[list[int], dict]]:
    """Three grammar requests (greedy JSON, greedy regex, sampled JSON), then three without
    one (greedy, seeded sampling with penalties, greedy with a logit bias)."""
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(3, 128, size=n))) for n in (7, 40, 19, 23, 11, 30)]
    schema = json.dumps(SCHEMA)
    params = [
        {"json_schema": schema},
        {"regex": REGEX},
        {"temperature": 1.0, "seed": 5, "json_schema": schema},
        {"ignore_eos": True},
        {"temperature": 0.8, "seed": 9, "ignore_eos": True, "frequency_penalty": 0.7},
        {"ignore_eos": True, "logit_bias": {"40": 3.0}},
    ]
    return [(p, {"max_new_tokens": 40, **extra}) for p, extra in zip(prompts, params)]


def _serve(engine: Engine, requests) -> list:
    reqs = [engine.add_request(input_ids=ids, sampling_params=params) for ids, params in requests]
    engine.run_until_done(reqs, check=lambda e: e.check_integrity())
    return reqs


def _count_calls(engine: Engine) -> dict[str, int]:
    """Counts of the runner's whole-step and split-step launches, as the engine makes them."""
    counts = {"launch": 0, "launch_forward": 0, "launch_finish": 0}
    for name in counts:
        call = getattr(engine.runner, name)

        def counted(*args, name=name, call=call, **kwargs):
            counts[name] += 1
            return call(*args, **kwargs)

        setattr(engine.runner, name, counted)
    return counts


@pytest.fixture(scope="module")
def unconstrained(model) -> list[list[int]]:
    """The unconstrained requests' outputs in a run without any grammar request."""
    engine = _engine(model, "extra_buffer_lazy", spec=False, overlap=True)
    return [req.output_ids for req in _serve(engine, _requests()[CONSTRAINED:])]


@pytest.mark.parametrize(
    "strategy,spec,pool,backend",
    [
        ("extra_buffer", True, 4096, "llguidance"),
        ("extra_buffer_lazy", True, 4096, "llguidance"),
        ("extra_buffer", False, 4096, "llguidance"),
        ("extra_buffer_lazy", False, 4096, "llguidance"),
        ("extra_buffer_lazy", True, 224, "llguidance"),  # retractions mid-decode
        ("extra_buffer", True, 4096, "xgrammar"),
        ("extra_buffer_lazy", True, 224, "xgrammar"),
    ],
)
def test_overlapped_grammar_batches_give_the_tokens_of_the_synchronous_loop(
    model, unconstrained, strategy, spec, pool, backend
):
    requests = _requests()
    served, counts = {}, {}
    for overlap in (True, False):
        engine = _engine(
            model, strategy, spec, overlap, max_total_tokens=pool, grammar_backend=backend
        )
        counts[overlap] = _count_calls(engine)
        served[overlap] = _serve(engine, requests)
        assert_null_sinks_zero(engine)
        assert not np.asarray(engine.runner.pools.vocab_mask[0]).any()  # the null row
        if pool < 4096:
            assert engine.stats().num_retractions > 0  # the small pool did retract
    outputs = {overlap: [req.output_ids for req in reqs] for overlap, reqs in served.items()}
    assert outputs[True] == outputs[False]
    # with overlap, decode steps with grammar rows ran split; without, none did
    split = counts[True]["launch_forward"]
    assert split == counts[True]["launch_finish"] >= 10, counts
    assert counts[False]["launch_forward"] == counts[False]["launch_finish"] == 0
    reqs = served[True]
    for req in reqs[:CONSTRAINED]:
        assert req.finish_reason["type"] == "stop", (req.finish_reason, req.output_ids)
        assert req.output_ids[-1] == 2  # the grammar's stop token ends it
    texts = [char_tokenizer().decode(req.output_ids[:-1]) for req in reqs[:CONSTRAINED]]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(REGEX, texts[1]), texts[1]
    jsonschema.validate(json.loads(texts[2]), SCHEMA)
    assert outputs[True][CONSTRAINED:] == unconstrained
    assert len({tuple(out) for out in outputs[True]}) == len(requests)  # outputs differ


def test_grammar_masks_are_filled_while_the_forward_runs(model):
    """The order of the runner's calls: a decode step with grammar rows launches its forward,
    then the step in flight is processed (its matchers advanced), then the step's masks are
    filled and its sampling launched. Every step, the unconstrained rows' too, is processed
    only after the next one was launched while the grammar requests run."""
    engine = _engine(model, "extra_buffer_lazy", spec=True, overlap=True)
    events: list[tuple[str, int]] = []
    runner, sched = engine.runner, engine.scheduler
    plans: dict[int, int] = {}  # id(plan) -> its number
    planned = []

    def logged(owner, name, event):
        call = getattr(owner, name)

        def run(*args, **kwargs):
            events.append(event(*args))
            return call(*args, **kwargs)

        setattr(owner, name, run)

    schedule = sched.schedule

    def numbered(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        if plan is not None:
            plans[id(plan)] = len(plans)
            planned.append(plan)
            events.append(("plan", plans[id(plan)]))
        return plan

    sched.schedule = numbered
    last = lambda: len(plans) - 1  # noqa: E731  the plan just made
    logged(runner, "launch", lambda *a: ("launch", last()))
    logged(runner, "launch_forward", lambda *a: ("forward", last()))
    logged(runner, "launch_finish", lambda *a: ("finish", last()))
    logged(sched, "process", lambda plan, *a: ("process", plans[id(plan)]))
    logged(sched, "grammar_masks", lambda plan, *a: ("masks", plans[id(plan)]))
    reqs = _serve(engine, _requests()[:4])  # a grammar request runs until the last step
    assert all(req.finished for req in reqs)

    def at(event):
        return events.index(event)

    split = sorted(n for kind, n in events if kind == "forward")
    for n in split:
        if ("process", n - 1) in events:
            # forward(n) -> process(n - 1) -> masks(n) -> finish(n) -> process(n)
            assert at(("forward", n)) < at(("process", n - 1)) < at(("masks", n))
            assert at(("masks", n)) < at(("finish", n)) < at(("process", n))
    # overlap throughout: step n is processed after step n + 1 was launched, never before
    for kind, n in events:
        if kind == "process" and ("plan", n + 1) in events:
            launched = [e for e in events if e[1] == n + 1 and e[0] in ("launch", "forward")]
            assert at(launched[0]) < at(("process", n)), (n, events)
    assert len(split) >= 10, events
    # the unconstrained request shared split steps with the grammar rows
    shared = [n for n in split if any(r.req is reqs[-1] for r in planned[n].records)]
    assert len(shared) >= 5, shared


def test_a_retracted_grammar_request_resumes_as_without_overlap(model):
    """A grammar request retracted while a split step is in flight drops that step's
    outputs (its matcher never saw them) and resumes from its matcher's state: the tokens
    equal the loop without overlap, and the outputs match."""
    long_regex = r"[a-f]{36}-[0-9]{3}"
    rng = np.random.default_rng(8)
    requests = [
        (list(map(int, rng.integers(3, 128, size=n))), {"max_new_tokens": 48, "regex": long_regex})
        for n in (30, 45, 12, 38)
    ] + _requests()[CONSTRAINED : CONSTRAINED + 2]
    served = {}
    for overlap in (True, False):
        engine = _engine(model, "extra_buffer_lazy", False, overlap, max_total_tokens=192)
        served[overlap] = _serve(engine, requests)
    reqs = served[True]
    assert any(req.num_retractions for req in reqs[:4]), [r.num_retractions for r in reqs]
    assert [r.output_ids for r in reqs] == [r.output_ids for r in served[False]]
    for req in reqs[:4]:
        assert req.finish_reason["type"] == "stop", req.finish_reason
        assert re.fullmatch(long_regex, char_tokenizer().decode(req.output_ids[:-1]))
