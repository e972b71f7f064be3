"""A speculative token map: each draft is the argmax of the MTP logits over the map's ids
(the draft function against a numpy recompute, untied and tied lm_head), every draft an
engine emits lies in the map, greedy output is unchanged (the cache-free oracle, overlap on
and off; at tp = 2 too, with the reduced head sharded by columns like the lm_head), warm-up
compiles every program serving with a map uses, and an id outside the vocabulary is refused
when the engine is built."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from lazyspec.engine.draft_vocab import DRAFT_VOCAB, build_draft_vocab, draft_argmax
from lazyspec.engine.engine import Engine
from lazyspec.engine.sharding import sharding_plan
from lazyspec.testing.tiny_models import reference_greedy, small_engine, tiny_model
from lazyspec.token_map import draft_token_ids
from tests.engine.device_runs import run_on_cpu_devices

MAP_IDS = [5, 9, 17, 33, 34, 60, 61, 62, 90, 127]  # the tiny models' vocabulary is 128
EOS = 2


def _numpy_mtp_logits(params, cfg, hidden: np.ndarray) -> np.ndarray:
    """``mtp.norm`` (zero-centred RMSNorm) then the lm_head (the embedding when tied)."""
    h = hidden.astype(np.float64)
    h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + cfg.arch.rms_norm_eps)
    h = h * (1.0 + np.asarray(params["mtp"]["norm"], np.float64))
    if "lm_head" in params:
        return h @ np.asarray(params["lm_head"]["weight"], np.float64)
    return h @ np.asarray(params["embed_tokens"], np.float64).T


@pytest.mark.parametrize("tied", [False, True])
def test_draft_is_the_argmax_over_the_map(tied):
    model = tiny_model("qwen3_next")
    cfg, params = model.config, dict(model.params)
    if tied:
        del params["lm_head"]  # the embedding serves as the lm_head
    ids = draft_token_ids(np.array(MAP_IDS), cfg.vocab_size, cfg.eos_token_ids)
    assert len(ids) == 128 and sorted(set(ids.tolist())) == sorted([EOS, *MAP_IDS])
    head = build_draft_vocab(model.family, cfg, params, ids, sharding_plan(cfg, 1))
    assert head.lm_head.shape == (cfg.hidden_size, 128)
    hidden = np.random.default_rng(3).standard_normal((64, cfg.hidden_size)).astype(np.float32)
    got = np.asarray(draft_argmax(model.family, cfg, {**params, DRAFT_VOCAB: head}, hidden))

    logits = _numpy_mtp_logits(params, cfg, hidden)
    in_map = np.array(sorted({EOS, *MAP_IDS}))
    want = in_map[np.argmax(logits[:, in_map], axis=1)]
    assert got.tolist() == want.tolist()
    full = np.asarray(draft_argmax(model.family, cfg, params, hidden))
    assert full.tolist() == np.argmax(logits, axis=1).tolist()  # without a map: all ids
    assert not np.isin(full, in_map).all()  # the map changes drafts here: not vacuous
    # no near-tie decides a row: the second best over the map is clearly below the best
    top2 = np.sort(logits[:, in_map], axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 1e-4


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    model = tiny_model("qwen3_next")
    rng = np.random.default_rng(5)
    shared = list(rng.integers(3, 128, size=30))
    prompts = [shared + list(rng.integers(3, 128, size=int(n))) for n in (4, 21, 9)]
    lengths = [14, 9, 17]
    want = [reference_greedy(model, p, n, pad_len=256)[0] for p, n in zip(prompts, lengths)]
    path = tmp_path_factory.mktemp("map") / "map.json"
    path.write_text(json.dumps(MAP_IDS))
    return model, prompts, lengths, want, str(path)


def _serve(model, prompts, lengths, overlap: bool, token_map: str | None):
    """Greedy outputs and every ``drafts`` row the steps returned (padding rows included)."""
    engine = small_engine(
        model,
        "auto",
        overlap,
        speculative_algorithm="NEXTN",
        speculative_num_steps=3,
        speculative_token_map=token_map,
    )
    drafts = []
    fetch = engine.runner.fetch

    def recording_fetch(outputs):
        host = fetch(outputs)
        drafts.append(host["drafts"].reshape(-1))
        return host

    engine.runner.fetch = recording_fetch
    reqs = [
        engine.add_request(input_ids=p, sampling_params={"max_new_tokens": n, "ignore_eos": True})
        for p, n in zip(prompts, lengths)
    ]
    engine.run_until_done(reqs, check=Engine.check_integrity)
    assert all(r.spec_verify_ct > 0 for r in reqs)
    return [r.output_ids for r in reqs], np.concatenate(drafts), engine


@pytest.mark.parametrize("overlap", [True, False])
def test_map_keeps_greedy_output_and_drafts_lie_in_it(case, overlap):
    model, prompts, lengths, want, path = case
    outputs, drafts, engine = _serve(model, prompts, lengths, overlap, path)
    assert outputs == want
    assert drafts.size > 0 and set(drafts.tolist()) <= {EOS, *MAP_IDS}
    assert isinstance(engine.runner.params[DRAFT_VOCAB].lm_head, jax.Array)


def test_without_a_map_drafts_leave_the_map(case):
    """The contrast that makes the test above bite: the full-vocabulary head drafts ids
    outside the map on this workload, with the same greedy output."""
    model, prompts, lengths, want, _ = case
    outputs, drafts, engine = _serve(model, prompts, lengths, True, None)
    assert outputs == want
    assert not set(drafts.tolist()) <= {EOS, *MAP_IDS}
    assert DRAFT_VOCAB not in engine.runner.params


def test_warmup_compiles_every_program_the_map_needs(case):
    """The reduced head is part of the params warm-up compiles with: serving after warm-up
    compiles nothing new."""
    model, prompts, _, want, path = case
    engine = Engine(
        model=model,
        speculative_algorithm="NEXTN",
        speculative_token_map=path,
        mamba_track_interval=16,
        mamba_chunk_size=16,
        chunked_prefill_size=16,  # one extend length bucket: the map is in every program
        max_running_requests=2,
        max_total_tokens=2048,
        context_length=128,
    )
    compiled = engine.runner.num_compiled()
    assert compiled > 0
    out = engine.generate(
        input_ids=prompts[:2], sampling_params={"max_new_tokens": 6, "ignore_eos": True}
    )
    assert [o["output_ids"] for o in out] == [w[:6] for w in want[:2]]
    assert engine.runner.num_compiled() == compiled


def test_id_outside_the_vocabulary_is_refused(tmp_path):
    path = tmp_path / "map.txt"
    path.write_text("3\n4\n128\n")
    with pytest.raises(ValueError, match="token id 128 is outside the model's vocabulary"):
        Engine(
            model=tiny_model("qwen3_next"),
            speculative_algorithm="NEXTN",
            speculative_token_map=str(path),
            max_total_tokens=1024,
            context_length=128,
            skip_warmup=True,
        )


TP2_RUN = """
import json, sys
import numpy as np
from lazyspec.testing.tiny_models import reference_greedy, small_engine, tiny_model

model = tiny_model("qwen3_next")
prompts = json.loads(sys.argv[2])
engine = small_engine(
    model, "auto", spec=True, tp_size=2, speculative_token_map=sys.argv[1],
    max_running_requests=2,
)
drafts, fetch = [], engine.runner.fetch
engine.runner.fetch = lambda out: drafts.append(fetch(out)) or drafts[-1]
params = {"max_new_tokens": 10, "ignore_eos": True}
reqs = [engine.add_request(input_ids=p, sampling_params=params) for p in prompts]
engine.run_until_done(reqs)
head = engine.runner.params["draft_vocab"]
print(json.dumps({
    "same": [r.output_ids == reference_greedy(model, p, 10, pad_len=256)[0]
             for r, p in zip(reqs, prompts)],
    "drafts": sorted({int(d) for out in drafts for d in out["drafts"].ravel()}),
    "lm_head_spec": list(head.lm_head.sharding.spec),
    "ids_spec": list(head.token_ids.sharding.spec),
}))
"""


def test_tensor_parallel_map_is_sharded_by_columns_and_exact(case):
    """tp = 2 over two fake CPU devices (its own process: the device count is fixed when
    jax is first imported): the reduced head's K columns are split over tp as the rule table
    splits the lm_head's, the ids replicated; two requests in one batch stay exact and draft
    only map ids."""
    _, prompts, _, _, path = case
    args = [path, json.dumps([[int(t) for t in p] for p in prompts[:2]])]
    report = run_on_cpu_devices(["-c", TP2_RUN, *args], 2, 600)
    assert report["same"] == [True, True]
    assert report["lm_head_spec"] == [None, "tp"]
    assert report["ids_spec"] in ([], [None])
    assert report["drafts"] and set(report["drafts"]) <= {EOS, *MAP_IDS}
