"""cache_salt: a per-request string mixed into the hash of a request's first block, so that requests
with different salts never share prefix-cache blocks and those with the same salt do. Block size 4."""

from __future__ import annotations

import pytest

from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.messages import COMMANDS, AddRequests, NewRequest, build_requests
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduling.kv_cache_manager import KVCacheManager
from tokenmill.scheduling.request import Request
from tokenmill.scheduling.scheduler import AdmissionLimits

BS = 4
PROMPT_10 = list(range(100, 110))  # two full blocks and a partial one of 2 tokens


def make_request(req_id: str, prompt: list[int], cache_salt: str | None = None) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=8), cache_salt=cache_salt)


def allocate_prompt(kv: KVCacheManager, request: Request) -> int:
    """As the scheduler admits a waiting request; returns the prompt tokens found in the cache."""
    hits, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, hits) is not None
    request.num_computed_tokens = num_cached
    return num_cached


def cached_after(first: Request, second: Request, free_first: bool = True) -> int:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    assert allocate_prompt(kv, first) == 0
    if free_first:
        kv.free(first)
    hit = allocate_prompt(kv, second)
    kv.pool.check_integrity()
    return hit


# ---------------------------------------------------------------------------------------- the cache
@pytest.mark.parametrize("free_first", [True, False])
def test_different_salts_share_no_blocks(free_first: bool) -> None:
    a, b = make_request("a", PROMPT_10, "tenant-a"), make_request("b", PROMPT_10, "tenant-b")
    assert cached_after(a, b, free_first) == 0


@pytest.mark.parametrize("free_first", [True, False])
def test_the_same_salt_shares_blocks(free_first: bool) -> None:
    a, b = make_request("a", PROMPT_10, "tenant-a"), make_request("b", PROMPT_10, "tenant-a")
    assert cached_after(a, b, free_first) == 2 * BS


def test_no_salt_behaves_as_before() -> None:
    assert cached_after(make_request("a", PROMPT_10), make_request("b", PROMPT_10)) == 2 * BS


@pytest.mark.parametrize(("first", "second"), [("s", None), (None, "s")])
def test_a_salted_and_an_unsalted_request_share_no_blocks(first: str | None, second: str | None) -> None:
    assert cached_after(make_request("a", PROMPT_10, first), make_request("b", PROMPT_10, second)) == 0


def test_only_the_first_block_is_salted_later_ones_chain_from_it() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    salted, plain = make_request("a", PROMPT_10, "s"), make_request("b", PROMPT_10)
    h_salted, h_plain = kv.block_hashes(salted), kv.block_hashes(plain)
    assert len(h_salted) == len(h_plain) == 2
    assert h_salted[0] != h_plain[0] and h_salted[1] != h_plain[1]  # the second differs through its parent
    # A salt is not the same as the tokens it is spelt with, nor a salt that is its prefix.
    assert kv.block_hashes(make_request("c", PROMPT_10, "ss"))[0] != h_salted[0]


def test_a_shared_prefix_with_the_same_salt_hits_up_to_where_the_prompts_differ() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    allocate_prompt(kv, make_request("a", PROMPT_10, "s"))
    other = make_request("b", PROMPT_10[:4] + [1, 2, 3, 4, 5, 6], "s")
    assert allocate_prompt(kv, other) == BS


# ---------------------------------------------------------------------------------------- validation
def processor() -> InputProcessor:
    return InputProcessor(None, 512, [2], AdmissionLimits(max_model_len=64, block_size=BS, num_blocks=64))


def test_an_empty_salt_is_an_error_none_is_no_salt() -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        processor().process("r", [1, 2, 3], SamplingParams(max_tokens=4), cache_salt="")
    assert processor().process("r", [1, 2, 3], SamplingParams(max_tokens=4)).children[0].cache_salt is None


def test_every_sample_of_n_carries_the_salt_and_a_dict_prompt_may_give_it() -> None:
    prepared = processor().process("r", [1, 2, 3], SamplingParams(max_tokens=4, n=3), cache_salt="s")
    assert [c.cache_salt for c in prepared.children] == ["s", "s", "s"]
    from_dict = processor().process("r", {"prompt_token_ids": [1, 2], "cache_salt": "d"}, SamplingParams(max_tokens=4))
    assert from_dict.children[0].cache_salt == "d"
    with pytest.raises(ValueError, match="cache_salt"):
        processor().process("r", {"prompt_token_ids": [1, 2], "cache_salt": ""}, SamplingParams(max_tokens=4))


# ---------------------------------------------------------------------------------------- the wire
@pytest.mark.parametrize("salt", ["tenant-ä", None])
def test_the_salt_crosses_the_engine_pipe(salt: str | None) -> None:
    leader = make_request("r#0", [1, 2, 3], salt)
    follower = Request("r#1", [1, 2, 3], SamplingParams(max_tokens=8), prefill_leader=leader, cache_salt=salt)
    sent = AddRequests(7, [NewRequest.of(leader), NewRequest.of(follower)])
    decoded = COMMANDS.decode(COMMANDS.encode(sent))
    assert isinstance(decoded, AddRequests)
    built = build_requests(decoded.requests)
    assert [r.cache_salt for r in built] == [salt, salt]
    assert built[1].prefill_leader is built[0]
