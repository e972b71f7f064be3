"""Carried state == recompute: chunked prefill + decode / verify through ``forward`` give the
logits of the cache-free ``reference_logits`` (tolerance 1e-4 of max |logit|), and padding
never changes a state or a KV row. Random tiny Qwen3-Next, no torch needed."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.models import qwen3_next
from lazyspec.models.model import (
    Model,
    empty_caches,
    incremental_logits,
    reference_logits,
    single_row_inputs,
)
from tests.models.tiny_qwen import config_dict

TOL = 1e-4
SEQ_LEN = 150
CONTEXT = 192  # fixed KV width so every case shares its compilations
BUCKET = 128


@functools.cache
def _model() -> Model:
    cfg = qwen3_next.parse_config(config_dict("mixed", num_nextn_predict_layers=0))
    params = qwen3_next.init_params(cfg, jax.random.key(3), jnp.float32, scale=0.15)
    return Model(cfg, params, None, qwen3_next)


@functools.cache
def _sequence_and_reference() -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(11).integers(0, _model().config.vocab_size, SEQ_LEN)
    return tokens, reference_logits(_model(), tokens)


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize(
    "prompt_len, prefill_chunk, bucket",
    [
        (63, None, BUCKET),
        (64, None, BUCKET),
        (65, None, BUCKET),
        (64, None, None),
        (129, 64, BUCKET),
        (130, 65, BUCKET),
    ],
)
def test_prefill_then_decode_matches_reference(prompt_len, prefill_chunk, bucket):
    tokens, ref = _sequence_and_reference()
    num_decode = 20
    got = incremental_logits(
        _model(),
        tokens[:prompt_len],
        tokens[prompt_len : prompt_len + num_decode],
        prefill_chunk,
        bucket=bucket,
        context_len=CONTEXT,
    )
    assert got.shape == (prompt_len + num_decode, _model().config.vocab_size)
    assert _rel_err(got, ref[: prompt_len + num_decode]) <= TOL
    assert np.std(ref) > 0.1  # logits are not trivially flat


@functools.partial(jax.jit, static_argnames=("mode",))
def _forward(params, inputs, kv, rec, mode):
    model = _model()
    hidden, kv, out = qwen3_next.forward(params, model.config, inputs, kv, rec, mode=mode)
    return qwen3_next.compute_logits(params, model.config, hidden), kv, out


def _prefill(prompt_len: int):
    model = _model()
    tokens, _ = _sequence_and_reference()
    kv, rec = empty_caches(model.config, CONTEXT + 1, 1, jnp.float32)
    inputs = single_row_inputs(
        tokens[:prompt_len], 0, CONTEXT, bucket=BUCKET, vocab_size=model.config.vocab_size
    )
    _, kv, out = _forward(model.params, inputs, kv, rec, "extend")
    return kv, out.final


def test_verify_logits_and_per_step_states():
    """Verify over D=4 tokens: logits match; steps[t] is the state after t+1 tokens."""
    model, (tokens, ref) = _model(), _sequence_and_reference()
    prompt_len, width = 70, 4
    kv, rec = _prefill(prompt_len)
    window = tokens[prompt_len : prompt_len + width]
    logits, _, out = _forward(
        model.params, single_row_inputs(window, prompt_len, CONTEXT), kv, rec, "verify"
    )
    assert _rel_err(np.asarray(logits[0]), ref[prompt_len : prompt_len + width]) <= TOL
    assert isinstance(out.steps.ssm, list)  # per layer, never stacked
    steps_ssm, steps_conv = np.stack(out.steps.ssm), np.stack(out.steps.conv)
    assert steps_ssm.shape == (
        len(model.config.recurrent_layer_ids),
        1,
        width,
        *model.config.ssm_state_shape,
    )
    for t in range(width):
        # the same verify with only t+1 real tokens ends in the state steps[t] holds
        partial = single_row_inputs(
            window[: t + 1], prompt_len, CONTEXT, bucket=width, vocab_size=model.config.vocab_size
        )
        _, _, short = _forward(model.params, partial, kv, rec, "verify")
        np.testing.assert_allclose(steps_ssm[:, 0, t], short.final.ssm[:, 0], atol=1e-6)
        np.testing.assert_allclose(steps_conv[:, 0, t], short.final.conv[:, 0], atol=1e-6)
    assert not np.allclose(steps_ssm[:, 0, 0], rec.ssm[:, 0], atol=1e-3)


def test_padding_row_changes_nothing():
    """A decode batch whose second row is padding (num_new = 0) with a random state and
    write indices that point at real KV rows: its state and those rows stay bit-identical."""
    model = _model()
    cfg = model.config
    rng = np.random.default_rng(5)
    kv, rec = empty_caches(cfg, 16, 2, jnp.float32)
    kv.k = [jnp.asarray(rng.standard_normal(k.shape), jnp.float32) for k in kv.k]
    rec = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32), rec)
    inputs = single_row_inputs([7], 3, 8)
    inputs = jax.tree.map(lambda a: jnp.concatenate([a, a]), inputs)
    inputs.kv_write_idx = jnp.array([[4], [9]], jnp.int32)
    inputs.num_new = jnp.array([1, 0], jnp.int32)
    _, new_kv, out = _forward(model.params, inputs, kv, rec, "decode")
    assert np.array_equal(out.final.ssm[:, 1], rec.ssm[:, 1])
    assert np.array_equal(out.final.conv[:, 1], rec.conv[:, 1])
    assert not np.allclose(out.final.ssm[:, 0], rec.ssm[:, 0])
    for old, new in zip(kv.k, new_kv.k):
        assert np.array_equal(new[9], old[9]) and not np.array_equal(new[4], old[4])
        assert np.array_equal(new[0], old[0])
