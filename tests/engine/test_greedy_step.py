"""Decode steps whose rows all take the argmax of the raw logits (``DecodeBatch.greedy``).

Such a step verifies and samples with ``greedy_verify`` and skips the other sampling stages
(a GPU would wait on the host for a ``lax.cond`` skipping them). It must emit what the
general step emits for greedy rows, at every accept length; a request that changes its
logits or asks for top logprobs must keep the general step; an engine serving greedy and
sampled requests together and apart must take both programs and give each request the
tokens it gets alone (greedy ones: the cache-free reference); and warm-up compiles both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.engine.engine import Engine
from lazyspec.engine.sampling import greedy_verify, verify_and_sample
from lazyspec.scheduler.batch import DecodeBatch, greedy_decodable, sampling_row
from lazyspec.scheduler.request import Req, SamplingParams
from lazyspec.testing.tiny_models import reference_greedy, small_engine, tiny_model
from tests.engine.test_sampling import sampling_arrays


@pytest.mark.parametrize("num_pos", [1, 2, 4])
def test_greedy_verify_is_the_general_verify_of_greedy_rows(num_pos):
    rng = np.random.default_rng(num_pos)
    rows, vocab = 256, 24
    # logits on a coarse grid: ties in the argmax occur (both forms take the first)
    logits = np.round(rng.normal(size=(rows, num_pos, vocab)), 1).astype(np.float32)
    target = np.argmax(logits, axis=-1)
    # each draft is the target's argmax with probability 0.6, some are no draft (-1)
    drafts = np.where(
        rng.random((rows, num_pos - 1)) < 0.6,
        target[:, : num_pos - 1],
        rng.integers(0, vocab, size=(rows, num_pos - 1)),
    )
    drafts = np.where(rng.random(drafts.shape) < 0.1, -1, drafts).astype(np.int32)
    positions = jnp.asarray(100 + np.arange(num_pos)[None, :] + np.arange(rows)[:, None])
    general = jax.jit(verify_and_sample)(
        jnp.asarray(logits), jnp.asarray(drafts), positions, sampling_arrays(rows, 0.0)
    )
    greedy = jax.jit(greedy_verify)(jnp.asarray(logits), jnp.asarray(drafts))
    np.testing.assert_array_equal(np.asarray(greedy[0]), np.asarray(general[0]))
    np.testing.assert_array_equal(np.asarray(greedy[1]), np.asarray(general[1]))
    assert set(np.asarray(greedy[1]).tolist()) == set(range(1, num_pos + 1))


def _req(return_logprob: bool = False, grammar=None, **params) -> Req:
    req = Req("r", [5, 6, 7], SamplingParams(**params), return_logprob=return_logprob)
    req.grammar = grammar
    req.sampling_row = sampling_row(req, eos_ids=(1,))
    return req


@pytest.mark.parametrize(
    "change",
    [
        dict(temperature=0.7),
        dict(frequency_penalty=0.5),
        dict(presence_penalty=0.5),
        dict(repetition_penalty=1.2),
        dict(logit_bias=((9, 2.0),)),
        dict(min_new_tokens=4),
        dict(grammar=object()),
        dict(return_logprob=True),
    ],
    ids=lambda change: next(iter(change)),
)
def test_a_request_that_changes_its_logits_takes_the_general_step(change):
    assert greedy_decodable(_req(temperature=0.0, top_p=0.5, top_k=3))  # filters: no change
    assert not greedy_decodable(_req(**{"temperature": 0.0, **change}))


def _engine(model, overlap: bool, spec: bool, **kw) -> Engine:
    return small_engine(model, "auto", overlap, spec, **{"max_running_requests": 2, **kw})


@pytest.fixture(scope="module")
def case():
    model = tiny_model("qwen3_next")
    rng = np.random.default_rng(11)
    prompts = [list(map(int, rng.integers(3, 128, size=n))) for n in (29, 35)]
    greedy = reference_greedy(model, prompts[0], 40, pad_len=256)[0]
    return model, prompts, greedy


GREEDY = {"max_new_tokens": 40, "ignore_eos": True}
SAMPLED = {"max_new_tokens": 12, "temperature": 0.8, "seed": 3, "ignore_eos": True}


def _serve_both(engine: Engine, prompts) -> list:
    """Serve a greedy and a sampled request together (the sampled one ends first, so the
    greedy one then decodes alone); checks that decode steps of both forms ran."""
    forms, launch = [], engine.runner.launch

    def recording(batch, *args, **kw):
        if isinstance(batch, DecodeBatch):
            forms.append(batch.greedy)
        return launch(batch, *args, **kw)

    engine.runner.launch = recording
    reqs = [
        engine.add_request(input_ids=prompts[0], sampling_params=GREEDY),
        engine.add_request(input_ids=prompts[1], sampling_params=SAMPLED),
    ]
    engine.run_until_done(reqs)
    assert True in forms and False in forms
    return reqs


@pytest.mark.parametrize("overlap,spec", [(True, False), (False, True)])
def test_greedy_and_sampled_requests_keep_their_tokens(case, overlap, spec):
    model, prompts, greedy = case
    both = _serve_both(_engine(model, overlap, spec), prompts)
    assert both[0].output_ids == greedy
    alone = _engine(model, overlap, spec)
    sampled = alone.add_request(input_ids=prompts[1], sampling_params=SAMPLED)
    alone.run_until_done([sampled])
    assert both[1].output_ids == sampled.output_ids


def test_warmup_compiles_both_forms(case):
    model, prompts, greedy = case
    # pools of a size of their own: no program compiled by the tests above can stand in
    # for one the warm-up missed
    engine = _engine(model, True, False, skip_warmup=False, max_total_tokens=2048)
    compiled = engine.num_compiled()
    _serve_both(engine, prompts)
    assert engine.num_compiled() == compiled
