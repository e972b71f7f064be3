"""One tiny model folder and one live server per test session.

The folder holds a random dense Qwen3-Next checkpoint (tests/models/tiny_qwen.py, numpy
only), a byte-level BPE tokenizer.json trained here on a few KB of text (its vocabulary size
is the model's), and a tokenizer_config.json with a small ChatML-style chat template. The
server runs in-process: the engine in its worker thread, uvicorn in another thread on a free
loopback port.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from lazyspec.testing.tiny_models import TINY_CHUNKS

SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|endoftext|>", "<|im_end|>"]
EOS_ID = 2
TARGET_VOCAB = 384
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
WORDS = (
    "the state of a recurrent layer is copied into a slot when the prefix cache holds a "
    "checkpoint every interval tokens while attention keeps pages of keys and values "
    "draft tokens are verified in one forward pass and accepted greedily café naïve "
    "über straße déjà vu 12 345 6789 ( ) [ ] { } , . ; : ! ? - + = * / def return if "
    "else for while import from class self"
).split()
ENGINE_SETTINGS = dict(
    TINY_CHUNKS,
    mamba_chunk_size=64,
    max_running_requests=8,
    max_total_tokens=8192,
    context_length=512,
)
SERVED_NAME = "tiny-qwen3-next"


def corpus(seed: int = 0, num_lines: int = 160) -> list[str]:
    """A few KB of pseudo-text with ASCII, accented letters, digits and code punctuation."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 14)))) for _ in range(num_lines)]


def train_tokenizer(folder: Path) -> Any:
    from lazyspec.testing.bpe import byte_level_bpe

    tokenizer = byte_level_bpe(corpus(), TARGET_VOCAB, SPECIAL_TOKENS)
    tokenizer.save(str(folder / "tokenizer.json"))
    return tokenizer


def build_model_folder(folder: Path) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    from tests.models.tiny_qwen import config_dict, write_checkpoint

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(folder)
    assert tokenizer.token_to_id("<|endoftext|>") == EOS_ID
    config = config_dict(
        "dense",
        vocab_size=tokenizer.get_vocab_size(),
        max_position_embeddings=4096,
        eos_token_id=EOS_ID,
    )
    write_checkpoint(folder, config, seed=3)
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>", "bos_token": None}
        )
    )
    return folder


@dataclass
class LiveServer:
    url: str
    worker: Any
    model_dir: Path
    tokenizer: Any
    uvicorn_server: Any
    thread: threading.Thread

    def info(self) -> dict:
        return httpx.get(f"{self.url}/server_info", timeout=30).json()

    def stop(self) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(30)


def start_http(app: Any) -> tuple[Any, threading.Thread, str]:
    """Serve ``app`` with uvicorn in a thread on a free loopback port; returns once ready."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return build_model_folder(tmp_path_factory.mktemp("tiny_server_model"))


def serve_folder(model_dir: Path, **settings: Any) -> LiveServer:
    """An engine of ``model_dir`` with ``ENGINE_SETTINGS`` (``settings`` add to them or
    replace them), compiled, behind the app on a loopback port; ``stop_server`` ends it."""
    from lazyspec.engine.engine import Engine
    from lazyspec.server.app import ServerSettings, create_app
    from lazyspec.server.chat import ChatTemplate
    from lazyspec.server.worker import EngineWorker

    engine = Engine(model_path=str(model_dir), **{**ENGINE_SETTINGS, **settings})
    worker = EngineWorker(engine).start()
    server_settings = ServerSettings(
        SERVED_NAME, max_queued_requests=256, chat_template=ChatTemplate.from_folder(model_dir)
    )
    server, thread, url = start_http(create_app(worker, server_settings))
    return LiveServer(url, worker, model_dir, engine.tokenizer, server, thread)


def stop_server(live: LiveServer) -> None:
    live.stop()
    live.worker.stop()


@pytest.fixture(scope="session")
def live_server(model_dir):
    live = serve_folder(model_dir)  # compiles every shape
    yield live
    stop_server(live)


@pytest.fixture()
def server(live_server) -> LiveServer:
    """The session's server with an empty prefix cache and no request left running."""
    wait_idle(live_server)
    response = httpx.post(f"{live_server.url}/flush_cache", timeout=30)
    assert response.status_code == 200, response.text
    return live_server


def wait_idle(live: LiveServer, timeout: float = 60.0) -> dict:
    """Poll /server_info until no request runs or waits; returns the last info."""
    deadline = time.monotonic() + timeout
    while True:
        info = live.info()
        if (
            info["num_running_requests"] == 0
            and info["num_waiting_requests"] == 0
            and info["num_live_requests"] == 0
        ):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout}s: {info}")
        time.sleep(0.05)


def assert_all_free(info: dict) -> None:
    """After a flush: every state slot and KV row is free."""
    assert info["free_state_slots"] == info["state_slots"], info
    assert info["cached_state_slots"] == 0, info
    assert info["free_kv_tokens"] == info["kv_tokens"], info
    assert info["cached_kv_tokens"] == 0, info


def post(live: LiveServer, path: str, body: dict) -> httpx.Response:
    """``body`` posted as JSON to ``path`` of ``live``, with two minutes to answer."""
    return httpx.post(f"{live.url}{path}", json=body, timeout=120)


def v1_body(path: str, text: str, **fields: Any) -> dict:
    """A request to the served model for the /v1 endpoint ``path``: ``text`` as the prompt
    of /v1/completions or as the one user message of /v1/chat/completions, and ``fields``."""
    if path == "/v1/completions":
        return {"model": SERVED_NAME, "prompt": text, **fields}
    if path == "/v1/chat/completions":
        return {"model": SERVED_NAME, "messages": [{"role": "user", "content": text}], **fields}
    raise ValueError(path)


def random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    """``n`` random non-special token ids."""
    return [int(t) for t in rng.integers(len(SPECIAL_TOKENS), vocab, size=n)]
