"""SGLang's ``stop_regex`` on the text side (no server): the output stops at the first match
(cut before it, or after it with ``no_stop_trim``), and a stream never shows text a match
still forming could cut; ``min_p`` and ``stop_regex`` parsed and range-checked."""

from __future__ import annotations

import re

import pytest

from lazyspec.scheduler.request import SamplingParams
from lazyspec.server.limits import ApiError, Limits
from lazyspec.server.protocol import parse_completion, parse_generate
from lazyspec.server.stop_regex import MAX_HOLD_CHARS, hold_chars
from lazyspec.server.text_stream import TextStream


class ByteTokenizer:
    """One token per UTF-8 byte (an incomplete character decodes to U+FFFD)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


OUTPUT = "the state 42 of <a draft> was 7 tokens, x yz end"
PATTERNS = [
    r"[0-9]{2}",  # bounded
    r"draft> w",
    r"x(?= yz)",  # a lookahead: the text after the match decides it
    r"<[^>]*>",  # unbounded
    r"(?<=of )<",  # a lookbehind reaching into text already searched
    r"tokens|state 4",  # alternatives
]


def _run(patterns, output: str, chunk: int, keep: bool = False, stop=()):
    stream = TextStream(ByteTokenizer(), stop, keep, stop_regex=tuple(patterns))
    ids = list(output if isinstance(output, bytes) else output.encode())
    shown = []
    for at in range(0, len(ids), chunk):
        final = at + chunk >= len(ids)
        shown.append(stream.push(ids[at : at + chunk], final=final))
        if stream.stopped:
            break
    return "".join(shown), shown, stream


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_stops_at_the_first_match_and_never_shows_it(pattern, chunk):
    found = re.search(pattern, OUTPUT)
    text, deltas, stream = _run([pattern], OUTPUT, chunk)
    assert stream.stopped == pattern
    assert text == OUTPUT[: found.start()], (text, deltas)
    kept, _, _ = _run([pattern], OUTPUT, chunk, keep=True)  # no_stop_trim
    assert kept == OUTPUT[: found.end()]


def test_an_incomplete_character_matches_nothing():
    text, deltas, stream = _run([r"[^a-z ]"], "a café", 1, keep=True)
    assert (text, stream.stopped) == ("a café", r"[^a-z ]") and "\ufffd" not in "".join(deltas)
    # invalid bytes stay U+FFFD: a run of them is held until a character follows it
    text, _, stream = _run(["fi\ufffd"], b"a fi\xff\xff\xffx", 1)
    assert (text, stream.stopped) == ("a ", "fi\ufffd")


def test_the_earliest_stop_string_or_match_wins():
    text, _, stream = _run([r"tokens", r"[0-9]{2}"], OUTPUT, 2, stop=("of <",))
    assert (text, stream.stopped) == ("the state ", r"[0-9]{2}")
    text, _, stream = _run([r"tokens"], OUTPUT, 2, stop=("of <",))
    assert (text, stream.stopped) == ("the state 42 ", "of <")


def test_no_match_shows_everything_and_the_hold_is_the_longest_match():
    text, deltas, stream = _run([r"[0-9]{3}", r"q(?=uu)"], OUTPUT, 1)
    assert text == OUTPUT and stream.stopped is None
    assert stream.hold == 2  # [0-9]{3} spans 3 characters; q(?=uu) 1 + 2
    assert deltas[-1] == OUTPUT[-3:]  # two held back, then the last one with the end
    assert (hold_chars(r"ab{2,4}"), hold_chars(r"a(?=bcd)"), hold_chars(r"\d+")) == (4, 3, None)


def test_a_long_unbounded_match_still_stops_the_output():
    """An unbounded pattern is searched in the whole output: a match longer than the
    hold ends it, cut where the shown text ends."""
    filler = "y" * (2 * MAX_HOLD_CHARS)
    output = f"one [{filler}] two"
    text, _, stream = _run([r"\[y*\]"], output, 1)
    assert stream.stopped == r"\[y*\]"
    assert output.startswith(text) and "]" not in text and "two" not in text
    assert len(text) >= len(output) - len(" two") - MAX_HOLD_CHARS - 1


LIMITS = Limits(vocab_size=256, max_context=256, model_names=("m",))


def test_parsers_carry_min_p_and_stop_regex():
    spec = parse_generate(
        {"input_ids": [5, 6], "sampling_params": {"min_p": 0.2, "stop_regex": r"\d\d"}},
        None,
        LIMITS,
    )
    assert spec.sampling[0].min_p == 0.2 and spec.stop_regex == (r"\d\d",)
    body = {"prompt": [5, 6], "min_p": 1, "stop_regex": ["a+b", "c"], "no_stop_trim": True}
    spec = parse_completion(body, None, LIMITS)
    assert spec.sampling[0].min_p == 1.0 and spec.stop_regex == ("a+b", "c")
    assert parse_completion({"prompt": [5]}, None, LIMITS).sampling[0].min_p == 0.0


@pytest.mark.parametrize(
    "body, words",
    [
        ({"min_p": 1.5}, "min_p=1.5 must be in [0, 1]"),
        ({"min_p": -0.1}, "min_p=-0.1 must be in [0, 1]"),
        ({"min_p": "x"}, "min_p='x' must be a finite number"),
        ({"stop_regex": "("}, "not a valid regular expression"),
        ({"stop_regex": ["a", "b*"]}, "matches the empty text"),
        ({"stop_regex": "a" * 1025}, "exceeds 1024"),
        ({"stop_regex": ["a"] * 17}, "at most 16"),
        ({"stop_regex": [3]}, "must be a non-empty string"),
        ({"stop_regex": {"a": 1}}, "must be a pattern or a list"),
    ],
)
def test_parsers_refuse_bad_min_p_and_stop_regex(body, words):
    with pytest.raises(ApiError) as err:
        parse_completion({"prompt": [5, 6], **body}, None, LIMITS)
    assert words in err.value.message and err.value.param == next(iter(body)), err.value.message


def test_sampling_params_take_min_p():
    assert SamplingParams.from_dict({"min_p": 0.05}).min_p == 0.05
    for bad in (-0.5, 1.01, True, float("nan")):
        with pytest.raises(ValueError, match="min_p"):
            SamplingParams.from_dict({"min_p": bad})
