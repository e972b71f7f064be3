"""Constrained decoding on the host: grammars compiled with xgrammar, one matcher per request.

``GrammarBackend`` builds xgrammar's tokenizer info from the model's tokenizer (tokenizers'
``Tokenizer``, wrapped as a transformers fast tokenizer) and compiles JSON schemas, regexes
and EBNF grammars, each text once (a dict keyed by (kind, text)). JSON is compiled without
free whitespace (SGLang's ``--constrained-json-disable-any-whitespace``): a model cannot
spend its tokens on indentation. ``RequestGrammar`` is one
request's matcher: the scheduler advances it with every output token and fills the step's
allowed-token bitmasks (``fill_masks``): for a verify step, position j's mask is the matcher
state after the first j drafts, found by advancing through the drafts and rolling back.

Bitmasks are xgrammar's: int32 words, token t allowed iff bit t % 32 of word t // 32 is set.
xgrammar (which imports torch) is imported only when the first grammar is compiled.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from lazyspec.scheduler.request import GRAMMAR_FIELDS as GRAMMAR_KINDS

# response_format {"type": "json_object"}: any JSON object
JSON_OBJECT_SCHEMA = json.dumps({"type": "object"})


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


class GrammarBackend:
    """Compiles grammars against one tokenizer; thread-safe (the server compiles in its
    parse pool, the engine thread then finds the result cached)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        if tokenizer is None:
            raise ValueError("constrained decoding needs the model's tokenizer.json")
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_ids = list(stop_ids)
        self._compiler = None
        self._compiled: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def _compiler_now(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar
                from transformers import PreTrainedTokenizerFast

                wrapped = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer)
                info = xgrammar.TokenizerInfo.from_huggingface(
                    wrapped, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar of ``text``; ValueError with xgrammar's message if it is
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
            if kind == "json_schema":
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            else:
                compiled = compiler.compile_grammar(text)
        except Exception as exc:  # xgrammar raises RuntimeError for every parse failure
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
        import xgrammar

        compiled = self.compile(kind, text)
        return RequestGrammar(xgrammar.GrammarMatcher(compiled), mask_width(self.vocab_size))


def _first_line(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else repr(exc)
    # xgrammar prefixes "[time] file.cc:line: "; the message follows
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


@dataclass
class RequestGrammar:
    """One request's grammar matcher. Mutated only by the scheduler's result pass
    (``accept``) and the mask fill, which rolls back whatever it advanced."""

    matcher: Any  # xgrammar.GrammarMatcher
    width: int  # int32 words per bitmask

    def accept(self, token: int) -> bool:
        """Advance by one output token; False if the grammar does not allow it."""
        return bool(self.matcher.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: the request ends."""
        return bool(self.matcher.is_terminated())

    def fill_masks(self, out: np.ndarray, drafts: list[int]) -> None:
        """``out [1 + len(drafts), width]``: row j = the tokens allowed after the first j
        drafts. Rows past a draft the grammar refuses keep the last filled mask (that draft
        is then rejected by the verify step, so those positions emit nothing). The matcher
        ends where it started."""
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
