"""Constrained decoding on the host: grammars compiled with llguidance or xgrammar, one
matcher per request.

A ``GrammarBackend`` holds one tokenizer's view for its library and compiles JSON schemas,
regexes and EBNF grammars, each text once (a dict keyed by (kind, text)). JSON is compiled
without free whitespace (SGLang's ``--constrained-json-disable-any-whitespace``), with the
separators ", " and ": " on both backends: a model cannot spend its tokens on indentation.
``RequestGrammar`` is one request's matcher: the scheduler advances it with every output
token and fills the step's allowed-token bitmasks (``fill_masks``): for a verify step,
position j's mask is the matcher state after the first j drafts, found by advancing
through the drafts and rolling back.

Backends (``make_backend``; ``EngineConfig.grammar_backend``):

* ``llguidance`` (the default): a Rust library without dependencies. Its tokenizer is read
  from the model's tokenizer.json; a tokenizer whose decoder it does not recognise is read
  as a raw vocabulary (each token's text is its bytes, as xgrammar's RAW vocabulary type).
  A refused token would leave its matcher in an error state for good, so draft tokens are
  checked (``validate_tokens``) before any is consumed.
* ``xgrammar``: SGLang's default; needs torch, transformers and triton (``.[xgrammar]``).

Bitmasks are int32 words on both, token t allowed iff bit t % 32 of word t // 32 is set.
Each library is imported only when its backend is built.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lazyspec.scheduler.request import GRAMMAR_FIELDS as GRAMMAR_KINDS

logger = logging.getLogger(__name__)

# EngineConfig.grammar_backend's values; "none": grammar requests are refused
GRAMMAR_BACKENDS = ("llguidance", "xgrammar", "none")
# response_format {"type": "json_object"}: any JSON object
JSON_OBJECT_SCHEMA = json.dumps({"type": "object"})
# JSON's item and key separators without free whitespace (xgrammar's for any_whitespace=False)
JSON_SEPARATORS = (", ", ": ")


def mask_width(vocab_size: int) -> int:
    """Int32 words of one token bitmask over ``vocab_size`` ids."""
    return (vocab_size + 31) // 32


def grammar_of(params: Any) -> tuple[str, str] | None:
    """``(kind, text)`` of the one grammar field SamplingParams ``params`` sets, or None."""
    for kind in GRAMMAR_KINDS:
        text = getattr(params, kind)
        if text is not None:
            return kind, text
    return None


def make_backend(
    name: str, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]
) -> GrammarBackend | None:
    """The grammar backend ``name`` (one of ``GRAMMAR_BACKENDS``) over ``tokenizer`` (a
    tokenizers ``Tokenizer``); None for "none"."""
    if name == "none":
        return None
    backends = {"llguidance": LLGuidanceBackend, "xgrammar": XGrammarBackend}
    if name not in backends:
        raise ValueError(f"grammar backend {name!r} is not one of {GRAMMAR_BACKENDS}")
    backend = backends[name](tokenizer, vocab_size, stop_ids)
    if importlib.util.find_spec(name) is None:
        logger.warning("%s; grammar requests will be refused", backend.missing)
    return backend


class GrammarBackend:
    """Compiles grammars against one tokenizer; thread-safe (the server compiles in its
    parse pool, the engine thread then finds the result cached). A subclass per library
    builds its compiler (``_build``), compiles one text (``_compile``) and starts a
    request's matcher from a compiled grammar (``_matcher``)."""

    name = ""
    extra = ""  # the pyproject extra that installs the library

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        if tokenizer is None:
            raise ValueError("constrained decoding needs the model's tokenizer.json")
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_ids = [int(t) for t in stop_ids]
        self._compiler: Any = None
        self._compiled: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    @property
    def missing(self) -> str:
        """What to install when the library is not there."""
        return f"grammar backend {self.name} is not installed (pip install '.[{self.extra}]')"

    def _compiler_now(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    self._compiler = self._build()
                except ImportError:
                    raise ValueError(self.missing) from None
            return self._compiler

    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar of ``text``; ValueError with the library's message if it is
        malformed."""
        if kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind {kind!r} is not one of {GRAMMAR_KINDS}")
        if not isinstance(text, str):
            raise ValueError(f"{kind}={text!r} must be a string")
        key = (kind, text)
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        compiler = self._compiler_now()
        try:
            compiled = self._compile(compiler, kind, text)
        except Exception as exc:  # each library has its own exception types
            raise ValueError(f"invalid {kind}: {_first_line(exc)}") from None
        with self._lock:
            self._compiled[key] = compiled
        return compiled

    @property
    def num_grammars(self) -> int:
        """Distinct grammar texts compiled so far."""
        return len(self._compiled)

    def matcher(self, kind: str, text: str) -> RequestGrammar:
        """A fresh matcher of ``text`` for one request (compiled once per text)."""
        return self._matcher(self.compile(kind, text))

    def _build(self) -> Any:
        raise NotImplementedError

    def _compile(self, compiler: Any, kind: str, text: str) -> Any:
        raise NotImplementedError

    def _matcher(self, compiled: Any) -> RequestGrammar:
        raise NotImplementedError


class XGrammarBackend(GrammarBackend):
    """xgrammar's compiler over the tokenizer wrapped as a transformers fast tokenizer."""

    name = "xgrammar"
    extra = "xgrammar"

    def _build(self) -> Any:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        wrapped = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer)
        info = xgrammar.TokenizerInfo.from_huggingface(
            wrapped, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids
        )
        return xgrammar.GrammarCompiler(info, max_threads=1)

    def _compile(self, compiler: Any, kind: str, text: str) -> Any:
        if kind == "json_schema":
            return compiler.compile_json_schema(
                text, any_whitespace=False, separators=JSON_SEPARATORS
            )
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_grammar(text)

    def _matcher(self, compiled: Any) -> RequestGrammar:
        import xgrammar

        return XGrammarRequest(mask_width(self.vocab_size), xgrammar.GrammarMatcher(compiled))


class LLGuidanceBackend(GrammarBackend):
    """llguidance's tokenizer from the model's tokenizer.json; a compiled grammar is a
    matcher that has consumed nothing, which each request copies."""

    name = "llguidance"
    extra = "serve"

    def _build(self) -> Any:
        import llguidance

        try:
            return llguidance.LLTokenizer(
                self._tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=self._stop_ids
            )
        except ValueError as exc:  # a decoder it does not know (e.g. a bare Fuse)
            logger.info("llguidance reads the tokenizer as a raw vocabulary: %s", exc)
        wrapper = llguidance.TokenizerWrapper(
            _RawVocabulary(self._tokenizer, self.vocab_size, self._stop_ids)
        )
        return llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=self._stop_ids)

    def _compile(self, compiler: Any, kind: str, text: str) -> Any:
        import llguidance

        if kind == "json_schema":
            item, key = JSON_SEPARATORS
            options = {"whitespace_flexible": False, "item_separator": item, "key_separator": key}
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=options)
        elif kind == "regex":
            grammar = llguidance.grammar_from("regex", text)
        else:  # GBNF / EBNF (xgrammar's syntax), or a Lark grammar
            grammar = llguidance.grammar_from("ebnf", text)
        matcher = llguidance.LLMatcher(compiler, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(_llguidance_error(matcher.get_error()))
        return matcher

    def _matcher(self, compiled: Any) -> RequestGrammar:
        return LLGuidanceRequest(
            mask_width(self.vocab_size), compiled.deep_copy(), frozenset(self._stop_ids)
        )


class _RawVocabulary:
    """What ``llguidance.TokenizerWrapper`` reads of a tokenizer: each token's bytes (its
    text in UTF-8), the special ids and an encoder. The ids past the tokenizer's up to the
    model's ``vocab_size`` are special tokens without text (never allowed), so that every id
    a draft head proposes is in range."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        count = tokenizer.get_vocab_size(with_added_tokens=True)
        specials = {i for i, added in tokenizer.get_added_tokens_decoder().items() if added.special}
        specials |= set(range(count, vocab_size))
        self._tokenizer = tokenizer
        self.tokens = [
            b"" if i in specials else (tokenizer.id_to_token(i) or "").encode()
            for i in range(max(count, vocab_size))
        ]
        self.special_token_ids = sorted(specials)
        self.eos_token_id = stop_ids[0] if stop_ids else None
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def _llguidance_error(text: str) -> str:
    """llguidance's message in one line: its first line, and the line giving the cause
    where one follows (a regex error puts it below a picture of the pattern)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    causes = [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(lines[:1] + causes[:1])


def _first_line(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else repr(exc)
    # xgrammar prefixes "[time] file.cc:line: "; the message follows
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


@dataclass
class RequestGrammar:
    """One request's grammar matcher. Mutated only by the scheduler's result pass
    (``accept``) and the mask fill, which rolls back whatever it advanced."""

    width: int  # int32 words per bitmask

    def accept(self, token: int) -> bool:
        """Advance by one output token; False if the grammar does not allow it."""
        raise NotImplementedError

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: the request ends."""
        raise NotImplementedError

    def fill_masks(self, out: np.ndarray, drafts: list[int]) -> None:
        """``out [1 + len(drafts), width]``: row j = the tokens allowed after the first j
        drafts. Rows past a draft the grammar refuses keep the last filled mask (that draft
        is then rejected by the verify step, so those positions emit nothing); so do the
        rows past a stop token. The matcher ends where it started."""
        raise NotImplementedError


@dataclass
class XGrammarRequest(RequestGrammar):
    matcher: Any = None  # xgrammar.GrammarMatcher

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill_masks(self, out: np.ndarray, drafts: list[int]) -> None:
        advanced = 0
        for j in range(out.shape[0]):
            if self.matcher.is_terminated():
                out[j:] = out[j - 1] if j else 0
                break
            self.matcher.fill_next_token_bitmask(out, j)
            if j == len(drafts) or not self.matcher.accept_token(int(drafts[j])):
                out[j + 1 :] = out[j]
                break
            advanced += 1
        if advanced:
            self.matcher.rollback(advanced)


@dataclass
class LLGuidanceRequest(RequestGrammar):
    """An llguidance matcher. It stays ``is_stopped`` both before and after its stop token
    (it allows nothing else once the grammar is complete), so termination is tracked here:
    the last accepted token was a stop token."""

    matcher: Any = None  # llguidance.LLMatcher
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    ended: bool = False

    def accept(self, token: int) -> bool:
        token = int(token)
        if self.ended or not self.matcher.consume_token(token):
            return False
        self.ended = token in self.stop_ids
        return True

    @property
    def terminated(self) -> bool:
        return self.ended

    def _fill(self, row: np.ndarray) -> None:
        assert row.flags["C_CONTIGUOUS"] and row.dtype == np.int32, "a contiguous int32 row"
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def fill_masks(self, out: np.ndarray, drafts: list[int]) -> None:
        if self.ended:
            out[:] = 0
            return
        drafts = [int(t) for t in drafts[: out.shape[0] - 1]]
        # the drafts the grammar takes (up to a stop token): consuming a refused token
        # would leave the matcher in its error state, which a rollback does not undo
        valid = self.matcher.validate_tokens(drafts) if drafts else 0
        advanced = 0
        for j in range(out.shape[0]):
            self._fill(out[j])
            # past a refused draft or a stop token (never consumed here: a stop token taken
            # once the grammar is complete is not one rollback step) the mask repeats
            if j == valid or drafts[j] in self.stop_ids:
                out[j + 1 :] = out[j]
                break
            consumed = self.matcher.consume_token(drafts[j])
            assert consumed, self.matcher.get_error()
            advanced += 1
        if advanced:
            self.matcher.rollback(advanced)
