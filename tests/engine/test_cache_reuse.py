"""Turn 2 of a conversation hits the checkpoint the rules predict, and the output and
logprobs equal those after a cache flush; forced spare-allocation failure changes only
which checkpoint is cached; warm-up compiles every program of the table and serving
compiles nothing new after it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from lazyspec.engine.engine import Engine
from lazyspec.testing.char_tokenizer import char_tokenizer
from lazyspec.testing.compiles import backend_compiles
from lazyspec.testing.tiny_models import tiny_model

INTERVAL = 64


def _engine(strategy: str, overlap: bool = True, **kw) -> Engine:
    return Engine(
        model=kw.pop("model", None) or tiny_model(),
        mamba_scheduler_strategy=strategy,
        disable_overlap_schedule=not overlap,
        mamba_track_interval=INTERVAL,
        chunked_prefill_size=128,
        max_running_requests=4,
        max_total_tokens=8192,
        context_length=512,
        skip_warmup=kw.pop("skip_warmup", True),
        **kw,
    )


def _turns(engine: Engine, prompt: list[int], num_new: int, extra: list[int]):
    params = {"max_new_tokens": num_new, "ignore_eos": True}
    first = engine.generate(input_ids=prompt, sampling_params=params)
    turn2 = prompt + first["output_ids"] + extra
    hit = engine.generate(input_ids=turn2, sampling_params=params, return_logprob=True)
    assert engine.flush_cache()
    miss = engine.generate(input_ids=turn2, sampling_params=params, return_logprob=True)
    return first, hit, miss


@pytest.mark.parametrize(
    "strategy,fail,expected_hit",
    [
        ("extra_buffer", False, 128),
        ("extra_buffer_lazy", False, 128),
        ("extra_buffer_lazy", True, 128),  # crossing at 128 settled in place while running
        ("no_buffer", False, 100 + 59),  # the working slot at the exact final length
    ],
)
@pytest.mark.parametrize("policy", ["sglang", "value"])
def test_turn2_hits_expected_checkpoint(strategy, fail, expected_hit, policy):
    rng = np.random.default_rng(1)
    prompt = list(rng.integers(3, 128, size=100))
    extra = list(rng.integers(3, 128, size=9))
    engine = _engine(strategy, debug_fail_spare_alloc=fail, mamba_cache_policy=policy)
    first, hit, miss = _turns(engine, prompt, 60, extra)
    assert hit["meta_info"]["cached_tokens"] == expected_hit
    assert miss["meta_info"]["cached_tokens"] == 0
    assert hit["output_ids"] == miss["output_ids"]
    lp_hit = np.array([lp for lp, _ in hit["meta_info"]["output_token_logprobs"]])
    lp_miss = np.array([lp for lp, _ in miss["meta_info"]["output_token_logprobs"]])
    assert np.max(np.abs(lp_hit - lp_miss)) <= 1e-4
    if fail:
        assert engine.policy.num_spare_failures > 0
    engine.check_integrity()


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_running_request_prompt_is_cached_at_prefill_end(strategy):
    """A request extending a still-running request's prompt hits that prompt's prefill-end
    checkpoint: the whole prompt (no_buffer's copy of the final state) or its last point
    on the prefill grid (G = 64 here: 192 of 200), and the output equals a cache-free
    run's."""
    rng = np.random.default_rng(5)
    prompt = list(rng.integers(3, 128, size=200))
    longer = prompt + list(rng.integers(3, 128, size=7))
    engine = _engine(strategy)
    params = {"max_new_tokens": 40, "ignore_eos": True}
    first = engine.add_request(input_ids=prompt, sampling_params=params)
    while not first.output_ids:
        engine.step()
    second = engine.add_request(input_ids=longer, sampling_params={"max_new_tokens": 5})
    while not second.finished:  # run_until_done would also drain first
        engine.step()
    assert not first.finished
    assert second.cached_tokens == (200 if strategy == "no_buffer" else 192)
    engine.run_until_done([first])
    engine.check_integrity()
    assert engine.flush_cache()
    again = engine.generate(input_ids=longer, sampling_params={"max_new_tokens": 5})
    assert again["meta_info"]["cached_tokens"] == 0
    assert again["output_ids"] == second.output_ids


@pytest.mark.parametrize("finish_offset,expected_hit", [(-2, 64), (-1, 64), (0, 64), (1, 128)])
def test_forced_failure_changes_checkpoint_not_output(finish_offset, expected_hit):
    """Finishing around the 128 boundary (D = 1): a crossing in the finishing step is never
    promoted, and with every spare allocation failing an in-flight step inside the window
    may write the keep slot in place, so the insert is skipped; either way only the
    in-prompt checkpoint (64, inserted at prefill end) serves turn 2. A crossing settled
    one step before the finish (+1) is cached (128) with and without free slots."""
    rng = np.random.default_rng(2)
    prompt = list(rng.integers(3, 128, size=100))
    extra = list(rng.integers(3, 128, size=5))
    num_new = 128 - 100 + 1 + finish_offset  # final committed length = 128 + offset
    results = {}
    for fail in (False, True):
        engine = _engine("extra_buffer_lazy", debug_fail_spare_alloc=fail)
        first, hit, miss = _turns(engine, prompt, num_new, extra)
        assert hit["output_ids"] == miss["output_ids"]
        results[fail] = (first["output_ids"], hit["output_ids"], hit["meta_info"]["cached_tokens"])
        engine.check_integrity()
    assert results[False][:2] == results[True][:2]
    assert results[True][2] == expected_hit
    assert results[False][2] == expected_hit


def test_top_logprobs_match_the_reference_distribution():
    model = tiny_model()
    rng = np.random.default_rng(4)
    prompt = list(rng.integers(3, 128, size=30))
    engine = _engine("extra_buffer")
    out = engine.generate(
        input_ids=prompt,
        sampling_params={"max_new_tokens": 3, "ignore_eos": True},
        return_logprob=True,
        top_logprobs_num=3,
    )
    from lazyspec.models import reference_logits

    ids = prompt + out["output_ids"]
    logits = reference_logits(model, ids)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    for i, top in enumerate(out["meta_info"]["output_top_logprobs"]):
        row = logp[len(prompt) - 1 + i]
        want = np.argsort(-row)[:3]
        assert [t for _, t in top] == list(want)
        assert np.allclose([v for v, _ in top], row[want], atol=1e-4)
        assert top[0][1] == out["output_ids"][i]  # greedy picks the most likely token
    with pytest.raises(ValueError, match="top_logprobs_num"):
        engine.generate(
            input_ids=prompt,
            sampling_params={"max_new_tokens": 1},
            return_logprob=True,
            top_logprobs_num=9,
        )


def test_zero_recompiles_after_warmup():
    # a tokenizer, so that grammar requests can be served: their decode steps run split
    model = SimpleNamespace(**{**vars(tiny_model()), "tokenizer": char_tokenizer()})
    engine = _engine("extra_buffer_lazy", skip_warmup=False, model=model)
    # warm-up compiled every program of the table: compiling each ahead of a call finds it
    with backend_compiles() as seen:
        for program in engine.runner.program_table():
            program.compile()
    assert not seen
    compiled = engine.runner.num_compiled()
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(3, 128, size=int(n))) for n in rng.integers(5, 300, size=6)]
    # every other request with penalties: its row's token counts are seeded before its step;
    # the last one under a regex, its steps split in two programs, its masks written between
    params = [
        {"max_new_tokens": 8, "ignore_eos": True, "frequency_penalty": 0.5 * (i % 2)}
        for i in range(len(prompts))
    ]
    params[-1] = {"max_new_tokens": 8, "regex": "[a-f]{20}"}
    forwards = []
    launch_forward = engine.runner.launch_forward
    engine.runner.launch_forward = lambda *args: (forwards.append(1), launch_forward(*args))[1]
    engine.generate(input_ids=prompts, sampling_params=params)
    assert forwards  # the split programs served
    # one short request: the smallest extend bucket, the very first program warm-up ran
    # (with the freshly allocated pools; serving calls it with pools a step returned)
    engine.generate(input_ids=prompts[0][:5], sampling_params={"max_new_tokens": 2})
    assert engine.runner.num_compiled() == compiled
