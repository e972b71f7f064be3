"""K decode steps per program (``num_continuous_decode_steps``): one launch runs K one-token
steps back to back, and the host settles them as one K-position step.

Greedy outputs stay those of the cache-free reference for K = 2 and 3 under every strategy,
overlap on and off, with requests ending inside a program's run and checkpoint boundaries
crossed at every step of it; every state slot of the tree equals a recompute of its prefix
after every step (the prefix reuse round included). Sampled rows (seeds, penalties, bias,
min tokens, top logprobs) draw the tokens and logprobs of one-step programs; grammar rows
take one-token steps and keep their tokens; warm-up compiles every program serving then
needs; the flag refuses what it cannot run.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

from lazyspec.config import EngineConfig
from lazyspec.engine.engine import Engine
from lazyspec.scheduler.layout import plan_memory
from lazyspec.server.launch import build_parser
from lazyspec.testing.char_tokenizer import char_tokenizer
from lazyspec.testing.state_oracle import TreeStateOracle
from lazyspec.testing.tiny_models import (
    reference_greedy,
    serve_greedy_lengths,
    small_engine,
    tiny_model,
)

INTERVAL = 16


def _engine(model, steps: int, strategy: str = "extra_buffer", overlap: bool = True, **kw):
    kw.setdefault("mamba_track_interval", INTERVAL)
    return small_engine(model, strategy, overlap, num_continuous_decode_steps=steps, **kw)


@pytest.fixture(scope="module")
def greedy_case():
    model = tiny_model("qwen3_next")
    rng = np.random.default_rng(7)
    prompt = list(map(int, rng.integers(3, 128, size=37)))
    return model, prompt, reference_greedy(model, prompt, 60, pad_len=256)[0]


# cached: the prefix the second round's 67 tokens match. The tracking strategies keep the
# boundary 64, crossed inside some program's run. no_buffer keeps no decode checkpoints, only
# a finished request's working state, and only where it covers no token past the request's
# end: at K = 3 the 57- and 96-token requests end one step into a run, so the best match is
# the prompt's own checkpoint (37)
@pytest.mark.parametrize(
    "steps,strategy,overlap,cached",
    [
        (2, "extra_buffer", True, 64),
        (3, "extra_buffer_lazy", True, 64),
        (2, "extra_buffer_lazy", False, 64),
        (3, "no_buffer", False, 37),
    ],
)
def test_greedy_outputs_and_tree_states_are_exact(greedy_case, steps, strategy, overlap, cached):
    model, prompt, greedy = greedy_case
    engine = _engine(model, steps, strategy, overlap)
    oracle = TreeStateOracle(engine)
    # lengths of every residue mod K: requests end at each step of a program's run
    lengths = (20, 45, 59, 60)
    reqs = serve_greedy_lengths(engine, prompt, lengths, check=oracle)
    assert [r.output_ids for r in reqs] == [greedy[:n] for n in lengths]
    # a second round resumes from the checkpoints the first one left in the tree
    again = engine.add_request(
        input_ids=prompt + greedy[:30], sampling_params={"max_new_tokens": 25, "ignore_eos": True}
    )
    engine.run_until_done([again], check=oracle)
    assert again.output_ids == greedy[30:55]
    assert again.cached_tokens == cached
    assert oracle.num_checked > 0
    # a K-step program is K steps of one token: the accept statistics stay those of an
    # engine without speculation, counting the tokens the requests kept
    info = engine.get_server_info()
    assert info["avg_accept_length"] == 1.0
    assert info["num_verify_steps"] == sum(lengths) + 25 - 5  # each prefill samples one
    assert engine.flush_cache()
    assert engine.slot_allocator.num_free == engine.layout.num_slots


SAMPLED = [
    {"temperature": 0.8, "seed": 11, "frequency_penalty": 0.6, "presence_penalty": 0.3},
    {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.3},
    {"temperature": 0.0, "logit_bias": {"5": 4.0}, "min_new_tokens": 15, "stop_token_ids": [7]},
    {"temperature": 0.7, "seed": 3, "min_new_tokens": 4, "stop_token_ids": [9, 12]},
]


def test_sampled_rows_draw_the_tokens_of_one_step_programs(greedy_case):
    model, prompt, _ = greedy_case

    def serve(steps):
        engine = _engine(model, steps, "extra_buffer_lazy")
        reqs = [
            engine.add_request(
                input_ids=prompt[: 20 + 5 * i],
                sampling_params={"max_new_tokens": 23, **params},
                return_logprob=True,
            )
            for i, params in enumerate(SAMPLED)
        ]
        engine.run_until_done(reqs, check=Engine.check_integrity)
        return reqs

    one, three = serve(1), serve(3)
    assert [r.output_ids for r in three] == [r.output_ids for r in one]
    for a, b in zip(three, one):
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, rtol=1e-5, atol=1e-5)
        assert [[t for _, t in top] for top in a.output_top_logprobs] == [
            [t for _, t in top] for top in b.output_top_logprobs
        ]
    assert len({len(r.output_ids) for r in one}) > 1  # stop tokens ended some early


@pytest.fixture(scope="module")
def char_model():
    base = tiny_model("qwen3_next")
    return SimpleNamespace(**{**vars(base), "tokenizer": char_tokenizer()})


@pytest.mark.parametrize("overlap", [True, False])
def test_grammar_rows_take_one_token_steps(char_model, overlap):
    """A JSON row, a regex row and free rows under K = 2: a batch with a grammar row runs
    one-token steps (the masks follow each token on the host), the free rows' batches K-step
    programs; the tokens are those of K = 1, the outputs parse, and after the warm-up
    serving compiles nothing."""
    from tests.engine.test_structured_output import REGEX, SCHEMA  # needs the grammar extras

    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(3, 128, size=n))) for n in (7, 40, 19, 23)]
    extras = [
        {"json_schema": json.dumps(SCHEMA)},
        {"regex": REGEX},
        {"ignore_eos": True, "max_new_tokens": 10},
        {"ignore_eos": True, "max_new_tokens": 31},
    ]
    requests = [(p, {"max_new_tokens": 40, **x}) for p, x in zip(prompts, extras)]

    def serve(steps, warm):
        engine = _engine(
            char_model, steps, overlap=overlap, skip_warmup=not warm, chunked_prefill_size=16
        )
        compiled = engine.num_compiled()
        reqs = [engine.add_request(input_ids=ids, sampling_params=p) for ids, p in requests]
        engine.run_until_done(reqs, check=Engine.check_integrity)
        return reqs, engine.num_compiled() - compiled

    stepped, new_compiles = serve(2, warm=True)
    single, _ = serve(1, warm=False)
    assert [r.output_ids for r in stepped] == [r.output_ids for r in single]
    assert new_compiles == 0
    text = [char_model.tokenizer.decode(r.output_ids) for r in stepped]
    json.loads(text[0])
    assert re.fullmatch(REGEX, text[1]), text[1]


def test_layout_plans_k_positions_a_step():
    model_cfg = tiny_model("qwen3_next").config
    layout = plan_memory(
        EngineConfig(max_running_requests=4, num_continuous_decode_steps=3), model_cfg
    )
    # one request still runs two rows: each of the K passes is a one-token-per-row forward
    assert layout.decode_shapes == ((2, 3), (4, 3))
    assert layout.decode_positions == 3 and layout.run_past_headroom == 9
    plain = plan_memory(EngineConfig(max_running_requests=4), model_cfg)
    assert plain.decode_shapes == ((2, 1), (4, 1)) and plain.run_past_headroom == 3


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"num_continuous_decode_steps": 0}, "positive integer"),
        ({"num_continuous_decode_steps": 2, "speculative_algorithm": "NEXTN"}, "speculative"),
        ({"num_continuous_decode_steps": 9, "mamba_track_interval": 16}, "2 \\* tokens per"),
    ],
)
def test_the_flag_refuses_what_it_cannot_run(kw, match):
    kw.setdefault("mamba_chunk_size", 16)
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_an_unset_flag_is_two_steps_on_a_gpu_without_speculation():
    unset = EngineConfig()
    assert unset.decode_steps == 1  # until a platform resolves it
    assert unset.for_platform("gpu").num_continuous_decode_steps == 2
    assert unset.for_platform("cpu").num_continuous_decode_steps == 1
    assert unset.for_platform("tpu").num_continuous_decode_steps == 1
    spec = EngineConfig(speculative_algorithm="NEXTN")
    assert spec.for_platform("gpu").num_continuous_decode_steps == 1
    chosen = EngineConfig(num_continuous_decode_steps=3)
    assert chosen.for_platform("gpu").num_continuous_decode_steps == 3
    # the prefill step's token budget: SGLang's large-GPU chunk, or four chunks on CPU
    assert unset.for_platform("gpu").max_prefill_tokens == 8192
    assert unset.for_platform("cpu").max_prefill_tokens == 4 * unset.chunked_prefill_size
    assert EngineConfig(max_prefill_tokens=100).for_platform("tpu").max_prefill_tokens == 100


def test_serve_has_the_flag():
    args = build_parser().parse_args(["--num-continuous-decode-steps", "4"])
    assert args.num_continuous_decode_steps == 4


def test_a_greedy_batch_computes_no_logprobs_nobody_asked_for(greedy_case):
    """A greedy request that asks for no logprobs, alone, decodes in ``DecodeBatch.greedy`` steps,
    which take the argmax alone: its tokens are the reference's, and its decode steps'
    logprobs are not computed (zeros; the first token's, from the prefill, is), nor its
    output counts. Asked for, the same request's logprobs are the log-softmax's
    (negative)."""
    model, prompt, want = greedy_case
    engine = _engine(model, 1)
    params = {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}
    counts = lambda: np.asarray(engine.runner.pools.output_counts).sum(axis=1)  # noqa: E731
    plain = engine.add_request(input_ids=prompt, sampling_params=params)
    engine.run_until_done([plain], check=Engine.check_integrity)  # alone: a greedy batch
    after_plain = counts()
    asked = engine.add_request(input_ids=prompt, sampling_params=params, return_logprob=True)
    engine.run_until_done([asked], check=Engine.check_integrity)
    assert plain.output_ids == asked.output_ids == list(want[:9])
    assert plain.output_logprobs[0] < 0 and plain.output_logprobs[1:] == [0.0] * 8
    assert all(lp < 0 for lp in asked.output_logprobs)
    # nor the penalties' output counts (no row of the batch has a penalty): only the
    # prefill's token is counted; the general step counts every token (and the overlapped
    # loop's one step past the last)
    assert after_plain.sum() == 1 and (counts() - after_plain).sum() >= 9
