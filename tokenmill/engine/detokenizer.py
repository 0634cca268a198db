"""Generated token ids to streamed text, one step at a time, with stop strings.

Decoding each new token on its own gets text wrong twice over: byte-level BPE (and SentencePiece
byte fallback) splits one multi-byte character over several tokens, each of which decodes to
U+FFFD, and SentencePiece-style tokenizers drop a token's leading space when it starts the text.
So each step decodes a short window instead: the tokens already turned into text
(`ids[prefix_offset:read_offset]`) plus the new ones, and keeps what the window's text has beyond
the prefix's text. While the window's text ends in an unfinished character, the new tokens are held
until a later token completes it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded as context for the first output token, so it gets its leading space right.
_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 bytes. Tokens still unfinished after this many hold invalid
# bytes: they are released as they decode, which keeps every step's window this short.
_MAX_HELD_TOKENS = 8
_REPLACEMENT_CHAR = "\ufffd"


def decoder_of(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int], bool], str]:
    """`tokenizer.decode(ids, skip_special_tokens=skip)` as a function of (ids, skip). For a fast
    tokenizer whose decode is the Rust tokenizer's alone, that one is called directly: transformers'
    Python wrapper around it costs several times the decode itself, twice per generated token. Where
    the wrapper does more (a class of its own, spaces cleaned up as for WordPiece), it stays."""
    from transformers import PreTrainedTokenizerFast

    backend: Any = getattr(tokenizer, "_tokenizer", None)
    if getattr(type(tokenizer), "_decode", None) is not PreTrainedTokenizerFast._decode:
        backend = None  # not a fast tokenizer, or one with a decode of its own
    cleans_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
    if cleans_up and backend is not None and type(backend.model).__name__ == "BPE":
        # transformers skips the clean-up for BPE models unless told to corrupt their output
        cleans_up = bool(
            getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        )
    if backend is None or cleans_up or not hasattr(backend, "decode"):
        return lambda ids, skip: cast(str, tokenizer.decode(ids, skip_special_tokens=skip))
    return lambda ids, skip: cast(str, backend.decode(ids, skip_special_tokens=skip))


@lru_cache(maxsize=1024)
def _stop_failure(stop: str) -> tuple[int, ...]:
    """KMP failure table: entry n is the longest proper suffix of stop[:n] that is a prefix of stop.

    Built once per stop string (O(len(stop))) and shared by every sequence that uses it, so each
    step's stop check costs O(characters appended x stops), amortized, whatever the stops' lengths.
    """
    failure = [0] * (len(stop) + 1)
    k = 0
    for n in range(1, len(stop)):
        while k and stop[n] != stop[k]:
            k = failure[k]
        if stop[n] == stop[k]:
            k += 1
        failure[n + 1] = k
    return tuple(failure)


class IncrementalDetokenizer:
    """Detokenizes one generated sequence and watches it for stop strings.

    Each engine step: `stop = detok.update(new_token_ids)`, then `detok.get_next_delta(final)` for
    the text to stream, with `final=True` once the sequence has finished. `output_text` is
    `tokenizer.decode(output_ids, skip_special_tokens=...)` so far, cut before the first stop string
    (or after it with `include_stop_str_in_output`); `stop_str` is the stop string that matched, if
    any. The first output token is decoded after the last few prompt tokens, so with
    SentencePiece-style tokenizers it keeps its leading space and `prompt_text + output_text` reads
    right (`tokenizer.decode(output_ids)` alone would drop that space).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str],
        include_stop_str_in_output: bool,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError(f"Stop strings must be non-empty; remove '' from stop={stop!r}.")
        self._decode_ids = decoder_of(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop)
        self._failure = [_stop_failure(s) for s in self._stop]
        # Per stop string: length of the longest end of output_text that is a start of it (KMP state).
        self._matched = [0] * len(self._stop)
        self._include_stop = include_stop_str_in_output
        self.output_text = ""
        self.stop_str: str | None = None
        self.num_used = 0  # tokens of the last update() that made it into the text
        self._num_sent = 0  # characters of output_text already returned by get_next_delta
        # Context tokens, then output tokens. Text exists for ids[:read_offset]; the window starts
        # at prefix_offset, and prefix_text is the decoded ids[prefix_offset:read_offset].
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: the window would no longer start with its text
            # once an output token completes that character, so decode without context.
            self._ids, self._prefix_text = [], ""
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Appends generated tokens; returns the stop string they completed, else None.

        After a match `output_text` is final and the tokens after the matching one are ignored:
        `num_used` says how many of `new_token_ids` it took (all of them without a match).
        """
        if self.stop_str is not None:
            raise RuntimeError(f"update() called after stop string {self.stop_str!r} ended the sequence.")
        for i, token_id in enumerate(new_token_ids):
            self._ids.append(token_id)
            window_text = self._decode(self._ids[self._prefix_offset :])
            has_new_chars = len(window_text) > len(self._prefix_text)
            complete = has_new_chars and not window_text.endswith(_REPLACEMENT_CHAR)
            held_too_long = len(self._ids) - self._read_offset >= _MAX_HELD_TOKENS
            if (complete or held_too_long) and self._release(window_text) is not None:
                self.num_used = i + 1
                return self.stop_str
        self.num_used = len(new_token_ids)
        return None

    def get_next_delta(self, final: bool) -> str:
        """Returns the text not returned yet.

        While the sequence runs (`final=False`), an end of the text that could still grow into a
        stop string is held back, so a stop string never leaks into the stream. With `final=True`
        tokens still waiting for the rest of a character are decoded as they are (a stop string
        found in them still applies), and everything left is returned.
        """
        done = final or self.stop_str is not None
        if done and self.stop_str is None and self._read_offset < len(self._ids):
            self._release(self._decode(self._ids[self._prefix_offset :]))
        end = len(self.output_text) if done else len(self.output_text) - self._partial_stop_len()
        delta = self.output_text[self._num_sent : end]
        self._num_sent = max(self._num_sent, end)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids, self._skip_special_tokens)

    def _release(self, window_text: str) -> str | None:
        """Moves the window past the held tokens and appends their text; returns a matched stop."""
        new_text = window_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._append(new_text)

    def _append(self, new_text: str) -> str | None:
        """Appends text and looks for stop strings that end inside it; cuts at the earliest one."""
        old_len = len(self.output_text)
        self.output_text += new_text
        best: tuple[int, str] | None = None
        for i, stop in enumerate(self._stop):
            # Feed only the new characters to this stop's matcher: a new match ends in the new text.
            failure, k = self._failure[i], self._matched[i]
            for pos, char in enumerate(new_text, old_len):
                while k and char != stop[k]:
                    k = failure[k]
                if char == stop[k]:
                    k += 1
                    if k == len(stop):
                        # First match of this stop; the earliest start wins, ties by list order.
                        index = pos + 1 - k
                        if best is None or index < best[0]:
                            best = (index, stop)
                        break
            self._matched[i] = k
        if best is None:
            return None
        index, stop = best
        self.output_text = self.output_text[: index + len(stop) if self._include_stop else index]
        self.stop_str = stop
        return stop

    def _partial_stop_len(self) -> int:
        """Length of the longest end of output_text that is the start of some stop string."""
        # With no match yet, every matcher state is shorter than its stop string.
        return max(self._matched, default=0)
