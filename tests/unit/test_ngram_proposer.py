"""Prompt lookup (tokenmill.spec_decode.NgramProposer) on hand-built sequences, and against a plain
Python reference on random sequences over a small alphabet (where n-grams recur often)."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.spec_decode import NgramProposer


def reference_propose(tokens: list[int], k: int, min_n: int, max_n: int, max_draft: int) -> list[int]:
    """The rule, written the obvious way: longest n first, then the latest earlier occurrence."""
    num_draft = min(k, max_draft)
    if num_draft <= 0:
        return []
    last = len(tokens) - 1
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n :] if n <= len(tokens) else None
        if suffix is None:
            continue
        for end in range(last - 1, n - 2, -1):  # occurrences ending before the sequence's end, latest first
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + num_draft]
    return []


def test_a_repeated_phrase_proposes_its_continuation() -> None:
    proposer = NgramProposer(num_speculative_tokens=3, min_n=2, max_n=4)
    #         the phrase 5 6 7 is followed by 8 9 10; the sequence ends in 5 6 7 again
    tokens = [1, 5, 6, 7, 8, 9, 10, 2, 5, 6, 7]
    assert proposer.propose(tokens, max_draft=3) == [8, 9, 10]


def test_the_longest_n_wins_over_a_shorter_match_with_another_continuation() -> None:
    proposer = NgramProposer(num_speculative_tokens=2, min_n=2, max_n=4)
    # 4-gram 1 2 3 4 -> 50 51 (early); 2-gram 3 4 -> 60 61 (later, but shorter)
    tokens = [1, 2, 3, 4, 50, 51, 9, 3, 4, 60, 61, 8, 1, 2, 3, 4]
    assert proposer.propose(tokens, max_draft=2) == [50, 51]


def test_the_most_recent_occurrence_wins_among_equal_lengths() -> None:
    proposer = NgramProposer(num_speculative_tokens=2, min_n=2, max_n=2)
    tokens = [3, 4, 10, 11, 3, 4, 20, 21, 3, 4]
    assert proposer.propose(tokens, max_draft=2) == [20, 21]


def test_matches_shorter_than_min_n_propose_nothing() -> None:
    proposer = NgramProposer(num_speculative_tokens=3, min_n=3, max_n=5)
    # only the 2-gram 3 4 recurs; the 3-gram 9 3 4 never occurred before
    tokens = [1, 3, 4, 5, 6, 9, 3, 4]
    assert proposer.propose(tokens, max_draft=3) == []
    assert NgramProposer(num_speculative_tokens=3, min_n=2, max_n=5).propose(tokens, max_draft=3) == [5, 6, 9]


def test_a_match_longer_than_max_n_counts_as_max_n() -> None:
    # the 3-gram suffix occurred twice; with max_n=2 the later 2-gram 5 6 (not preceded by 4) ties
    # in length with it and is more recent
    proposer = NgramProposer(num_speculative_tokens=1, min_n=1, max_n=2)
    tokens = [4, 5, 6, 70, 5, 6, 80, 4, 5, 6]
    assert proposer.propose(tokens, max_draft=1) == [80]
    assert NgramProposer(num_speculative_tokens=1, min_n=1, max_n=3).propose(tokens, max_draft=1) == [70]


@pytest.mark.parametrize(("k", "max_draft", "expected"), [(4, 2, [7, 8]), (2, 4, [7, 8]), (4, 4, [7, 8, 9, 10])])
def test_max_draft_and_num_speculative_tokens_cap_the_draft(k: int, max_draft: int, expected: list[int]) -> None:
    proposer = NgramProposer(num_speculative_tokens=k, min_n=2, max_n=3)
    tokens = [1, 2, 7, 8, 9, 10, 11, 1, 2]
    assert proposer.propose(tokens, max_draft=max_draft) == expected


def test_max_draft_zero_proposes_nothing() -> None:
    assert NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3).propose([1, 2, 1, 2], max_draft=0) == []


def test_a_match_near_the_end_proposes_only_the_tokens_that_exist() -> None:
    proposer = NgramProposer(num_speculative_tokens=5, min_n=2, max_n=3)
    # the latest earlier 2-gram 9 9 ends one token before the end: only one token follows it
    assert proposer.propose([1, 9, 9, 9], max_draft=5) == [9]
    # the 2-gram 1 2 ends three tokens before the end: 3 1 2 follow it
    assert proposer.propose([1, 2, 3, 1, 2], max_draft=5) == [3, 1, 2]


def test_no_recurring_ngram_proposes_nothing() -> None:
    proposer = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=4)
    assert proposer.propose([1, 2, 3, 4, 5], max_draft=3) == []
    assert proposer.propose([7], max_draft=3) == []
    assert proposer.propose([], max_draft=3) == []


def test_numpy_input_and_list_input_give_the_same_draft() -> None:
    proposer = NgramProposer(num_speculative_tokens=3, min_n=2, max_n=4)
    tokens = [1, 5, 6, 7, 8, 9, 10, 2, 5, 6, 7]
    for dtype in (np.int32, np.int64):
        assert proposer.propose(np.array(tokens, dtype=dtype), max_draft=3) == [8, 9, 10]


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (1, 3), (2, 5), (3, 4)])
def test_matches_the_reference_on_random_sequences(min_n: int, max_n: int) -> None:
    rng = np.random.default_rng(1234 + 10 * min_n + max_n)
    proposer = NgramProposer(num_speculative_tokens=4, min_n=min_n, max_n=max_n)
    proposed_any = 0
    for _ in range(500):
        tokens = rng.integers(0, 4, size=int(rng.integers(0, 40))).tolist()
        max_draft = int(rng.integers(0, 6))
        expected = reference_propose(tokens, 4, min_n, max_n, max_draft)
        assert proposer.propose(tokens, max_draft) == expected, (tokens, max_draft)
        proposed_any += bool(expected)
    assert proposed_any > 50  # the comparison covered matches, not only empty drafts


def test_invalid_lookup_bounds_are_rejected() -> None:
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(num_speculative_tokens=2, min_n=3, max_n=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(num_speculative_tokens=0, min_n=1, max_n=2)
