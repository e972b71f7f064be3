"""The official ``openai`` client against the live server: completions, chat, streaming,
logprobs, stop strings, seeds, and usage with cached_tokens from the prefix cache."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.server.conftest import SERVED_NAME, random_ids, wait_idle

IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(client: openai.OpenAI, prompt, max_tokens: int, **kw):
    """A greedy completion of ``prompt`` with EOS ignored; ``kw`` adds request fields."""
    return client.completions.create(
        model=SERVED_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body=IGNORE_EOS,
        **kw,
    )


def _chat(client: openai.OpenAI, messages: list[dict], max_tokens: int, **kw):
    """A greedy chat completion of ``messages`` with EOS ignored; ``kw`` adds request
    fields."""
    return client.chat.completions.create(
        model=SERVED_NAME,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body=IGNORE_EOS,
        **kw,
    )


def _generate(server, input_ids: list[int], max_new: int) -> dict:
    body = {
        "input_ids": input_ids,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }
    response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _vocab(server) -> int:
    return server.tokenizer.get_vocab_size()


def test_models_lists_the_served_name(client):
    names = [m.id for m in client.models.list().data]
    assert names == [SERVED_NAME]


def test_greedy_completion_equals_cache_free_recompute(server, client):
    """Token ids from /generate are the argmax of a cache-free recompute and their logprobs
    match it; /v1/completions returns the same text, tokens and logprobs."""
    from lazyspec.models import load_model, reference_logits

    prompt = random_ids(np.random.default_rng(10), 40, _vocab(server))
    num_new = 12
    out = _generate(server, prompt, num_new)
    ids = out["output_ids"]
    served_lp = np.array([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    logits = reference_logits(load_model(server.model_dir), prompt + ids)[len(prompt) - 1 : -1]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ref_lp = logp[np.arange(num_new), ids]
    assert np.all(ref_lp >= logp.max(-1) - 1e-5), "a served token is not the argmax"
    assert np.max(np.abs(ref_lp - served_lp)) <= 1e-4

    wait_idle(server)
    completion = _complete(client, prompt, num_new, logprobs=1)
    choice = completion.choices[0]
    assert choice.text == server.tokenizer.decode(ids)
    assert choice.finish_reason == "length"
    assert choice.logprobs.tokens == [
        server.tokenizer.decode([t], skip_special_tokens=False) for t in ids
    ]
    assert np.max(np.abs(np.array(choice.logprobs.token_logprobs) - served_lp)) <= 1e-6
    assert [
        list(d.values())[0] for d in choice.logprobs.top_logprobs
    ] == choice.logprobs.token_logprobs
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (40, num_new)
    assert usage.total_tokens == 40 + num_new
    assert usage.prompt_tokens_details.cached_tokens == 0  # 40 < interval: no checkpoint


def test_chat_uses_the_template_and_streams_the_same_text(server, client):
    messages = [
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": "the café holds a checkpoint?"},
    ]
    rendered = (
        "<|im_start|>system\nyou are terse<|im_end|>\n<|im_start|>user\nthe café holds "
        "a checkpoint?<|im_end|>\n<|im_start|>assistant\n"
    )
    prompt = server.tokenizer.encode(rendered, add_special_tokens=False).ids
    chat = _chat(client, messages, 10)
    assert chat.usage.prompt_tokens == len(prompt)
    assert chat.usage.completion_tokens == 10
    expected = _generate(server, prompt, 10)
    assert chat.choices[0].message.content == expected["text"]
    assert chat.choices[0].message.role == "assistant"

    chunks = list(_chat(client, messages, 10, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["text"]
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(prompt)


def test_streamed_completion_equals_the_whole_one(server, client):
    prompt = random_ids(np.random.default_rng(11), 30, _vocab(server))
    whole = _complete(client, prompt, 16)
    stream = _complete(client, prompt, 16, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_logprobs_match_generate(server, client):
    messages = [{"role": "user", "content": "draft tokens are verified"}]
    chat = _chat(client, messages, 8, logprobs=True, top_logprobs=1)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 8
    for item in content:
        assert item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == item.logprob
        assert bytes(item.bytes).decode("utf-8") == item.token
    rendered = "<|im_start|>user\ndraft tokens are verified<|im_end|>\n<|im_start|>assistant\n"
    expected = _generate(server, server.tokenizer.encode(rendered, add_special_tokens=False).ids, 8)
    served = np.array([item.logprob for item in content])
    reference = np.array([lp for lp, _, _ in expected["meta_info"]["output_token_logprobs"]])
    assert np.max(np.abs(served - reference)) <= 1e-6


def test_top_logprobs_match_cache_free_recompute(server, client):
    """/generate's top_logprobs_num=3 alternatives are the 3 largest log-probabilities of a
    cache-free recompute, most likely first; completions (logprobs=3) and chat
    (top_logprobs=3) serve the same alternatives."""
    from lazyspec.models import load_model, reference_logits

    prompt = random_ids(np.random.default_rng(12), 30, _vocab(server))
    num_new = 6
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "top_logprobs_num": 3,
        "sampling_params": {"max_new_tokens": num_new, "temperature": 0, "ignore_eos": True},
    }
    response = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()
    ids, tops = out["output_ids"], out["meta_info"]["output_top_logprobs"]
    assert len(tops) == num_new and all(len(top) == 3 for top in tops)
    logits = reference_logits(load_model(server.model_dir), prompt + ids)[len(prompt) - 1 : -1]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    for position, top in enumerate(tops):
        values = np.array([v for v, _, _ in top])
        assert np.all(np.diff(values) <= 0)
        assert top[0][1] == ids[position]  # greedy: the sampled token is the most likely
        want = np.sort(logp[position])[::-1][:3]
        assert np.max(np.abs(values - want)) <= 1e-4
        assert np.max(np.abs(logp[position, [t for _, t, _ in top]] - values)) <= 1e-4

    wait_idle(server)
    completion = _complete(client, prompt, num_new, logprobs=3)
    decode = lambda t: server.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    compared = 0
    for position, served in enumerate(completion.choices[0].logprobs.top_logprobs):
        texts = [decode(t) for _, t, _ in tops[position]]
        assert served.keys() == set(texts)
        for text, (value, _, _) in zip(texts, tops[position]):
            if texts.count(text) == 1:  # distinct ids can share a text (partial UTF-8 bytes)
                assert abs(served[text] - value) <= 1e-6, (position, text)
                compared += 1
    assert compared >= num_new
    wait_idle(server)
    chat = _chat(
        client, [{"role": "user", "content": "alternatives"}], 4, logprobs=True, top_logprobs=3
    )
    for item in chat.choices[0].logprobs.content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token
        assert [alt.logprob for alt in item.top_logprobs] == sorted(
            (alt.logprob for alt in item.top_logprobs), reverse=True
        )


def test_same_long_prompt_twice_hits_the_checkpoint(server, client):
    """Interval 64, prompt 150 tokens: the second request reuses the checkpoint at 128."""
    prompt = random_ids(np.random.default_rng(12), 150, _vocab(server))
    results = []
    for _ in range(2):
        results.append(_complete(client, prompt, 8))
        wait_idle(server)
    first, second = results
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 128
    assert second.choices[0].text == first.choices[0].text
    assert second.usage.prompt_tokens == 150


def _stop_candidate(text: str) -> str | None:
    for start in range(4, len(text) - 3):
        piece = text[start : start + 3]
        if "\ufffd" not in piece and piece.strip() == piece and piece:
            return piece
    return None


def test_stop_string_cuts_the_text_and_frees_the_request(server, client):
    rng = np.random.default_rng(13)
    for _ in range(10):
        prompt = random_ids(rng, 20, _vocab(server))
        full = _complete(client, prompt, 24).choices[0].text
        stop = _stop_candidate(full)
        if stop:
            break
    assert stop, "no usable stop string in ten greedy outputs"
    expected = full[: full.find(stop)]
    cut = _complete(client, prompt, 24, stop=[stop, "\x00never"])
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    streamed = _complete(client, prompt, 24, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected
    info = wait_idle(server)
    assert info["free_state_slots"] + info["cached_state_slots"] == info["state_slots"]


def test_seed_makes_sampling_repeatable(server, client):
    prompt = random_ids(np.random.default_rng(14), 16, _vocab(server))

    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=SERVED_NAME,
                prompt=prompt,
                max_tokens=16,
                temperature=0.9,
                top_p=0.95,
                seed=seed,
                extra_body=IGNORE_EOS,
            )
            .choices[0]
            .text
        )

    a, b, c = sample(11), sample(11), sample(12)
    assert a == b
    assert a != c


def test_two_prompts_give_two_indexed_choices(server, client):
    rng = np.random.default_rng(15)
    prompts = [random_ids(rng, 12, _vocab(server)), random_ids(rng, 25, _vocab(server))]
    both = _complete(client, prompts, 6)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.usage.prompt_tokens == 37 and both.usage.completion_tokens == 12
    for choice, prompt in zip(both.choices, prompts):
        assert choice.text == _generate(server, prompt, 6)["text"]


# ---------------------------------------------------------------- text side, no server


def test_text_stream_holds_split_characters_and_stop_prefixes(model_dir):
    from lazyspec.models.loader import load_tokenizer
    from lazyspec.server.text_stream import TextStream

    tokenizer = load_tokenizer(model_dir)
    # "é" as two single-byte tokens (byte-level alphabet: 0xC3 -> "Ã", 0xA9 -> "©")
    first, second = tokenizer.token_to_id("Ã"), tokenizer.token_to_id("©")
    plain = tokenizer.encode("caf").ids
    stream = TextStream(tokenizer)
    deltas = [stream.push([t]) for t in plain] + [stream.push([first]), stream.push([second])]
    assert deltas[-2] == "" and deltas[-1] == "é"
    assert "".join(deltas) == "café" and "\ufffd" not in "".join(deltas)

    ids = tokenizer.encode("the state of a recurrent layer is copied").ids
    stream = TextStream(tokenizer, stop=("of a r", "zzz"))
    shown = ""
    for token in ids:
        shown += stream.push([token])
        assert "the state ".startswith(shown), shown  # no part of the stop string leaks
        if stream.stopped:
            break
    assert shown == "the state " and stream.stopped == "of a r"
    assert stream.push(ids[:2], final=True) == ""  # nothing after a stop


def test_chat_template_fallback_and_template_errors():
    from lazyspec.server.chat import ChatTemplate, parse_messages
    from lazyspec.server.limits import ApiError

    messages = parse_messages(
        [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}],
            },
        ]
    )
    assert ChatTemplate(None).render(messages) == "system: be brief\nuser: hi\nassistant:"
    strict = ChatTemplate(
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('no system messages') }}{% endif %}ok"
    )
    with pytest.raises(ApiError, match="no system messages"):
        strict.render(messages)
    assert strict.render(messages[1:]) == "ok"
    with pytest.raises(ApiError):
        ChatTemplate("{{ messages[5]['content'].upper() }}").render(messages)
