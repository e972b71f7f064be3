"""Constrained decoding: grammar bitmasks applied on the device, every strategy, spec on / off.

The tiny model has random weights, so only the mask makes its output valid. A character
tokenizer (printable ASCII, one token per character) fits its 128-token vocabulary. Every
test runs on both grammar backends (llguidance reads that tokenizer as a raw vocabulary);
the embedded model's byte-level tokenizer checks that both allow the same tokens.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import lazyspec
from lazyspec.engine.engine import Engine
from lazyspec.scheduler.grammar import LLGuidanceBackend, make_backend, mask_width
from lazyspec.scheduler.request import SamplingParams
from lazyspec.testing.char_tokenizer import char_tokenizer
from lazyspec.testing.scripted_drafter import make_script, scripted_model
from lazyspec.testing.tiny_models import SPEC, _logits_at, small_engine, tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["ab", "xyz"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
REGEX = r"[a-f]{2,5}-[0-9]{3}"
BACKENDS = ("llguidance", "xgrammar")


@pytest.fixture(scope="module")
def model():
    base = tiny_model("qwen3_next")
    return SimpleNamespace(**{**vars(base), "tokenizer": char_tokenizer()})


@pytest.fixture(scope="module", params=BACKENDS)
def backend_name(request) -> str:
    return request.param


def _backend(model, name: str):
    return make_backend(name, model.tokenizer, model.config.vocab_size, (2,))


def _engine(model, strategy: str, spec: bool, backend: str) -> Engine:
    return small_engine(model, strategy, strategy != "no_buffer", spec, grammar_backend=backend)


def constrained_greedy(model, backend, prompt, kind, text, max_new) -> list[int]:
    """The cache-free oracle: argmax of the masked logits, one matcher step at a time."""
    grammar = backend.matcher(kind, text)
    words = np.zeros((1, mask_width(model.config.vocab_size)), np.int32)
    ids, out = list(prompt), []
    for _ in range(max_new):
        tokens = np.zeros((1, 256), np.int32)
        tokens[0, : len(ids)] = ids
        logits = _logits_at(
            model.family, model.config, model.params, jnp.asarray(tokens), len(ids) - 1
        )
        grammar.fill_masks(words, [])
        allowed = np.unpackbits(words[0].view(np.uint8), bitorder="little")
        logits = np.where(allowed[: logits.shape[-1]] == 1, np.asarray(logits)[0], -np.inf)
        token = int(np.argmax(logits))
        out.append(token)
        ids.append(token)
        assert grammar.accept(token)
        if grammar.terminated:
            break
    return out


@pytest.fixture(scope="module")
def case(model, backend_name):
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(3, 128, size=n))) for n in (7, 40, 19)]
    backend = _backend(model, backend_name)
    schema = json.dumps(SCHEMA)
    want = [
        constrained_greedy(model, backend, prompts[0], "json_schema", schema, 48),
        constrained_greedy(model, backend, prompts[1], "regex", REGEX, 48),
    ]
    return prompts, schema, want


@pytest.mark.parametrize(
    "strategy,spec",
    [
        ("extra_buffer", True),
        ("extra_buffer_lazy", True),
        ("no_buffer", False),
        ("extra_buffer", False),
        ("extra_buffer_lazy", False),
    ],
)
def test_constrained_outputs_parse_and_equal_the_masked_oracle(
    model, backend_name, case, strategy, spec
):
    prompts, schema, want = case
    engine = _engine(model, strategy, spec, backend_name)
    sampled = {"temperature": 1.0, "seed": 5, "json_schema": schema}
    params = [{"json_schema": schema}, {"regex": REGEX}, sampled]
    reqs = [
        engine.add_request(input_ids=p, sampling_params={"max_new_tokens": 48, **extra})
        for p, extra in zip(prompts, params)
    ]
    engine.run_until_done(reqs, check=lambda e: e.check_integrity())
    for req in reqs:
        assert req.finish_reason["type"] == "stop", (req.finish_reason, req.output_ids)
        assert req.output_ids[-1] == 2  # the grammar's stop token ends it
    texts = [engine.result(req)["text"] for req in reqs]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(REGEX, texts[1]), texts[1]
    jsonschema.validate(json.loads(texts[2]), SCHEMA)
    assert reqs[0].output_ids == want[0]
    assert reqs[1].output_ids == want[1]
    assert engine.grammar_backend.num_grammars == 2  # the schema once, the regex once
    assert engine.grammar_backend.name == backend_name


def test_masks_follow_the_drafts_and_the_matcher_rolls_back(model, backend_name):
    """Verify position j's mask is the state after the first j drafts; a refused draft
    repeats its position's mask, and so do the positions past a stop token; the matcher
    ends where it started."""
    backend = _backend(model, backend_name)
    grammar = backend.matcher("regex", "ab[0-9]c")
    ids = {c: model.tokenizer.token_to_id(c) for c in "abc07"}

    def allowed(row):
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits).tolist())

    words = np.zeros((4, mask_width(model.config.vocab_size)), np.int32)
    grammar.fill_masks(words, [ids["a"], ids["b"], ids["7"]])
    digits = {model.tokenizer.token_to_id(c) for c in "0123456789"}
    assert allowed(words[0]) == {ids["a"]}
    assert allowed(words[1]) == {ids["b"]}
    assert allowed(words[2]) == digits
    assert allowed(words[3]) == {ids["c"]}
    words[:] = 0
    grammar.fill_masks(words, [ids["a"], ids["c"], ids["7"]])  # "c" is refused after "a"
    assert allowed(words[1]) == allowed(words[2]) == allowed(words[3]) == {ids["b"]}
    # a draft id past the tokenizer's tokens (the model's vocabulary is larger) is refused
    beyond = model.config.vocab_size - 1
    assert model.tokenizer.id_to_token(beyond) is None
    grammar.fill_masks(words, [ids["a"], beyond, ids["7"]])
    assert allowed(words[1]) == allowed(words[2]) == allowed(words[3]) == {ids["b"]}
    assert grammar.accept(ids["a"])  # the matcher was rolled back to the start
    for token in (ids["b"], ids["0"]):
        assert grammar.accept(token)
    words[:] = 0
    grammar.fill_masks(words, [ids["c"], 2, ids["a"]])  # the stop token, then past it
    assert allowed(words[0]) == {ids["c"]}
    assert allowed(words[1]) == allowed(words[2]) == allowed(words[3]) == {2}
    assert not grammar.terminated
    assert grammar.accept(ids["c"]) and not grammar.terminated
    assert not grammar.accept(ids["a"])  # the grammar is complete: only its stop token
    fresh = backend.matcher("regex", "ab[0-9]c")
    for token in (ids["a"], ids["b"], ids["7"], ids["c"], 2):
        assert fresh.accept(token)
    assert fresh.terminated
    fresh.fill_masks(words[:2], [ids["a"]])  # a terminated matcher allows nothing
    assert not words[:2].any()


def test_grammar_fields_are_validated(model, backend_name):
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams.from_dict({"regex": "a", "ebnf": 'root ::= "a"'})
    with pytest.raises(ValueError, match="must be a string"):
        SamplingParams.from_dict({"json_schema": {"type": "object"}})
    backend = _backend(model, backend_name)
    with pytest.raises(ValueError, match="invalid regex"):
        backend.compile("regex", "a(b")
    with pytest.raises(ValueError, match="invalid json_schema"):
        backend.compile("json_schema", '{"type": "object"')
    with pytest.raises(ValueError, match="invalid ebnf"):
        backend.compile("ebnf", 'root ::= "a" missing')
    assert backend.matcher("ebnf", 'root ::= "a" [0-9]').accept(model.tokenizer.token_to_id("a"))
    assert backend.compile("regex", "ab") is backend.compile("regex", "ab")  # cached by text


def test_a_backend_without_its_library_names_the_extra_to_install(model):
    """A grammar request on a backend whose library is missing is a ValueError (a 400)
    naming the extra, not an ImportError (a 500)."""

    class Missing(LLGuidanceBackend):
        def _build(self):
            raise ImportError("No module named 'llguidance'")

    backend = Missing(model.tokenizer, model.config.vocab_size, (2,))
    with pytest.raises(
        ValueError, match=r"llguidance is not installed \(pip install '\.\[serve\]'\)"
    ):
        backend.compile("regex", "a+")


def test_drafts_the_grammar_allows_are_accepted(model, backend_name, case):
    """With drafts that follow the constrained greedy output (a scripted draft head, a few
    positions corrupted), verify steps accept up to D tokens under a grammar: position j is
    masked with the state after the first j drafts, so the right drafts stay allowed."""
    prompts, schema, want = case
    script = make_script(prompts[0] + want[0], 256, 0.1, model.config.vocab_size, seed=2)
    scripted = scripted_model(model, script)
    scripted.tokenizer = model.tokenizer
    engine = _engine(scripted, "extra_buffer", True, backend_name)
    req = engine.add_request(
        input_ids=prompts[0], sampling_params={"max_new_tokens": 48, "json_schema": schema}
    )
    engine.run_until_done([req])
    assert req.output_ids == want[0]
    num_verify = SPEC["speculative_num_steps"] + 1
    assert req.accept_hist.count(num_verify) >= 3, req.accept_hist
    assert len(req.accept_hist) < len(want[0]) / 2, req.accept_hist


@pytest.mark.parametrize(
    "kind,text",
    [
        ("json_schema", json.dumps(SCHEMA)),
        ("regex", r"(café|naïve) [0-9]{2,4}\n"),
        ("ebnf", 'root ::= "say " word ("," " " word)* "."\nword ::= [a-z]+'),
    ],
)
def test_both_backends_agree_on_a_byte_level_tokenizer(kind, text):
    """On the embedded model's byte-level BPE (which llguidance reads from tokenizer.json),
    along random walks: llguidance allows a subset of xgrammar's tokens, never none; where
    the grammar forces bytes it allows only their canonical tokens (xgrammar also allows
    their other spellings, e.g. "o" then "k" for "ok"); where the grammar leaves a choice
    (a digit, a letter) both allow the same tokens."""
    from tokenizers import Tokenizer

    folder = Path(lazyspec.__file__).parent / "assets" / "default_model"
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    backends = [make_backend(name, tokenizer, vocab, (0,)) for name in BACKENDS]
    rng = np.random.default_rng(0)
    same = 0
    for _ in range(4):
        grammars = [backend.matcher(kind, text) for backend in backends]
        words = np.zeros((len(grammars), 1, mask_width(vocab)), np.int32)
        for _ in range(48):
            for grammar, rows in zip(grammars, words):
                grammar.fill_masks(rows, [])
            bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
            ours, theirs = (set(np.flatnonzero(b[0]).tolist()) for b in bits)
            assert ours and ours <= theirs, [tokenizer.id_to_token(t) for t in ours - theirs]
            same += ours == theirs and len(ours) > 1
            token = int(rng.choice(sorted(ours)))
            assert all(grammar.accept(token) for grammar in grammars)
            if token == 0:
                assert all(grammar.terminated for grammar in grammars)
                break
    assert same >= 8, same
