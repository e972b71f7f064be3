"""Speculation switched off by batch size (``speculative_disable_by_batch_size``): a decode
step over more requests than the limit takes one token per request and drafts nothing.

Greedy outputs stay those of the cache-free reference while the batch crosses the limit both
ways (every strategy that speculates, overlap on and off, the tree's checkpoints checked
against a recompute after every step); a step without speculation leaves its rows with no
draft, which the next verify rejects without touching the sampling distribution; grammar
rows keep their exact tokens through both step kinds; and warm-up compiles both programs,
so serving compiles nothing.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.config import EngineConfig
from lazyspec.engine.engine import Engine
from lazyspec.engine.sampling import (
    processed_logits,
    sample_from,
    target_probs,
    verify_and_sample,
)
from lazyspec.engine.steps import NO_DRAFT
from lazyspec.scheduler.batch import build_decode
from lazyspec.scheduler.layout import plan_memory
from lazyspec.testing.char_tokenizer import char_tokenizer
from lazyspec.testing.scripted_drafter import make_script, scripted_model
from lazyspec.testing.state_oracle import TreeStateOracle
from lazyspec.testing.tiny_models import (
    SPEC,
    reference_greedy,
    serve_greedy_lengths,
    small_engine,
    tiny_model,
)
from tests.engine.test_sampling import sampling_arrays

D = 4
LIMIT = 2  # speculation off over more than two running requests


def _engine(model, strategy: str = "extra_buffer", overlap: bool = True, **kw) -> Engine:
    return small_engine(model, strategy, overlap, **SPEC, **kw)


def _greedy(num_new: int) -> dict:
    return {"max_new_tokens": num_new, "ignore_eos": True}


@pytest.fixture(scope="module")
def scripted_case():
    """One prompt served four times with different lengths (the batch shrinks 4 -> 1); the
    draft head proposes the greedy continuation with some positions corrupted, so the steps
    that speculate accept every length."""
    model = tiny_model("qwen3_next")
    rng = np.random.default_rng(7)
    prompt = list(map(int, rng.integers(3, 128, size=37)))
    greedy = reference_greedy(model, prompt, 90, pad_len=256)[0]
    script = make_script(prompt + greedy, 512, corrupt_prob=0.3, vocab=128, seed=3)
    return model, scripted_model(model, script), prompt, greedy


@pytest.mark.parametrize(
    "strategy,overlap",
    [
        ("extra_buffer", True),
        ("extra_buffer", False),
        ("extra_buffer_lazy", True),
        ("extra_buffer_lazy", False),
    ],
)
def test_outputs_are_exact_across_the_limit(scripted_case, strategy, overlap):
    model, drafter, prompt, greedy = scripted_case
    engine = _engine(drafter, strategy, overlap, speculative_disable_by_batch_size=LIMIT)
    oracle = TreeStateOracle(engine)
    lengths = (20, 45, 70, 90)
    reqs = serve_greedy_lengths(engine, prompt, lengths, check=oracle)
    assert [r.output_ids for r in reqs] == [greedy[:n] for n in lengths]
    info = engine.get_server_info()
    # both step kinds ran: over the limit (4, 3 requests) and under it (2, 1)
    assert info["num_decode_steps_without_speculation"] > 0
    assert info["num_verify_steps"] > 0
    # the server's accept length is that of the verifying steps the requests saw
    hist = [n for r in reqs for n in r.accept_hist]
    assert info["num_verify_steps"] == len(hist)
    assert info["avg_accept_length"] == pytest.approx(np.mean(hist))
    # the verify steps of the longest request took every accept length
    assert set(reqs[-1].accept_hist) == set(range(1, D + 1)), reqs[-1].accept_hist
    # a request's verify count is its speculating steps only: the shortest ran in batches
    # of four only
    assert reqs[0].spec_verify_ct == 0 and not reqs[0].accept_hist
    assert oracle.num_checked > 0
    assert engine.flush_cache()
    assert engine.slot_allocator.num_free == engine.layout.num_slots


def test_a_step_without_speculation_leaves_no_draft(scripted_case):
    """Two requests of one length over a limit of one: every decode step runs without
    speculation, and each leaves its rows' drafts at NO_DRAFT (the next verify, if the
    batch shrank, would reject them)."""
    model, drafter, prompt, greedy = scripted_case
    engine = _engine(drafter, speculative_disable_by_batch_size=1)
    reqs = [
        engine.add_request(
            input_ids=prompt, sampling_params={"max_new_tokens": 12, "ignore_eos": True}
        )
        for _ in range(2)
    ]
    engine.run_until_done(reqs)
    assert [r.output_ids for r in reqs] == [greedy[:12]] * 2
    assert all(r.spec_verify_ct == 0 for r in reqs)
    drafts = np.asarray(engine.runner.pools.drafts)
    rows = [r.req_row for r in reqs]
    assert (drafts[rows] == NO_DRAFT).all(), drafts[rows]


VOCAB = 16


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_rejects_no_draft_without_touching_the_distribution(temperature):
    """Drafts at NO_DRAFT: nothing is accepted and the bonus token is drawn from position
    0's whole distribution, as a step without speculation would draw it. Row 0 puts nearly
    all mass on the last token id (which a negative index reaches), the other rows half on
    it and half on id 0 (which a clamped index reaches)."""
    batch, num_pos = 8, D
    logits = jnp.zeros((batch, num_pos, VOCAB)).at[:, :, VOCAB - 1].set(30.0)
    logits = logits.at[1:, :, 0].set(30.0)
    drafts = jnp.full((batch, num_pos - 1), NO_DRAFT, jnp.int32)
    positions = jnp.arange(num_pos)[None, :] + 4 * jnp.arange(batch)[:, None]
    params = sampling_arrays(batch, temperature)
    tokens, accept_len = verify_and_sample(logits, drafts, positions, params)
    assert np.asarray(accept_len).tolist() == [1] * batch
    probs = target_probs(processed_logits(logits[:, :1], params, positions[:, :1]), params)[:, 0]
    plain = np.asarray(sample_from(probs, params.seed, positions[:, 0], params.temperature == 0))
    assert np.asarray(tokens[:, 0]).tolist() == plain.tolist()
    assert plain[0] == VOCAB - 1
    if temperature:  # the seeds draw both halves
        assert set(plain[1:].tolist()) == {0, VOCAB - 1}, plain
    assert (np.asarray(tokens[:, 1:]) == -1).all()


@pytest.fixture(scope="module")
def char_model():
    base = tiny_model("qwen3_next")
    return SimpleNamespace(**{**vars(base), "tokenizer": char_tokenizer()})


def test_grammar_rows_through_both_step_kinds(char_model):
    """Greedy grammar rows (JSON, regex) and a free row, five requests over a limit of two:
    the split decode step runs without speculation, then with it; the tokens are those of an
    engine that always speculates, and the outputs parse."""
    from tests.engine.test_structured_output import REGEX, SCHEMA  # needs the grammar extras

    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(3, 128, size=n))) for n in (7, 40, 19, 23, 11)]
    schema = json.dumps(SCHEMA)
    extras = [
        {"json_schema": schema},
        {"regex": REGEX},
        {"ignore_eos": True, "max_new_tokens": 10},
        {"ignore_eos": True, "max_new_tokens": 20},
        {"ignore_eos": True},
    ]
    requests = [(p, {"max_new_tokens": 40, **x}) for p, x in zip(prompts, extras)]

    def serve(engine):
        reqs = [engine.add_request(input_ids=ids, sampling_params=p) for ids, p in requests]
        engine.run_until_done(reqs, check=Engine.check_integrity)
        return reqs, engine.get_server_info()

    limited, info = serve(_engine(char_model, speculative_disable_by_batch_size=LIMIT))
    always, _ = serve(_engine(char_model))
    assert [r.output_ids for r in limited] == [r.output_ids for r in always]
    assert info["num_decode_steps_without_speculation"] > 0 and info["num_verify_steps"] > 0
    text = [char_model.tokenizer.decode(r.output_ids) for r in limited]
    json.loads(text[0])
    assert re.fullmatch(REGEX, text[1]), text[1]


def test_warmup_compiles_both_programs(scripted_case):
    """Warm-up compiles the decode program of every (bucket, D) a batch can take; serving
    across the limit then compiles nothing."""
    model, _, prompt, greedy = scripted_case
    # one extend length bucket (the claim is about the decode programs): a warm-up of fewer
    # programs, none of them compiled before it by the tests above (a config of its own)
    engine = _engine(
        model, speculative_disable_by_batch_size=LIMIT, skip_warmup=False, chunked_prefill_size=16
    )
    assert engine.layout.decode_shapes == ((1, D), (2, D), (4, 1))
    compiled = engine.num_compiled()
    reqs = serve_greedy_lengths(engine, prompt, (5, 9, 14, 20))
    assert engine.num_compiled() == compiled
    assert [r.output_ids for r in reqs] == [greedy[:n] for n in (5, 9, 14, 20)]
    assert engine.get_server_info()["num_decode_steps_without_speculation"] > 0


def test_decode_shapes_follow_the_limit():
    model_cfg = tiny_model("qwen3_next").config

    def shapes(**kw):
        config = EngineConfig(max_running_requests=8, **kw)
        return plan_memory(config, model_cfg).decode_shapes

    # one request without speculation runs in two rows (layout.MIN_DECODE_TOKENS)
    assert shapes() == ((2, 1), (4, 1), (8, 1))
    assert shapes(**SPEC) == ((1, D), (2, D), (4, D), (8, D))
    # bucket 4 holds batches of 3 (speculating) and of 4 (not)
    limited = shapes(**SPEC, speculative_disable_by_batch_size=3)
    assert limited == ((1, D), (2, D), (4, D), (4, 1), (8, 1))


@pytest.mark.parametrize(("spec", "rows"), [({}, 2), (SPEC, 1)])
def test_a_decode_step_runs_at_least_two_tokens(spec, rows):
    """A decode batch of one request runs two rows at D = 1 (a one-token step's
    projections would be vector-matrix dots, see ``layout.MIN_DECODE_TOKENS``) and one
    row at D = 4; the warm-up's shapes are those the batches take."""
    config = EngineConfig(max_running_requests=8, **spec)
    layout = plan_memory(config, tiny_model("qwen3_next").config)
    batch = build_decode(layout, [])
    assert batch.req_row.shape == (rows,)
    assert (rows, batch.num_verify) == layout.decode_shapes[0]


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_the_limit_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
        EngineConfig(**SPEC, speculative_disable_by_batch_size=value)


def test_the_limit_needs_speculation():
    with pytest.raises(ValueError, match="speculative_algorithm is None"):
        EngineConfig(speculative_disable_by_batch_size=4)
