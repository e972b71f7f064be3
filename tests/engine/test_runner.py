"""The jitted steps take the model config as a static argument hashed by value: engines of
equal configs built separately share one compilation per shape; a different config
compiles its own."""

from __future__ import annotations

from types import SimpleNamespace

import jax

from lazyspec.engine.engine import Engine
from lazyspec.engine.runner import Runner
from lazyspec.models import nemotron_h
from lazyspec.models.registry import parse_hf_config
from lazyspec.testing.tiny_models import NEMOTRON_HF


def _model(**overrides) -> SimpleNamespace:
    cfg = parse_hf_config({**NEMOTRON_HF, **overrides})
    params = nemotron_h.init_params(cfg, jax.random.PRNGKey(0))
    return SimpleNamespace(config=cfg, params=params, tokenizer=None, family=nemotron_h)


def _serve(model: SimpleNamespace) -> None:
    engine = Engine(
        model=model,
        mamba_track_interval=64,
        chunked_prefill_size=64,
        max_running_requests=1,
        max_total_tokens=256,
        context_length=64,
        skip_warmup=True,
    )
    engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "ignore_eos": True})


def test_equal_configs_share_compiled_steps():
    first, second = _model(), _model()
    assert first.config is not second.config and first.config == second.config
    _serve(first)
    compiled = Runner.num_compiled()
    _serve(second)
    assert Runner.num_compiled() == compiled
    _serve(_model(layer_norm_epsilon=1e-6))  # a different config: its own programs
    assert Runner.num_compiled() > compiled
