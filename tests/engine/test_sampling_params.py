"""min_new_tokens, logit_bias and the frequency / presence / repetition penalties end to
end: greedy engine outputs (with and without NEXTN, overlap on) equal a cache-free reference
that applies the same processing to the oracle's logits step by step; and the boundary
validation of the new fields."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.config import EngineConfig
from lazyspec.scheduler.request import SamplingParams
from lazyspec.server.limits import ApiError, Limits
from lazyspec.server.protocol import parse_completion, parse_generate
from lazyspec.testing.tiny_models import reference_processed_greedy, small_engine, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_next")


def _plain_next(model, prompt: list[int]) -> int:
    return reference_processed_greedy(model, prompt, SamplingParams(max_new_tokens=1))[0]


@pytest.fixture(scope="module")
def processed_case(model):
    """Six requests and their cache-free processed outputs: bias, min_new_tokens, and
    penalties that change the greedy output (checked against the unpenalized reference)."""
    rng = np.random.default_rng(11)
    prompts = [list(map(int, rng.integers(3, 128, size=n))) for n in (5, 23, 12, 40, 9)]
    prompts.append(prompts[3][:32] + list(map(int, rng.integers(3, 128, size=6))))
    first = [_plain_next(model, p) for p in prompts[:3]]
    # each prompt's plain greedy next tokens become its stop ids, so masking them matters
    penalties = dict(max_new_tokens=12, ignore_eos=True)
    cases = [
        dict(stop_token_ids=[first[0]], min_new_tokens=4),
        dict(logit_bias={7: 100.0}),
        dict(stop_token_ids=[first[2]], min_new_tokens=3, logit_bias={first[2]: 3.0, 9: -5.0}),
        dict(frequency_penalty=1.5, presence_penalty=0.5, **penalties),
        dict(presence_penalty=-1.0, repetition_penalty=0.5, **penalties),
        dict(repetition_penalty=1.8, frequency_penalty=0.4, **penalties),
    ]
    sampling = [SamplingParams.from_dict({"max_new_tokens": 8, **case}) for case in cases]
    want = [reference_processed_greedy(model, p, s) for p, s in zip(prompts, sampling)]
    for prompt, params, out in zip(prompts, sampling, want):
        if params.has_penalties:
            plain = dataclasses.replace(
                params, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0
            )
            assert reference_processed_greedy(model, prompt, plain) != out, params
    return prompts, sampling, want


def _engine(model, **settings):
    """``small_engine`` with the config's own checkpoint strategy and track interval."""
    strategy = EngineConfig.mamba_scheduler_strategy
    interval = EngineConfig.mamba_track_interval
    return small_engine(model, strategy, mamba_track_interval=interval, **settings)


@pytest.mark.parametrize("spec", [False, True])
def test_greedy_with_processed_logits_equals_the_processed_reference(model, processed_case, spec):
    """Six requests over four rows: the last two wait for rows that others used (their
    token counts must be reset), and the last shares a 32-token prefix with the fourth (the
    cached part must still count as prompt for the repetition penalty)."""
    prompts, sampling, want = processed_case
    engine = _engine(
        model, **(dict(speculative_algorithm="NEXTN", speculative_num_steps=3) if spec else {})
    )
    reqs = [engine.add_request(input_ids=p, sampling_params=s) for p, s in zip(prompts, sampling)]
    engine.run_until_done(reqs)
    for req, params, out in zip(reqs, sampling, want):
        assert req.output_ids == out, (params, req.output_ids, out)
    assert len(reqs[0].output_ids) >= 4  # EOS / the stop id suppressed for 4 tokens
    assert reqs[1].output_ids == [7] * 8  # +100 forces the token
    assert reqs[5].cached_tokens == 32


@functools.partial(jax.jit, static_argnums=(0, 1))
def _all_logprobs(family, cfg, params, tokens):
    hidden = family.reference_forward(params, cfg, tokens)
    return jax.nn.log_softmax(family.compute_logits(params, cfg, hidden), axis=-1)


def _oracle_logprobs(model, ids: list[int]) -> np.ndarray:
    """log softmax of the cache-free oracle's logits at every position of ``ids``."""
    tokens = jnp.asarray([ids], jnp.int32)
    return np.asarray(_all_logprobs(model.family, model.config, model.params, tokens))[0]


def test_prompt_logprobs_equal_the_oracle_across_chunks_and_a_cached_prefix(model):
    """A 70-token prompt (two prefill chunks, a checkpoint at 64) with every prompt logprob,
    then one sharing its first 68 tokens asking from token 60 on (it may not match the
    checkpoint at 64: those positions must be computed) and from token 66 on (it does);
    every logprob equals the cache-free oracle's."""
    engine = _engine(model)
    rng = np.random.default_rng(12)
    first = [int(t) for t in rng.integers(3, 128, size=70)]
    second = first[:68] + [int(t) for t in rng.integers(3, 128, size=20)]
    cases = ((first, 0), (second, 60), (second, 66))
    results = [
        engine.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": 2},
            logprob_start_len=start,
            top_logprobs_num=2,
        )
        for ids, start in cases
    ]
    assert [r["meta_info"]["cached_tokens"] for r in results] == [0, 0, 64]
    for (ids, start), result in zip(cases, results):
        pairs = result["meta_info"]["input_token_logprobs"]
        assert [t for _, t in pairs] == ids[start:]
        assert (pairs[0][0] is None) == (start == 0)
        oracle = _oracle_logprobs(model, ids)
        begin = max(start, 1)
        want = [oracle[j - 1, ids[j]] for j in range(begin, len(ids))]
        got = [lp for lp, _ in pairs[begin - start :]]
        np.testing.assert_allclose(got, want, atol=2e-4)
        tops = result["meta_info"]["input_top_logprobs"][begin - start :]
        assert [top[0][1] for top in tops] == [
            int(np.argmax(oracle[j - 1])) for j in range(begin, len(ids))
        ]


LIMITS = Limits(vocab_size=256, max_context=128, model_names=("m",))


def _generate(**params):
    return parse_generate({"input_ids": [5, 6], "sampling_params": params}, None, LIMITS)


def _completion(**body):
    return parse_completion({"prompt": [5, 6], "max_tokens": 10, **body}, None, LIMITS)


def test_parsers_carry_min_tokens_and_logit_bias():
    spec = _generate(max_new_tokens=9, min_new_tokens=3, logit_bias={"4": -2, "7": 1.5})
    assert spec.sampling[0].min_new_tokens == 3
    assert spec.sampling[0].logit_bias == ((4, -2.0), (7, 1.5))
    spec = _completion(min_tokens=10, logit_bias={"12": 100})
    assert (spec.sampling[0].min_new_tokens, spec.sampling[0].logit_bias) == (10, ((12, 100.0),))


def test_parsers_carry_the_penalties():
    spec = _generate(
        max_new_tokens=9, frequency_penalty=0.5, presence_penalty=-2, repetition_penalty=1.3
    )
    params = spec.sampling[0]
    assert (params.frequency_penalty, params.presence_penalty) == (0.5, -2.0)
    assert params.repetition_penalty == 1.3 and params.has_penalties
    params = _completion(frequency_penalty=2, presence_penalty=0.25).sampling[0]
    assert (params.frequency_penalty, params.presence_penalty) == (2.0, 0.25)
    assert params.repetition_penalty == 1.0
    assert not _completion().sampling[0].has_penalties


@pytest.mark.parametrize(
    "parse, body, words",
    [
        (_generate, dict(max_new_tokens=4, min_new_tokens=5), "min_new_tokens=5 must be <="),
        (_generate, dict(min_new_tokens=-1), "must be in [0,"),
        (_completion, dict(min_tokens=11), "min_tokens=11 must be <= max_tokens"),
        (_completion, dict(logit_bias={"300": 1}), "not a token id in [0, 256)"),
        (_completion, dict(logit_bias={"x": 1}), "not a token id"),
        (_completion, dict(logit_bias={"3": 101}), "must be a number in [-100.0, 100.0]"),
        (_completion, dict(logit_bias=[1]), "must map token ids"),
        (_completion, dict(logit_bias={str(i): 1 for i in range(17)}), "at most 16"),
        (
            _completion,
            dict(frequency_penalty=2.01),
            "frequency_penalty=2.01 must be in [-2.0, 2.0]",
        ),
        (_completion, dict(presence_penalty=-2.5), "presence_penalty=-2.5 must be in [-2.0, 2.0]"),
        (_completion, dict(presence_penalty="x"), "presence_penalty='x' must be a finite number"),
        (_generate, dict(repetition_penalty=0), "repetition_penalty=0.0 must be in [0.01, 2.0]"),
        (_generate, dict(repetition_penalty=3), "repetition_penalty=3.0 must be in [0.01, 2.0]"),
    ],
)
def test_parsers_refuse_out_of_range_values(parse, body, words):
    with pytest.raises(ApiError) as err:
        parse(**body)
    assert words in str(err.value), str(err.value)


def test_sampling_params_validation():
    params = SamplingParams.from_dict({"min_new_tokens": 2, "logit_bias": {3: 1.0}})
    assert params.logit_bias == ((3, 1.0),)
    for bad, words in [
        ({"max_new_tokens": 2, "min_new_tokens": 3}, "min_new_tokens=3"),
        ({"logit_bias": {3: 200.0}}, "logit_bias[3]=200.0"),
        ({"logit_bias": {-1: 1.0}}, "outside the vocabulary"),
        ({"min_new_tokens": 1, "stop_token_ids": list(range(17))}, "at most 16"),
        ({"frequency_penalty": -2.5}, "frequency_penalty=-2.5 must be a number in [-2.0, 2.0]"),
        ({"presence_penalty": True}, "presence_penalty=True must be a number"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0 must be a number in (0, 2.0]"),
    ]:
        with pytest.raises(ValueError, match=None) as err:
            SamplingParams.from_dict(bad)
        assert words in str(err.value)
