"""``n`` > 1 on /generate, /v1/completions and /v1/chat/completions: n samples of one prompt,
copy 0 prefilling it and the others matching its checkpoint; each copy with its own seed
stream (deterministic per seed), its own index and finish_reason, streamed too; and the
penalties accepted over HTTP."""

from __future__ import annotations

import json

import httpx
import numpy as np

from lazyspec.server.protocol import copy_seed
from tests.server.conftest import EOS_ID, SERVED_NAME, post, random_ids, v1_body

PROMPT_LEN = 150  # past two 64-token checkpoints of the server's engine
SAMPLED = {"temperature": 1.0, "ignore_eos": True}


def _prompt(server, seed: int) -> list[int]:
    return random_ids(np.random.default_rng(seed), PROMPT_LEN, server.tokenizer.get_vocab_size())


def test_generate_n_copies_match_the_first_ones_prefix(server):
    ids = _prompt(server, 30)
    params = {"max_new_tokens": 6, "n": 3, "seed": 11, **SAMPLED}
    results = post(server, "/generate", {"input_ids": ids, "sampling_params": params}).json()
    assert isinstance(results, list) and len(results) == 3
    cached = [r["meta_info"]["cached_tokens"] for r in results]
    assert cached == [0, 128, 128], cached  # the first prefills; the copies match its 128
    outputs = [tuple(r["output_ids"]) for r in results]
    assert len(set(outputs)) == 3 and all(len(o) == 6 for o in outputs)
    # copy j is the request seeded copy_seed(11, j): deterministic, whatever the batch
    for j, output in enumerate(outputs):
        alone = {"max_new_tokens": 6, "seed": copy_seed(11, j), **SAMPLED}
        single = post(server, "/generate", {"input_ids": ids, "sampling_params": alone}).json()
        assert tuple(single["output_ids"]) == output, j


def test_completions_n_gives_indexed_choices_and_counts_the_prompt_once(server):
    ids = _prompt(server, 31)
    body = {"model": SERVED_NAME, "prompt": [ids, ids[:40]], "max_tokens": 5, "n": 2, "seed": 3}
    first = post(server, "/v1/completions", {**body, **SAMPLED}).json()
    again = post(server, "/v1/completions", {**body, **SAMPLED}).json()
    choices = first["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in choices)
    assert [c["text"] for c in choices] == [c["text"] for c in again["choices"]]
    assert choices[0]["text"] != choices[1]["text"]
    assert first["usage"]["prompt_tokens"] == PROMPT_LEN + 40
    assert first["usage"]["completion_tokens"] == 4 * 5
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 128


def test_chat_n_streams_every_choice(server):
    path = "/v1/chat/completions"
    body = v1_body(path, "draft tokens are verified in one pass", max_tokens=6, n=3, seed=8)
    body.update(SAMPLED)
    whole = post(server, path, body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    texts, roles, finishes = ["", "", ""], set(), {}
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        (choice,) = json.loads(line[len("data: ") :])["choices"]
        i = choice["index"]
        roles |= {i} if choice["delta"].get("role") == "assistant" else set()
        texts[i] += choice["delta"].get("content", "")
        if choice["finish_reason"] is not None:
            finishes[i] = choice["finish_reason"]
    assert roles == {0, 1, 2} and finishes == {0: "length", 1: "length", 2: "length"}
    assert texts == [c["message"]["content"] for c in whole["choices"]]


def test_best_of_and_n_out_of_range_are_400(server):
    for body, words in [
        ({"n": 1, "best_of": 3}, "best_of=3 is not supported"),
        ({"n": 0}, "n=0 must be in [1, 128]"),
        ({"n": 129}, "n=129 must be in [1, 128]"),
    ]:
        response = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, **body})
        assert response.status_code == 400 and words in response.json()["error"]["message"]
    ok = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2, "best_of": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_penalties_change_greedy_output_over_http(server):
    ids = _prompt(server, 32)
    base = {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = post(server, "/v1/completions", base).json()["choices"][0]["text"]
    penalized = {**base, "frequency_penalty": 2.0, "presence_penalty": 1.0}
    response = post(server, "/v1/completions", penalized)
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] != plain
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    generate = {"input_ids": ids, "sampling_params": {**params, "repetition_penalty": 1.5}}
    assert post(server, "/generate", generate).status_code == 200


def _oracle_logprobs(server, ids: list[int]) -> np.ndarray:
    from lazyspec.models import load_model, reference_logits

    logits = reference_logits(load_model(server.model_dir), ids).astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def test_generate_prompt_logprobs_from_logprob_start_len(server):
    """A prompt cached up to 128 asked again for logprobs from token 100 on: the cache is
    matched only below that (64), and the logprobs equal a cache-free recompute."""
    ids = _prompt(server, 33)
    params = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    post(server, "/generate", {"input_ids": ids, "sampling_params": params})
    body = {
        "input_ids": ids,
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": 100,
        "top_logprobs_num": 2,
    }
    meta = post(server, "/generate", body).json()["meta_info"]
    assert meta["cached_tokens"] == 64
    pairs = meta["input_token_logprobs"]
    assert [t for _, t, _ in pairs] == ids[100:]
    oracle = _oracle_logprobs(server, ids)
    want = [oracle[j - 1, ids[j]] for j in range(100, PROMPT_LEN)]
    np.testing.assert_allclose([lp for lp, _, _ in pairs], want, atol=1e-4)
    tops = meta["input_top_logprobs"]
    assert [top[0][1] for top in tops] == [int(np.argmax(oracle[j - 1])) for j in range(100, 150)]
    too_far = {**body, "logprob_start_len": PROMPT_LEN}
    response = post(server, "/generate", too_far)
    assert response.status_code == 400 and "logprob_start_len=150" in response.text


def test_completions_echo_with_logprobs_scores_the_prompt(server):
    ids = _prompt(server, 34)[:20]
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
    logprobs = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 23
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    oracle = _oracle_logprobs(server, ids)
    want = [oracle[j - 1, ids[j]] for j in range(1, 20)]
    np.testing.assert_allclose(logprobs["token_logprobs"][1:20], want, atol=1e-4)
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    first = json.loads(lines[0][len("data: ") :])["choices"][0]
    assert first["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][:20]


def _offsets_index_text(text: str, logprobs: dict) -> list[tuple[int, str]]:
    """The (offset, token) pairs whose token is not at its text_offset in ``text``."""
    pairs = zip(logprobs["text_offset"], logprobs["tokens"])
    return [
        (at, token)
        for at, token in pairs
        if "\ufffd" not in token and text[at : at + len(token)] != token
    ]


def test_echo_offsets_index_the_text_with_a_bos(server):
    """A BOS the tokenizer added (here sent as an id) is not in ``text``: it is left out of
    ``tokens`` too, so every text_offset indexes ``text``, whole or streamed."""
    eos = "<|endoftext|>"
    ids = [EOS_ID, *server.tokenizer.encode("the state of a slot").ids]
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert eos not in logprobs["tokens"] and eos not in choice["text"], logprobs["tokens"]
    assert len(logprobs["tokens"]) == len(ids) - 1 + 3
    assert _offsets_index_text(choice["text"], logprobs) == []
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        chunks = [
            json.loads(line[len("data: ") :])["choices"][0]
            for line in response.iter_lines()
            if line.startswith("data: {")
        ]
    text = "".join(c["text"] for c in chunks)
    assert text == choice["text"]
    for chunk in chunks:
        if chunk["logprobs"] is not None:
            assert _offsets_index_text(text, chunk["logprobs"]) == [], chunk


def test_every_bit_of_a_64_bit_seed_counts(server):
    body = {"prompt": "the state of", "max_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    texts = {}
    for seed in (1, 2**32 + 1, 2**40 + 1, 2**63 + 1, -1):
        out = post(server, "/v1/completions", {**body, "seed": seed}).json()
        texts[seed] = out["choices"][0]["text"]
    assert len(set(texts.values())) == len(texts), texts
    again = post(server, "/v1/completions", {**body, "seed": 2**40 + 1}).json()
    assert again["choices"][0]["text"] == texts[2**40 + 1]
    from lazyspec.scheduler.batch import seed_bits

    assert [seed_bits(s) for s in (0, 1, 2**32 - 1)] == [0, 1, 2**32 - 1]  # kept as they were
    assert seed_bits(-1) == seed_bits(2**64 - 1)  # two's complement: one 64-bit seed
