"""Stop-string checks cost O(new text x stops) per step, not O(len(stop)^2) (issue 27).

The work is counted, not timed: lines executed in, and builtin calls made from, the detokenizer's
own frames while it streams one-character tokens against long stop strings. A fake tokenizer whose
tokens decode to fixed strings keeps the decode cost constant and the text exact.
"""

from __future__ import annotations

import random
import sys
from types import FrameType
from typing import Any, cast

import pytest
from transformers import PreTrainedTokenizerBase

from tokenmill.engine import detokenizer as detokenizer_module
from tokenmill.engine.detokenizer import IncrementalDetokenizer

_DETOK_FILE = detokenizer_module.__file__


class _PieceTokenizer:
    """Token id i decodes to pieces[i]; a sequence decodes to the pieces joined."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.pieces[i] for i in token_ids)


def _make(pieces: list[str], stop: list[str], include_stop: bool = False) -> IncrementalDetokenizer:
    tokenizer = cast(PreTrainedTokenizerBase, _PieceTokenizer(pieces))
    return IncrementalDetokenizer(tokenizer, [], True, stop, include_stop)


class _TooMuchWork(Exception):
    pass


class _WorkCounter:
    """Counts lines run in detokenizer.py frames and builtin calls made from them, up to a limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    def _tick(self) -> None:
        self.count += 1
        if self.count > self.limit:
            raise _TooMuchWork

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != _DETOK_FILE:
            return None
        if event == "line":
            self._tick()
        return self._trace

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and frame.f_code.co_filename == _DETOK_FILE:
            self._tick()

    def __enter__(self) -> _WorkCounter:
        self._old = sys.gettrace(), sys.getprofile()
        sys.settrace(self._trace)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self._old[0])
        sys.setprofile(self._old[1])


NUM_TOKENS = 1_000
NUM_STOPS = 16
STOP_LEN = 1_024
# Per token and stop a linear check runs a handful of lines; the quadratic one ran ~len(stop) calls.
WORK_LIMIT = NUM_TOKENS * NUM_STOPS * 30


@pytest.mark.parametrize("kind", ["unrelated", "repetitive"])
def test_stop_check_work_is_linear_in_new_text(kind: str) -> None:
    rng = random.Random(27)
    if kind == "unrelated":
        # The text never starts a stop: the old check tried every prefix length of every stop.
        alphabet = "abcdefghijklmnop"
        stops = ["".join(rng.choice(alphabet) for _ in range(STOP_LEN)) for _ in range(NUM_STOPS)]
        pieces = list("qrstuvwxyz ")
    else:
        # The text keeps matching long stop prefixes that never complete.
        stops = ["a" * (STOP_LEN - 1) + chr(ord("A") + i) for i in range(NUM_STOPS)]
        pieces = ["a", "b"]
    ids = [rng.randrange(len(pieces)) for _ in range(NUM_TOKENS)]
    if kind == "repetitive":
        ids = [0] * (NUM_TOKENS - 10) + [1] + [0] * 9
    detok = _make(pieces, stops)
    detok.get_next_delta(final=False)  # any one-off setup is outside the count
    streamed = ""
    with _WorkCounter(WORK_LIMIT) as counter:
        try:
            for token_id in ids:
                assert detok.update([token_id]) is None
                streamed += detok.get_next_delta(final=False)
        except _TooMuchWork:
            pytest.fail(f"stop checks took over {WORK_LIMIT} operations for {NUM_TOKENS} tokens x {NUM_STOPS} stops")
    streamed += detok.get_next_delta(final=True)
    assert streamed == detok.output_text == "".join(pieces[i] for i in ids)
    assert counter.count <= WORK_LIMIT


def _reference(
    pieces: list[str], groups: list[list[int]], stop: list[str], include_stop: bool
) -> tuple[str, str | None, list[str]]:
    """Brute force: after each token, the earliest stop ending in its text; streamed text holds
    back the longest end that starts some stop. Returns (output_text, stop_str, deltas)."""
    text, sent, deltas = "", 0, []
    for group in groups:
        for token_id in group:
            old_len = len(text)
            text += pieces[token_id]
            found = [(i, s) for s in stop if (i := text.find(s, max(0, old_len - len(s) + 1))) != -1]
            if found:
                index, s = min(found, key=lambda m: m[0])
                text = text[: index + len(s) if include_stop else index]
                deltas.append(text[sent:])
                return text, s, deltas
        hold = max((n for s in stop for n in range(len(s)) if text.endswith(s[:n])), default=0)
        deltas.append(text[sent : len(text) - hold])
        sent = max(sent, len(text) - hold)
    deltas.append(text[sent:])
    return text, None, deltas


def _run(
    pieces: list[str], groups: list[list[int]], stop: list[str], include_stop: bool
) -> tuple[str, str | None, list[str]]:
    detok = _make(pieces, stop, include_stop)
    deltas = []
    for group in groups:
        if detok.update(group) is not None:
            deltas.append(detok.get_next_delta(final=True))
            return detok.output_text, detok.stop_str, deltas
        deltas.append(detok.get_next_delta(final=False))
    deltas.append(detok.get_next_delta(final=True))
    return detok.output_text, detok.stop_str, deltas


def test_stop_spanning_tokens_is_found_and_nothing_after_it_is_emitted() -> None:
    pieces = ["hel", "lo ST", "O", "P! after", " more"]
    text, stop_str, deltas = _run(pieces, [[0], [1], [2], [3], [4]], ["STOP!"], False)
    assert (text, stop_str) == ("hello ", "STOP!")
    assert deltas == ["hel", "lo ", "", ""]  # "ST", then "STO", held back; nothing after the stop
    text, _, deltas = _run(pieces, [[0], [1], [2], [3], [4]], ["STOP!"], True)
    assert "".join(deltas) == text == "hello STOP!"


def test_stop_that_is_a_prefix_of_another() -> None:
    # Token by token, "ab" completes first, whatever the list order.
    assert _run(list("xabcd"), [[0], [1], [2], [3], [4]], ["abc", "ab"], False)[:2] == ("x", "ab")
    # Both complete in one token at the same start: list order breaks the tie, as before.
    pieces = ["x", "abcd", "zbcd"]
    assert _run(pieces, [[0], [1]], ["abc", "ab"], True)[:2] == ("xabc", "abc")
    assert _run(pieces, [[0], [1]], ["ab", "abc"], True)[:2] == ("xab", "ab")
    # A longer stop starting earlier beats a shorter one ending earlier in the same token.
    assert _run(pieces, [[0], [2]], ["bc", "xzbcd"], False)[:2] == ("", "xzbcd")
    # Nothing of the tokens after the stop is emitted.
    text, _, deltas = _run(pieces, [[0], [1], [2]], ["bc"], False)
    assert "".join(deltas) == text == "xa"


def test_random_streams_match_brute_force() -> None:
    rng = random.Random(0)
    pieces = ["a", "b", "ab", "ba", "aab", "c", "abab", "bb"]
    for _ in range(600):
        stop = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        ids = [rng.randrange(len(pieces)) for _ in range(rng.randint(1, 25))]
        groups: list[list[int]] = []
        while ids:
            k = rng.randint(1, 3)
            groups.append(ids[:k])
            ids = ids[k:]
        include_stop = rng.random() < 0.5
        expected = _reference(pieces, groups, stop, include_stop)
        assert _run(pieces, groups, stop, include_stop) == expected, (stop, pieces, groups)
