"""Poisoned requests among many live streams: 128 concurrent streaming clients, with bad
requests of every kind the server refuses at its boundary and requests that fail inside
the engine mixed in. Each bad request gets its own error; every good stream ends with
exactly the tokens of a one-batch reference run; afterwards nothing is held."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from lazyspec.server.guard import DEFAULT_MAX_REQUEST_BYTES
from tests.server.conftest import assert_all_free, random_ids, wait_idle
from tests.server.test_load import _one_stream

NUM_STREAMS = 128
MAX_NEW = 6
GENERATE = "/generate"
POISON_SEED = 4242  # requests with this seed fail when the scheduler prepares them


@pytest.fixture()
def poison_seed(monkeypatch):
    """Fault injection inside the engine: preparing a request with POISON_SEED raises."""
    from lazyspec.scheduler import scheduler

    real = scheduler.sampling_row

    def failing(req, eos_ids=()):
        if req.sampling.seed == POISON_SEED:
            raise RuntimeError("injected failure while preparing the request")
        return real(req, eos_ids)

    monkeypatch.setattr(scheduler, "sampling_row", failing)


def _sampling(**extra) -> dict:
    return {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, **extra}


async def _good_stream(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
    """One streamed greedy /generate request (checked chunk by chunk by test_load's
    ``_one_stream``); returns its output ids."""
    last = await _one_stream(client, prompt, MAX_NEW)
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}
    return last["output_ids"]


def _bad_requests(vocab: int) -> list[tuple[str, dict, int]]:
    """(kind, request kwargs, expected status) for every kind of refused request."""
    deep = "[" * 100_000 + "]" * 100_000
    as_json = {"Content-Type": "application/json"}
    huge = b'{"text": "' + b"x" * (DEFAULT_MAX_REQUEST_BYTES + 1) + b'"}'
    return [
        ("top_k past int32", {"json": {"text": "x", "sampling_params": {"top_k": 2**40}}}, 400),
        ("top_k = 2**31", {"json": {"text": "x", "sampling_params": {"top_k": 2**31}}}, 400),
        (
            "temperature 1e39",
            {"json": {"text": "x", "sampling_params": {"temperature": 1e39}}},
            400,
        ),
        ("seed past 64 bits", {"json": {"text": "x", "sampling_params": {"seed": 2**70}}}, 400),
        ("string token ids", {"json": {"input_ids": ["a"]}}, 400),
        ("token id past vocab", {"json": {"input_ids": [vocab + 5]}}, 400),
        ("deep JSON", {"content": deep.encode(), "headers": as_json}, 400),
        (
            "deep JSON in a field",
            {"content": f'{{"text": "x", "junk": {deep}}}'.encode(), "headers": as_json},
            400,
        ),
        ("not JSON", {"content": b"{oops", "headers": as_json}, 400),
        (
            "text/plain body",
            {"content": b'{"text": "x"}', "headers": {"Content-Type": "text/plain"}},
            415,
        ),
        ("body over the limit", {"content": huge, "headers": as_json}, 413),
        ("foreign Host", {"json": {"text": "x"}, "headers": {"Host": "evil.example"}}, 400),
    ]


async def _bad(client: httpx.AsyncClient, kind: str, kwargs: dict, status: int) -> None:
    response = await client.post(GENERATE, **kwargs)
    assert response.status_code == status, (kind, response.status_code, response.text[:300])
    assert response.json()["error"]["message"], kind


async def _fails_inside(client: httpx.AsyncClient, prompt: list[int], stream: bool) -> None:
    """A valid request that fails when the engine prepares it (``poison_seed``): a 500 of
    its own, or an error event in its own stream."""
    body = {"input_ids": prompt, "stream": stream, "sampling_params": _sampling(seed=POISON_SEED)}
    if not stream:
        response = await client.post(GENERATE, json=body)
        assert response.status_code == 500, response.text
        assert "prepared" in response.json()["error"]["message"]
        return
    lines = []
    async with client.stream("POST", GENERATE, json=body) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: ") :])["error"]
    assert error["type"] == "server_error" and "prepared" in error["message"]


async def _hang_up(client: httpx.AsyncClient, prompt: list[int]) -> None:
    """A client that leaves after its first chunk."""
    body = {"input_ids": prompt, "stream": True, "sampling_params": _sampling()}
    async with client.stream("POST", GENERATE, json=body) as response:
        async for line in response.aiter_lines():
            if line:
                break


async def _mixed_load(url: str, prompts: list, picks: list[int], vocab: int) -> list:
    limits = httpx.Limits(max_connections=NUM_STREAMS + 64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        good = [asyncio.ensure_future(_good_stream(client, prompts[i])) for i in picks]
        poison = [_bad(client, *bad) for bad in _bad_requests(vocab) for _ in range(2)]
        poison += [_fails_inside(client, prompts[i], stream=i % 2 == 0) for i in range(6)]
        poison += [_hang_up(client, prompts[i]) for i in range(4)]
        await asyncio.gather(*poison)
        return await asyncio.gather(*good)


def test_poisoned_requests_among_128_streams_fail_alone(server, poison_seed):
    vocab = server.tokenizer.get_vocab_size()
    rng = np.random.default_rng(60)
    prefix = random_ids(rng, 70, vocab)
    prompts = [prefix + random_ids(rng, int(rng.integers(1, 40)), vocab) for _ in range(8)]
    prompts += [random_ids(rng, int(rng.integers(2, 100)), vocab) for _ in range(8)]
    reference = httpx.post(
        f"{server.url}{GENERATE}",
        json={"input_ids": prompts, "sampling_params": _sampling()},
        timeout=300,
    ).json()
    wait_idle(server)
    picks = [int(i) for i in rng.integers(len(prompts), size=NUM_STREAMS)]

    outputs = asyncio.run(_mixed_load(server.url, prompts, picks, vocab))

    for index, output in zip(picks, outputs):
        assert output == reference[index]["output_ids"]
    info = wait_idle(server)
    assert info["free_state_slots"] + info["cached_state_slots"] == info["state_slots"]
    assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["kv_tokens"]
    server.worker.call(lambda engine: engine.check_integrity()).result(30)
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
    assert_all_free(server.info())


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_failing_inside_the_engine_leaves_its_neighbours_exact(
    server, poison_seed, stream
):
    """The single-request version, on both answer shapes: the failing request gets its own
    error while a batch request running beside it finishes exactly."""
    vocab = server.tokenizer.get_vocab_size()
    prompts = [random_ids(np.random.default_rng(61 + i), 30, vocab) for i in range(3)]
    body = {"input_ids": prompts, "sampling_params": _sampling()}
    reference = httpx.post(f"{server.url}{GENERATE}", json=body, timeout=300).json()

    async def both() -> list:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            batch = asyncio.ensure_future(client.post(GENERATE, json=body))
            await _fails_inside(client, prompts[0], stream)
            return (await batch).json()

    assert [r["output_ids"] for r in asyncio.run(both())] == [r["output_ids"] for r in reference]
    wait_idle(server)
