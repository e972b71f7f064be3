"""SGLang's ``stop_regex``: generation stops when the output text matches one of the
patterns (Python ``re`` syntax, searched anywhere in the output), and the text is cut where
the match starts (``no_stop_trim``: where it ends).

A stream may not show text that a match still forming could cut later. A match spans at
most ``hold_chars(pattern)`` + 1 characters (lookaheads included), so only that many last
characters can be the start of one: they are held back, as the characters of a stop
string's prefix are, and each step searches only them and what the step added. A pattern
with an unbounded repeat (``\\d+``, ``.*``) is searched in the whole output each step (as
SGLang's scheduler does: its window for such a pattern is the whole output) and holds back
``MAX_HOLD_CHARS``; a match of one that spans more than that may begin in text already
shown, and the output is then cut where the shown text ends. Patterns are at most
``MAX_PATTERN_CHARS`` long and at most ``MAX_STOP_STRINGS`` per request.
"""

from __future__ import annotations

import re
from typing import Any

MAX_PATTERN_CHARS = 1024  # one pattern's length
MAX_HOLD_CHARS = 256  # held back for a pattern whose matches have no bounded length


def compile_pattern(pattern: Any) -> re.Pattern:
    """``pattern`` compiled; ValueError saying why it cannot be a stop pattern (not a
    string, too long, invalid, or matching the empty text: it would stop before any
    output)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{pattern!r} must be a non-empty string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"a pattern of {len(pattern)} characters exceeds {MAX_PATTERN_CHARS}")
    try:
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise ValueError(f"{pattern!r} is not a valid regular expression: {exc}") from None
    if compiled.search("") is not None:
        raise ValueError(f"{pattern!r} matches the empty text (it would stop at once)")
    return compiled


def stop_patterns(value: Any, max_patterns: int) -> tuple[str, ...]:
    """A request's ``stop_regex`` (None, a pattern, or a list of at most ``max_patterns``)
    as a tuple of valid patterns; ValueError saying what is wrong."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > max_patterns:
        raise ValueError(f"{value!r} must be a pattern or a list of at most {max_patterns}")
    for item in items:
        compile_pattern(item)
    return tuple(items)


def hold_chars(pattern: str) -> int | None:
    """Characters at the end of the text that may still begin a match of ``pattern``: the
    longest text a match and its lookaheads span, less one; None when that is unbounded
    (or past ``MAX_HOLD_CHARS``)."""
    try:
        from re import _constants, _parser

        parsed = _parser.parse(pattern)
        span = parsed.getwidth()[1] + _lookahead_width(parsed, _constants)
    except Exception:  # the parser is CPython's, not an API: take it as unbounded then
        return None
    return span - 1 if span <= MAX_HOLD_CHARS else None


def _lookahead_width(node: Any, constants: Any) -> int:
    """The longest text of every lookahead in ``node`` (getwidth counts them as 0)."""
    total = 0
    if isinstance(node, (list, tuple)) or hasattr(node, "data"):
        items = node.data if hasattr(node, "data") else node
        for item in items:
            if (
                isinstance(item, tuple)
                and len(item) == 2
                and item[0] in (constants.ASSERT, constants.ASSERT_NOT)
                and item[1][0] == 1  # direction: ahead
            ):
                total += item[1][1].getwidth()[1]
            total += _lookahead_width(item, constants)
    return total


class StopPatterns:
    """A request's stop patterns, with the text a stream must hold back for them."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        self.items = [(re.compile(p), p, hold_chars(p)) for p in patterns]
        self.hold = max((MAX_HOLD_CHARS if h is None else h for *_, h in self.items), default=0)

    def first(self, text: str, shown: int) -> tuple[int, int, str] | None:
        """The earliest match in ``text`` of which ``shown`` characters were shown before:
        (start, end, pattern), or None. A bounded pattern is searched from ``shown`` less
        its hold (an earlier match would have ended in text searched before); an unbounded
        one in the whole text (a match may have begun anywhere). The text before the start
        still counts for anchors and lookbehinds."""
        best = None
        for compiled, pattern, hold in self.items:
            found = compiled.search(text, 0 if hold is None else max(0, shown - hold))
            if found is not None and (best is None or found.start() < best[0]):
                best = (found.start(), found.end(), pattern)
        return best
