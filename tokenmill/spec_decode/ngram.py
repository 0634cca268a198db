"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's
longest matching suffix n-gram."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


class NgramProposer:
    """Proposes draft tokens by n-gram lookup over a request's own tokens (prompt + output so far).

    For n from `max_n` down to `min_n`: find an earlier occurrence of the sequence's last n tokens (one
    that ends before the sequence does) and propose the tokens that followed it. The longest n wins;
    among its occurrences, the most recent one. Stateless: one proposer serves every request.

    Usage: `NgramProposer(num_speculative_tokens=4, min_n=2, max_n=5).propose(token_ids, max_draft=4)`.
    Pass `token_ids` as an integer numpy array where you have one: a Python list is copied first, and
    that copy costs more than the lookup itself on long sequences.
    """

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}.")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} and max_n={max_n}.")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int] | npt.NDArray[np.integer], max_draft: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_draft) draft tokens for the sequence `token_ids`
        (fewer when the matched occurrence is followed by fewer tokens); [] when no n-gram of at least
        `min_n` tokens recurs."""
        num_draft = min(self.num_speculative_tokens, max_draft)
        if num_draft <= 0 or len(token_ids) < self.min_n + 1:
            return []
        tokens = _as_array(token_ids)  # [seq_len]
        end = _latest_longest_match_end(tokens, self.min_n, self.max_n)
        if end < 0:
            return []
        draft: list[int] = tokens[end + 1 : end + 1 + num_draft].tolist()
        return draft


def _as_array(token_ids: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.integer]:
    if isinstance(token_ids, np.ndarray):
        return token_ids
    # fromiter with a known count is the cheapest list -> array copy numpy offers.
    return np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))


def _latest_longest_match_end(tokens: npt.NDArray[np.integer], min_n: int, max_n: int) -> int:
    """The end index of the most recent earlier occurrence of the longest suffix n-gram, n in
    [min_n, max_n]; -1 when none exists.

    One pass over the sequence serves every n: the candidates are the positions before the last one
    that hold the last token (matches of length 1); each further step keeps those whose match extends
    one token to the left. The candidate sets only shrink, so after the first compare the work is
    proportional to the number of matches, not to the sequence length."""
    last = len(tokens) - 1
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # [num_candidates], ascending
    best = -1
    length = 1
    while ends.size:
        if length >= min_n:
            best = int(ends[-1])  # ascending order: the last candidate is the most recent
        if length == max_n:
            break
        ends = ends[ends >= length]  # the occurrence must start at index >= 0
        ends = ends[tokens[ends - length] == tokens[last - length]]
        length += 1
    return best
