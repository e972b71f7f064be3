"""The server on checkpoints of the newer families: a vision-language Qwen3.5 folder
(``Qwen3_5ForConditionalGeneration``: the decoder under ``model.language_model``, a vision
tower, a dense MTP head) served with NEXTN speculation, and a Granite 4.0-H folder. Each
folder has its own chat template in tokenizer_config.json; /v1/chat/completions renders it,
the vision tower is skipped with a log line, an image content part is a 400 naming it, and
the served tokens equal the cache-free greedy reference (speculative, for Qwen3.5's dense MTP
head).

The folders are written from random params through the families' own weight plans (the
inverse of loading; numpy only), with the session's byte-level tokenizer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from lazyspec.models import granite, qwen3_5, qwen3_next
from lazyspec.models.registry import parse_hf_config
from lazyspec.testing.tiny_models import (
    GRANITE_HF,
    GRANITE_INIT_SCALE,
    QWEN35_HF,
    SMALL_ENGINE,
    reference_greedy,
)
from lazyspec.training.export import checkpoint_tensors
from tests.server.conftest import EOS_ID, train_tokenizer

# Qwen3.5's ChatML with an empty thinking block after the generation prompt
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n"
    "{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "the state of a "},
            {"type": "text", "text": "recurrent layer"},
        ],
    },
]
RENDERED = (
    "<|im_start|>system\nbe brief<|im_end|>\n"
    "<|im_start|>user\nthe state of a recurrent layer<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
VISION_TENSORS = {
    "model.visual.patch_embed.proj.weight": (16, 3, 2, 4, 4),
    "model.visual.blocks.0.norm1.weight": (16,),
}
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
SETTINGS = dict(
    SMALL_ENGINE,
    mamba_track_interval=32,
    chunked_prefill_size=16,
    max_running_requests=1,
    max_total_tokens=2048,
)


def _write_folder(folder: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    """config.json, model.safetensors, tokenizer.json and tokenizer_config.json."""
    folder.mkdir()
    save_file(
        {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
        folder / "model.safetensors",
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>"})
    )
    return folder


def qwen3_5_vl_folder(root: Path, vocab_size: int) -> Path:
    """A dense Qwen3.5 vision-language checkpoint with one MTP layer."""
    text = {k: v for k, v in QWEN35_HF.items() if k not in MOE_FIELDS}
    del text["shared_expert_intermediate_size"]
    text.update(
        model_type="qwen3_5_text",
        vocab_size=vocab_size,
        eos_token_id=EOS_ID,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
    )
    config = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 16, "patch_size": 4},
        "tie_word_embeddings": False,
    }
    cfg = parse_hf_config(config)
    assert cfg.has_mtp and cfg.arch.mtp_mlp_kind == "dense"
    params = qwen3_5.init_params(cfg, jax.random.PRNGKey(1), scale=0.2)
    plan = qwen3_next.param_plan(cfg, True, prefix=qwen3_5.VL_TEXT_PREFIX)
    tensors = checkpoint_tensors(params, plan)
    rng = np.random.default_rng(0)
    tensors.update({name: rng.normal(size=shape) for name, shape in VISION_TENSORS.items()})
    return _write_folder(root / "qwen3_5_vl", config, tensors)


def granite_folder(root: Path, vocab_size: int) -> Path:
    """A Granite 4.0-H (MoE, Mamba2 + attention) checkpoint."""
    config = dict(
        GRANITE_HF,
        vocab_size=vocab_size,
        eos_token_id=EOS_ID,
        architectures=["GraniteMoeHybridForCausalLM"],
    )
    cfg = parse_hf_config(config)
    params = granite.init_params(cfg, jax.random.PRNGKey(2), scale=GRANITE_INIT_SCALE)
    tensors = checkpoint_tensors(params, granite.weight_plan(cfg, params))
    return _write_folder(root / "granite", config, tensors)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family_checkpoints")
    tokenizer = train_tokenizer(root)
    built = {
        "qwen3_5_vl": qwen3_5_vl_folder(root, tokenizer.get_vocab_size()),
        "granite": granite_folder(root, tokenizer.get_vocab_size()),
    }
    for folder in built.values():
        (folder / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    return built


@pytest.mark.parametrize("name,spec", [("qwen3_5_vl", True), ("granite", False)])
def test_chat_on_a_new_family_checkpoint(folders, caplog, name, spec):
    from fastapi.testclient import TestClient

    from lazyspec.engine.engine import Engine
    from lazyspec.server.app import ServerSettings, create_app
    from lazyspec.server.chat import ChatTemplate
    from lazyspec.server.worker import EngineWorker

    folder = folders[name]
    kw = dict(speculative_algorithm="NEXTN", speculative_num_steps=3) if spec else {}
    with caplog.at_level(logging.INFO, logger="lazyspec.models"):
        engine = Engine(model_path=str(folder), **SETTINGS, **kw)
    skipped = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    if name == "qwen3_5_vl":
        assert len(skipped) == 1 and "skipping 2 vision tower tensors" in skipped[0], skipped
    else:
        assert skipped == []
    worker = EngineWorker(engine).start()
    try:
        settings = ServerSettings(
            name, chat_template=ChatTemplate.from_folder(folder), allowed_hosts=None
        )
        client = TestClient(create_app(worker, settings))
        body = {"model": name, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
        chat = client.post("/v1/chat/completions", json=body)
        assert chat.status_code == 200, chat.text
        ids = engine.tokenizer.encode(RENDERED, add_special_tokens=False).ids
        assert chat.json()["usage"]["prompt_tokens"] == len(ids)  # the template was applied
        params = {"max_new_tokens": 12, "temperature": 0}
        plain = client.post("/generate", json={"input_ids": ids, "sampling_params": params})
        assert plain.status_code == 200, plain.text
        assert chat.json()["choices"][0]["message"]["content"] == plain.json()["text"]
        assert chat.json()["usage"]["completion_tokens"] == len(plain.json()["output_ids"])
        assert plain.json()["meta_info"]["cached_tokens"] > 0  # the chat's prompt, cached
        out_ids = plain.json()["output_ids"]
        assert out_ids == reference_greedy(engine.model, ids, len(out_ids), pad_len=128)[0]

        with_image = [
            MESSAGES[0],
            {"role": "user", "content": [MESSAGES[1]["content"][0], IMAGE_PART]},
        ]
        refused = client.post("/v1/chat/completions", json={**body, "messages": with_image})
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert "messages[1].content[1]" in message and "'image_url'" in message, message
        info = client.get("/server_info").json()
        if spec:
            assert info["speculative_algorithm"] == "NEXTN" and info["num_verify_steps"] > 0, info
    finally:
        worker.stop()


def test_every_media_part_is_refused_by_name():
    from lazyspec.server.chat import MEDIA_PARTS, parse_messages
    from lazyspec.server.limits import ApiError

    for kind in MEDIA_PARTS:
        parts = [{"type": "text", "text": "look"}, {"type": kind, kind: {}}]
        with pytest.raises(ApiError, match=rf"messages\[0\].content\[1\] has type '{kind}'"):
            parse_messages([{"role": "user", "content": parts}])
    assert parse_messages([{"role": "user", "content": parts[:1]}])[0]["content"] == "look"
