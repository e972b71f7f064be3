"""The MTP draft head: ``mtp_forward`` + ``compute_mtp_logits`` equal a straightforward
composition of the same weights out of transformers' own modules (RMSNorm, Linear, a full
attention decoder layer, rotary embedding, the shared embedding and lm_head), for Qwen3-Next
and Qwen3.5 (dense and MoE).

Both sides get the target's hidden stream before its final norm, taken from transformers
(a hook on the last decoder layer), and the next tokens. Ours runs over its own KV pool in
two extend pieces (so the second piece attends to cached draft K/V). Tolerance: max|error| /
max|logit| <= 1e-4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyspec.kernels.backend import kernels_for
from lazyspec.models import load_model
from lazyspec.models.model import empty_caches, single_row_inputs
from tests.models.tiny_qwen import save_tiny_qwen
from tests.models.tiny_qwen35 import save_tiny_qwen35

TOL = 1e-4
SEQ_LEN = 70
SPLIT = 41  # first extend piece; the rest attends to its cached K/V
SAVERS = {"qwen3_next": save_tiny_qwen, "qwen3_5": save_tiny_qwen35}
# model_type -> transformers modeling module, then its decoder layer, RMSNorm and rotary classes
HF_MODULES = {
    "qwen3_next": (
        "qwen3_next.modeling_qwen3_next",
        "Qwen3NextDecoderLayer",
        "Qwen3NextRMSNorm",
        "Qwen3NextRotaryEmbedding",
    ),
    "qwen3_5_text": (
        "qwen3_5.modeling_qwen3_5",
        "Qwen3_5DecoderLayer",
        "Qwen3_5RMSNorm",
        "Qwen3_5TextRotaryEmbedding",
    ),
    "qwen3_5_moe_text": (
        "qwen3_5_moe.modeling_qwen3_5_moe",
        "Qwen3_5MoeDecoderLayer",
        "Qwen3_5MoeRMSNorm",
        "Qwen3_5MoeTextRotaryEmbedding",
    ),
}


def _torch_target_hidden(hf_model, tokens: np.ndarray):
    """Target logits and the last decoder layer's output (before the final norm)."""
    import torch

    captured = {}
    hook = hf_model.model.layers[-1].register_forward_hook(
        lambda module, args, output: captured.update(hidden=output)
    )
    with torch.no_grad():
        logits = hf_model(torch.tensor(tokens[None])).logits[0]
    hook.remove()
    hidden = captured["hidden"]
    # sanity: the captured stream really is the pre-norm one
    torch.testing.assert_close(hf_model.lm_head(hf_model.model.norm(hidden))[0], logits)
    return hidden


def _torch_mtp_logits(hf_model, mtp: dict[str, np.ndarray], hidden, next_tokens: np.ndarray):
    """The MTP head composed from transformers modules, loaded with the ``mtp.*`` tensors."""
    import copy
    import importlib

    import torch

    config = copy.deepcopy(hf_model.config)
    module, layer_class, norm_class, rotary_class = HF_MODULES[config.model_type]
    hf = importlib.import_module(f"transformers.models.{module}")
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    if config.model_type == "qwen3_next":
        config.mlp_only_layers, config.decoder_sparse_step = [], 1
    config._attn_implementation = "eager"
    num_experts = getattr(config, "num_experts", 0) or 0
    layer = getattr(hf, layer_class)(config, layer_idx=0).eval()
    state = {
        k[len("mtp.layers.0.") :]: torch.tensor(v)
        for k, v in mtp.items()
        if k.startswith("mtp.layers.0.") and ".experts." not in k
    }
    if num_experts:
        experts = range(num_experts)
        ex = lambda e, p: mtp[f"mtp.layers.0.mlp.experts.{e}.{p}.weight"]  # noqa: E731
        state["mlp.experts.gate_up_proj"] = torch.tensor(
            np.stack([np.concatenate([ex(e, "gate_proj"), ex(e, "up_proj")]) for e in experts])
        )
        state["mlp.experts.down_proj"] = torch.tensor(
            np.stack([ex(e, "down_proj") for e in experts])
        )
    layer.load_state_dict(state, strict=True)

    def norm(name: str):
        module = getattr(hf, norm_class)(config.hidden_size, eps=config.rms_norm_eps)
        module.weight.data = torch.tensor(mtp[f"mtp.{name}.weight"])
        return module

    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    fc.weight.data = torch.tensor(mtp["mtp.fc.weight"])
    num = hidden.shape[1]
    positions = torch.arange(num)[None]
    causal = torch.full((num, num), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        embeds = hf_model.model.embed_tokens(torch.tensor(next_tokens[None]))
        x = fc(
            torch.cat(
                [norm("pre_fc_norm_embedding")(embeds), norm("pre_fc_norm_hidden")(hidden)], dim=-1
            )
        )
        rope = getattr(hf, rotary_class)(config)(x, positions)
        x = layer(x, position_embeddings=rope, attention_mask=causal, position_ids=positions)
        return hf_model.lm_head(norm("norm")(x))[0].numpy()


@pytest.mark.parity
@pytest.mark.parametrize("kernel_backend", ["xla", "pallas"])
@pytest.mark.parametrize(
    "family_name, name",
    [("qwen3_next", "moe"), ("qwen3_next", "dense"), ("qwen3_5", "moe"), ("qwen3_5", "dense")],
)
def test_mtp_matches_composition_of_transformers_modules(
    family_name, name, kernel_backend, tmp_path
):
    """With the XLA forms and with the kernels the engine passes it (the paged attention
    and the routed experts, interpreted here)."""
    pytest.importorskip("torch")
    kernels = kernels_for(kernel_backend, "cpu")
    hf_model, mtp = SAVERS[family_name](tmp_path, name, seed=5, with_mtp=True)
    model = load_model(tmp_path)
    assert model.has_mtp
    rng = np.random.default_rng(31)
    tokens = rng.integers(0, model.config.vocab_size, SEQ_LEN + 1)
    hidden_t = _torch_target_hidden(hf_model, tokens[:-1])
    want = _torch_mtp_logits(hf_model, mtp, hidden_t, tokens[1:])

    cfg, family = model.config, model.family
    mtp_kv, _ = empty_caches(cfg, SEQ_LEN + 1, 1, jnp.float32)
    mtp_kv.k, mtp_kv.v = mtp_kv.k[:1], mtp_kv.v[:1]  # one pool for the one MTP layer

    @jax.jit
    def draft(params, hidden, next_tokens, inputs, mtp_kv):
        mtp_hidden, mtp_kv = family.mtp_forward(
            params, cfg, hidden, next_tokens, inputs, mtp_kv, kernels=kernels
        )
        return family.compute_mtp_logits(params, cfg, mtp_hidden), mtp_kv

    hidden = jnp.asarray(hidden_t.numpy())
    got = []
    for start, end in ((0, SPLIT), (SPLIT, SEQ_LEN)):
        inputs = single_row_inputs(tokens[start:end], start, SEQ_LEN)
        logits, mtp_kv = draft(
            model.params,
            hidden[:, start:end],
            jnp.asarray(tokens[None, start + 1 : end + 1]),
            inputs,
            mtp_kv,
        )
        got.append(np.asarray(logits[0]))
    got = np.concatenate(got)
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) <= TOL
    # the draft head is not the target head in disguise
    target = np.asarray(family.compute_logits(model.params, cfg, hidden))[0]
    assert np.max(np.abs(target - want)) / np.max(np.abs(want)) > 0.1


def test_mtp_forward_without_head_raises():
    from lazyspec.models import qwen3_next
    from tests.models.tiny_qwen import config_dict

    cfg = qwen3_next.parse_config(config_dict("dense"))
    params = qwen3_next.init_params(cfg, jax.random.key(0))
    assert "mtp" not in params
    inputs = single_row_inputs([1, 2], 0, 2)
    kv, _ = empty_caches(cfg, 3, 1, jnp.float32)
    with pytest.raises(ValueError, match="no MTP head"):
        qwen3_next.mtp_forward(
            params, cfg, jnp.zeros((1, 2, cfg.hidden_size)), inputs.tokens, inputs, kv
        )
