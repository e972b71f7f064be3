"""Nemotron-H against transformers' NemotronHForCausalLM, and carried state against recompute.

Tiny random models are saved by transformers (save_pretrained) and loaded through our config
parser and SafetensorsReader. Logits are compared as max |ours - theirs| / max |theirs|.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.models import nemotron_h
from lazyspec.models.config import ATTENTION, RECURRENT, STATELESS
from lazyspec.models.interface import ForwardInputs, KVPools, StateRows
from lazyspec.models.loader import SafetensorsReader
from lazyspec.models.registry import load_model_config
from tests.models.tiny_nemotron import TINY_CONFIGS, hf_config_dict, save_tiny_nemotron

TOL = 1e-4
VOCAB = 128


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@partial(jax.jit, static_argnames=("cfg",))
def reference_logits(params, cfg, tokens):
    return nemotron_h.compute_logits(params, cfg, nemotron_h.reference_forward(params, cfg, tokens))


@partial(jax.jit, static_argnames=("cfg", "mode"))
def forward_logits(params, cfg, inputs, kv, rec, mode):
    hidden, kv, out = nemotron_h.forward(params, cfg, inputs, kv, rec, mode=mode)
    return nemotron_h.compute_logits(params, cfg, hidden), kv, out


class Pools:
    """A small KV pool (row 0 = null) and per-row recurrent states, driven by ``step``.

    Unwritten KV rows hold large random values, so reading one by mistake shows up.
    """

    def __init__(self, cfg, batch: int, max_len: int, seed: int = 0):
        self.cfg, self.max_len = cfg, max_len
        self.num_rows = 1 + batch * max_len
        rng = np.random.default_rng(seed)
        shape = (self.num_rows, max(cfg.num_kv_heads, 1), max(cfg.head_dim, 1))
        num_attention = len(cfg.attention_layer_ids)

        def poison():
            return jnp.asarray(100 * rng.normal(size=shape), jnp.float32)

        self.kv = KVPools(
            k=[poison() for _ in range(num_attention)], v=[poison() for _ in range(num_attention)]
        )
        num_rec = len(cfg.recurrent_layer_ids)
        self.rec = StateRows(
            conv=jnp.zeros((num_rec, batch) + cfg.conv_state_shape, jnp.float32),
            ssm=jnp.zeros((num_rec, batch) + cfg.ssm_state_shape, jnp.float32),
        )
        self.lengths = [0] * batch

    def inputs(self, new_tokens: list[list[int]], width: int) -> ForwardInputs:
        """Row b appends ``new_tokens[b]``; T = ``width`` token slots per row."""
        batch = len(new_tokens)
        tokens = np.zeros((batch, width), np.int32)
        positions = np.zeros((batch, width), np.int32)
        write_idx = np.full((batch, width), self.num_rows, np.int32)  # out of range: dropped
        read_idx = np.zeros((batch, self.max_len), np.int32)
        ctx_len = np.zeros((batch,), np.int32)
        for b, row in enumerate(new_tokens):
            start, base = self.lengths[b], 1 + b * self.max_len
            tokens[b, : len(row)] = row
            positions[b] = start + np.arange(width)
            write_idx[b, : len(row)] = base + start + np.arange(len(row))
            ctx_len[b] = start + len(row)
            read_idx[b, : ctx_len[b]] = base + np.arange(ctx_len[b])
        num_new = np.array([len(r) for r in new_tokens], np.int32)
        return ForwardInputs(
            *(jnp.asarray(a) for a in (tokens, positions, num_new, write_idx, read_idx, ctx_len))
        )

    def step(self, params, new_tokens: list[list[int]], width: int, mode: str):
        """Run one forward, carry KV and the final state; returns (logits, RecurrentOut)."""
        inputs = self.inputs(new_tokens, width)
        logits, self.kv, out = forward_logits(params, self.cfg, inputs, self.kv, self.rec, mode)
        self.rec = out.final
        for b, row in enumerate(new_tokens):
            self.lengths[b] += len(row)
        return np.asarray(logits), out


@pytest.fixture(scope="module", params=list(TINY_CONFIGS), ids=list(TINY_CONFIGS))
def tiny(request, tmp_path_factory):
    """(torch model, ModelConfig, params) for one tiny config, loaded from its saved folder."""
    pattern, overrides = TINY_CONFIGS[request.param]
    folder = tmp_path_factory.mktemp(f"nemotron_{request.param}")
    model = save_tiny_nemotron(folder, pattern, overrides, seed=len(pattern))
    cfg = load_model_config(folder)
    params = nemotron_h.load_params(cfg, SafetensorsReader(folder))
    return model, cfg, params


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


@pytest.mark.parity
def test_reference_forward_matches_transformers(tiny):
    model, cfg, params = tiny
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(2, 150))
    err = rel_err(reference_logits(params, cfg, jnp.asarray(ids)), torch_logits(model, ids))
    assert err <= TOL, err


@pytest.mark.parity
def test_extend_forward_matches_transformers_on_ragged_batch(tiny):
    model, cfg, params = tiny
    rng = np.random.default_rng(2)
    lengths = (150, 97, 64, 1)  # several chunks, mid-chunk, exactly one chunk, one token
    rows = [rng.integers(0, VOCAB, size=n).tolist() for n in lengths]
    pools = Pools(cfg, batch=len(rows), max_len=160)
    logits, out = pools.step(params, rows, width=160, mode="extend")
    for b, row in enumerate(rows):
        want = torch_logits(model, np.asarray([row]))[0]
        err = rel_err(logits[b, : len(row)], want)
        assert err <= TOL, (b, err)
    if cfg.recurrent_layer_ids:
        assert out.chunks.ssm.shape[:3] == (len(cfg.recurrent_layer_ids), 4, 160 // 64)
        assert out.steps is None


def perturbed(params, seed: int, scale: float = 0.2):
    """Add noise to every parameter (so no norm is 1, no bias 0) and unit-scale embeddings."""
    rng = np.random.default_rng(seed)

    def noisy(x):
        return x + jnp.asarray(scale * rng.normal(size=x.shape), x.dtype)

    params = jax.tree_util.tree_map(noisy, params)
    params["embed_tokens"] = params["embed_tokens"] / scale
    return params


def test_carried_state_equals_recompute():
    """Two extend calls (one with a pure padding row), 20 decodes and a ragged verify through
    ``forward`` with carried KV and state give reference_forward's logits."""
    pattern, overrides = TINY_CONFIGS["M*M-M*"]
    cfg = nemotron_h.parse_config(hf_config_dict(pattern, overrides))
    params = perturbed(nemotron_h.init_params(cfg, jax.random.PRNGKey(0)), seed=1)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (64, 129)]
    decodes = rng.integers(0, VOCAB, size=(20, 2)).tolist()
    verify = [rng.integers(0, VOCAB, size=n).tolist() for n in (4, 3)]
    pools = Pools(cfg, batch=2, max_len=160)
    null_rows = [np.asarray(k[0]) for k in pools.kv.k]
    got = [[], []]

    def record(logits, rows):
        for b, row in enumerate(rows):
            got[b].extend(logits[b, : len(row)])

    first = [prompts[0], prompts[1][:100]]
    logits, out = pools.step(params, first, width=100, mode="extend")
    record(logits, first)
    np.testing.assert_array_equal(out.chunks.ssm[:, 0, 0], out.final.ssm[:, 0])  # row 0: 64
    state_row0 = pools.rec
    second = [[], prompts[1][100:]]
    logits, out = pools.step(params, second, width=100, mode="extend")  # same shape as first
    record(logits, second)
    np.testing.assert_array_equal(out.final.ssm[:, 0], state_row0.ssm[:, 0])  # padding row
    np.testing.assert_array_equal(out.final.conv[:, 0], state_row0.conv[:, 0])
    for pair in decodes:
        rows = [[pair[0]], [pair[1]]]
        logits, out = pools.step(params, rows, width=1, mode="decode")
        record(logits, rows)
    logits, out = pools.step(params, verify, width=4, mode="verify")
    record(logits, verify)
    steps_ssm = np.stack(out.steps.ssm)  # per layer in the RecurrentOut
    assert steps_ssm.shape[2] == 4 and out.chunks is None
    np.testing.assert_array_equal(steps_ssm[:, 1, 3], out.final.ssm[:, 1])  # padded step
    np.testing.assert_array_equal(steps_ssm[:, 0, 3], out.final.ssm[:, 0])

    for k, null_row in zip(pools.kv.k, null_rows):
        np.testing.assert_array_equal(k[0], null_row)  # the null KV row is never written

    sequences = [prompts[b] + [pair[b] for pair in decodes] + verify[b] for b in range(2)]
    # Causal: padding the shorter row at its end leaves its real positions' logits unchanged.
    width = max(len(seq) for seq in sequences)
    padded = [seq + [0] * (width - len(seq)) for seq in sequences]
    want = np.asarray(reference_logits(params, cfg, jnp.asarray(padded)))
    for b, seq in enumerate(sequences):
        err = rel_err(np.stack(got[b]), want[b, : len(seq)])
        assert err <= TOL, (b, err)


def test_parse_config_roles_shapes_and_errors():
    hf = hf_config_dict("M*-E", dict(n_groups=2))
    cfg = nemotron_h.parse_config(hf)
    assert cfg.layer_roles == (RECURRENT, ATTENTION, STATELESS, STATELESS)
    assert cfg.ssm_state_shape == (4, 8, 16)
    assert cfg.conv_state_shape == (4 * 8 + 2 * 2 * 16, 3)
    assert cfg.num_mtp_layers == 0 and cfg.arch.moe.num_experts == 4
    legacy = {k: v for k, v in hf.items() if k != "layers_block_type"}
    legacy["hybrid_override_pattern"] = "M*-E"
    assert nemotron_h.parse_config(legacy) == cfg
    for field in ("ssm_state_size", "hidden_size", "num_attention_heads"):
        broken = {k: v for k, v in hf.items() if k != field}
        with pytest.raises(ValueError, match=field):
            nemotron_h.parse_config(broken)
    with pytest.raises(ValueError, match="Q"):
        nemotron_h.parse_config(dict(hf, layers_block_type=["mamba", "Q"]))


def test_parse_config_ignores_declared_mtp_layers_with_a_warning(caplog):
    hf = hf_config_dict("M*-", dict(n_groups=1, num_nextn_predict_layers=1))
    with caplog.at_level("WARNING", logger="lazyspec.models.nemotron_h"):
        cfg = nemotron_h.parse_config(hf)
    assert cfg.num_mtp_layers == 0 and not cfg.has_mtp
    assert "MTP" in caplog.text


@pytest.mark.parity
def test_loader_names_missing_and_misshapen_tensors(tmp_path):
    from safetensors.numpy import load_file, save_file

    pattern, overrides = TINY_CONFIGS["M-M*-"]
    save_tiny_nemotron(tmp_path, pattern, overrides)
    cfg = load_model_config(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "backbone.layers.0.mixer.in_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"in_proj\.weight.*\(99, 32\).*\(100, 32\)"):
        nemotron_h.load_params(cfg, SafetensorsReader(tmp_path))
    del tensors[name]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=r"in_proj\.weight"):
        nemotron_h.load_params(cfg, SafetensorsReader(tmp_path))
