"""min_new_tokens and logit_bias end to end: greedy engine outputs (with and without NEXTN,
overlap on) equal a cache-free reference that applies the same processing to the oracle's
logits step by step; and the boundary validation of the new fields."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.engine.engine import Engine
from lazyspec.scheduler.request import SamplingParams
from lazyspec.server.protocol import ApiError, Limits, parse_completion, parse_generate
from lazyspec.testing.tiny_models import _logits_at, tiny_model

EOS = 2  # the tiny models' eos_token_id


def reference_processed_greedy(
    model, prompt: list[int], num_new: int, stop_ids, min_new: int, bias: dict[int, float]
) -> list[int]:
    """Greedy by full recompute, on the oracle's logits + bias, with EOS / stop ids at -inf
    while fewer than ``min_new`` tokens are out; stops at EOS / a stop id like the engine."""
    ids, out = list(prompt), []
    for _ in range(num_new):
        tokens = np.zeros((1, 256), np.int32)
        tokens[0, : len(ids)] = ids
        logits = _logits_at(
            model.family, model.config, model.params, jnp.asarray(tokens), len(ids) - 1
        )
        logits = np.asarray(logits, np.float32)[0].copy()
        for token, value in bias.items():
            logits[token] += value
        if len(out) < min_new:
            logits[[EOS, *stop_ids]] = -1e30
        token = int(np.argmax(logits))
        out.append(token)
        ids.append(token)
        if token == EOS or token in stop_ids:
            break
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_next")


@pytest.mark.parametrize("spec", [False, True])
def test_greedy_with_bias_and_min_tokens_equals_the_processed_reference(model, spec):
    rng = np.random.default_rng(11)
    prompts = [list(map(int, rng.integers(3, 128, size=n))) for n in (5, 23, 12)]
    first = [reference_processed_greedy(model, p, 1, (), 0, {})[0] for p in prompts]
    # each prompt's plain greedy next tokens become its stop ids, so masking them matters
    cases = [
        dict(stop_token_ids=[first[0]], min_new_tokens=4),
        dict(logit_bias={7: 100.0}),
        dict(stop_token_ids=[first[2]], min_new_tokens=3, logit_bias={first[2]: 3.0, 9: -5.0}),
    ]
    engine = Engine(
        model=model,
        disable_overlap_schedule=False,
        mamba_chunk_size=16,
        chunked_prefill_size=64,
        max_running_requests=4,
        max_total_tokens=4096,
        context_length=256,
        skip_warmup=True,
        **(dict(speculative_algorithm="NEXTN", speculative_num_steps=3) if spec else {}),
    )
    reqs = [
        engine.add_request(input_ids=p, sampling_params={"max_new_tokens": 8, **case})
        for p, case in zip(prompts, cases)
    ]
    engine.run_until_done(reqs)
    for req, p, case in zip(reqs, prompts, cases):
        want = reference_processed_greedy(
            model,
            p,
            8,
            tuple(case.get("stop_token_ids", ())),
            case.get("min_new_tokens", 0),
            case.get("logit_bias", {}),
        )
        assert req.output_ids == want, (case, req.output_ids, want)
    assert len(reqs[0].output_ids) >= 4  # EOS / the stop id suppressed for 4 tokens
    assert reqs[1].output_ids == [7] * 8  # +100 forces the token


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
    ]:
        with pytest.raises(ValueError, match=None) as err:
            SamplingParams.from_dict(bad)
        assert words in str(err.value)
