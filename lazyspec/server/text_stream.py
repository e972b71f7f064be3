"""``TextStream``: a growing list of token ids turned into text deltas that never split a
UTF-8 character and never show any part of a stop string."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Incremental detokenization with stop strings. ``push`` returns the new text that is
    safe to show: no incomplete UTF-8 tail, no prefix of a stop string; at the first stop
    string the text is cut before it and ``stopped`` names it."""

    def __init__(
        self,
        tokenizer: Any,
        stop: tuple[str, ...] = (),
        keep_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.keep_stop, self.skip_special_tokens = keep_stop, skip_special_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped: str | None = None

    def push(self, token_ids: list[int], final: bool = False) -> str:
        if self.stopped is not None or self.tokenizer is None:
            return ""
        self.token_ids.extend(token_ids)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        start = len(self.text)
        cut = self._first_stop(full, max(0, start - self.hold))
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

    def _first_stop(self, full: str, search_from: int) -> int | None:
        best = None
        for s in self.stop:
            at = full.find(s, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        self.stopped = best[1]
        end = best[0] + len(best[1]) if self.keep_stop else best[0]  # no_stop_trim keeps it
        return max(end, len(self.text))
