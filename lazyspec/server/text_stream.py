"""``TextStream``: a growing list of token ids turned into text deltas that never split a
UTF-8 character and never show any part of a stop string."""

from __future__ import annotations

from typing import Any

from lazyspec.server.stop_regex import StopPatterns


class TextStream:
    """Incremental detokenization with stop strings and stop patterns (``stop_regex``).
    ``push`` returns the new text that is safe to show: no incomplete UTF-8 tail, no prefix
    of a stop string, no text a match still forming may begin in (``stop_regex.py``); at
    the first stop string or match the text is cut before it and ``stopped`` names it."""

    def __init__(
        self,
        tokenizer: Any,
        stop: tuple[str, ...] = (),
        keep_stop: bool = False,
        skip_special_tokens: bool = True,
        stop_regex: tuple[str, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.keep_stop, self.skip_special_tokens = keep_stop, skip_special_tokens
        self.patterns = StopPatterns(stop_regex)
        self.hold = max(max((len(s) for s in stop), default=1) - 1, self.patterns.hold)
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped: str | None = None

    def push(self, token_ids: list[int], final: bool = False) -> str:
        if self.stopped is not None or self.tokenizer is None:
            return ""
        self.token_ids.extend(token_ids)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        if not final:  # a character still incomplete (U+FFFD until its last byte comes)
            full = full.rstrip("\ufffd")  # is neither shown nor matched yet
        start = len(self.text)
        cut = self._first_stop(full, start)
        if cut is not None:
            end = cut
        elif final:
            end = len(full)
        else:
            end = len(full) - self.hold
            while end > start and full[end - 1] == "\ufffd":
                end -= 1
        delta = full[start:end] if end > start else ""
        self.text += delta
        return delta

    def _first_stop(self, full: str, shown: int) -> int | None:
        """Where the text ends at the earliest stop string or match (None: none yet)."""
        best = self.patterns.first(full, shown)  # (start, end, pattern)
        search_from = max(0, shown - self.hold)
        for s in self.stop:
            at = full.find(s, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, at + len(s), s)
        if best is None:
            return None
        self.stopped = best[2]
        end = best[1] if self.keep_stop else best[0]  # no_stop_trim keeps it
        return max(end, len(self.text))
