"""64 concurrent streaming clients x 3 requests each over loopback: mixed prompt lengths,
prompts that share prefixes, greedy with ignore_eos. Every request completes with exactly
its token count and the tokens of a one-batch reference run, no chunk is lost or repeated,
and after the drain and a flush every slot and page is free."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np

from tests.server.conftest import assert_all_free, random_ids, wait_idle

NUM_CLIENTS = 64
REQUESTS_PER_CLIENT = 3
MAX_NEW_CHOICES = (3, 6, 10, 16)


def _prompts(vocab: int) -> list[list[int]]:
    """24 prompts: 4 shared 70-token prefixes x 4 suffixes, plus 8 unrelated ones."""
    rng = np.random.default_rng(40)
    prompts = []
    for _ in range(4):
        prefix = random_ids(rng, 70, vocab)
        prompts += [prefix + random_ids(rng, int(rng.integers(1, 60)), vocab) for _ in range(4)]
    prompts += [random_ids(rng, int(rng.integers(2, 140)), vocab) for _ in range(8)]
    return prompts


def _body(prompt: list[int], max_new: int, stream: bool) -> dict:
    return {
        "input_ids": prompt,
        "stream": stream,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }


async def _one_stream(client: httpx.AsyncClient, prompt: list[int], max_new: int) -> dict:
    """One streamed request, checked chunk by chunk; returns its last chunk."""
    chunks, done = [], False
    async with client.stream("POST", "/generate", json=_body(prompt, max_new, True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line:
                continue
            assert not done, "data after [DONE]"
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            if chunks:
                previous = chunks[-1]["output_ids"]
                assert previous[:] == chunk["output_ids"][: len(previous)], "tokens changed"
                assert len(chunk["output_ids"]) > len(previous), "a chunk repeated"
                assert chunks[-1]["meta_info"]["finish_reason"] is None, "chunk after finish"
            chunks.append(chunk)
    assert done and chunks
    return chunks[-1]


async def _client(url: str, prompts: list[list[int]], plan: list[tuple[int, int]]) -> list:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        for index, max_new in plan:
            out.append((index, max_new, await _one_stream(client, prompts[index], max_new)))
    return out


async def _load(url: str, prompts: list[list[int]], plans: list) -> list:
    results = await asyncio.gather(*(_client(url, prompts, plan) for plan in plans))
    return [r for per_client in results for r in per_client]


def test_64_streaming_clients_get_every_token_and_leave_nothing_behind(server):
    vocab = server.tokenizer.get_vocab_size()
    prompts = _prompts(vocab)
    reference = httpx.post(
        f"{server.url}/generate",
        timeout=300,
        json={
            "input_ids": prompts,
            "sampling_params": {
                "max_new_tokens": max(MAX_NEW_CHOICES),
                "temperature": 0,
                "ignore_eos": True,
            },
        },
    ).json()
    assert len(reference) == len(prompts)
    wait_idle(server)
    compiled = server.worker.call(lambda engine: engine.num_compiled()).result(30)
    rng = np.random.default_rng(41)
    plans = [
        [
            (int(rng.integers(len(prompts))), int(rng.choice(MAX_NEW_CHOICES)))
            for _ in range(REQUESTS_PER_CLIENT)
        ]
        for _ in range(NUM_CLIENTS)
    ]

    results = asyncio.run(_load(server.url, prompts, plans))

    assert len(results) == NUM_CLIENTS * REQUESTS_PER_CLIENT
    ids = {last["meta_info"]["id"] for _, _, last in results}
    assert len(ids) == len(results), "two requests share an id"
    hits = 0
    for index, max_new, last in results:
        meta = last["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": max_new}
        assert meta["completion_tokens"] == len(last["output_ids"]) == max_new
        assert last["output_ids"] == reference[index]["output_ids"][:max_new]
        assert meta["prompt_tokens"] == len(prompts[index])
        hits += meta["cached_tokens"] > 0
    assert hits > 0, "shared prefixes never hit the cache"
    info = wait_idle(server)
    assert info["free_state_slots"] + info["cached_state_slots"] == info["state_slots"]
    server.worker.call(lambda engine: engine.check_integrity()).result(30)  # raises if broken
    # every batch shape was compiled at start-up: serving under load compiled nothing new
    assert server.worker.call(lambda engine: engine.num_compiled()).result(30) == compiled
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
    assert_all_free(server.info())


def test_bench_serving_script_measures_a_shared_prefix_run(server, tmp_path, capsys):
    from lazyspec.bench import serving as bench

    summary = bench.main(
        [
            "--url",
            server.url,
            "--num-groups",
            "2",
            "--prompts-per-group",
            "6",
            "--prefix-len",
            "140",
            "--suffix-len",
            "20",
            "--output-len",
            "5",
            "--concurrency",
            "6",
            "--flush",
            "--json-out",
            str(tmp_path / "s.json"),
        ]
    )
    assert summary["completed"] == summary["requests"] == 12 and not summary["errors"]
    assert summary["output_tokens"] == 60
    # every group's first admitted request misses; later ones reuse a checkpoint of the
    # shared 140-token prefix: the one at 128, or at 64 for a request admitted between its
    # group's first request's two prefill chunks (checkpoints go in after every chunk, on
    # the 64-token grid)
    assert 0 < summary["cached_tokens"] <= 10 * 128 and summary["cached_tokens"] % 64 == 0
    assert summary["cache_hit_rate"] == summary["cached_tokens"] / summary["prompt_tokens"]
    assert summary["ttft_ms"]["p50"] > 0 and summary["itl_ms"]["mean"] > 0
    table = capsys.readouterr().out
    assert "TTFT" in table and "cache hit rate" in table
    assert json.loads((tmp_path / "s.json").read_text())["output_tokens"] == 60
