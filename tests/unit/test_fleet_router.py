"""The fleet's routing policy as plain Python: prefix keys, cache_salt isolation, token load accounting,
and the choice between prefix affinity and least load."""

from __future__ import annotations

import json

import pytest

from tokenmill.fleet.metrics import merge_replica_metrics
from tokenmill.fleet.routing import (
    BLOCK_CHARS,
    DEFAULT_MAX_TOKENS,
    PrefixAffinityPolicy,
    RoutingHints,
    hints_from_body,
    prefix_keys,
)

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 4  # 4 full blocks and more


def hints(prompt: str, load: int = 100, salt: str | None = None) -> RoutingHints:
    return RoutingHints(prefix_keys(prompt, salt), load)


def test_keys_cover_full_blocks_only() -> None:
    assert prefix_keys("x" * (BLOCK_CHARS - 1)) == ()
    assert len(prefix_keys("x" * (3 * BLOCK_CHARS + 5))) == 3


def test_prompts_share_exactly_the_keys_of_their_common_full_blocks() -> None:
    a = prefix_keys(SYSTEM[: 2 * BLOCK_CHARS] + "A" * BLOCK_CHARS)
    b = prefix_keys(SYSTEM[: 2 * BLOCK_CHARS] + "B" * BLOCK_CHARS)
    assert a[:2] == b[:2] and a[2] != b[2]


def test_cache_salt_separates_every_key() -> None:
    plain, salted, other = prefix_keys(SYSTEM), prefix_keys(SYSTEM, "tenant-a"), prefix_keys(SYSTEM, "tenant-b")
    assert not set(plain) & set(salted) and not set(salted) & set(other)
    assert prefix_keys(SYSTEM, "tenant-a") == salted


def test_hints_of_a_completion_count_prompt_and_max_tokens_times_n() -> None:
    body = json.dumps({"prompt": "x" * 400, "max_tokens": 50, "n": 2}).encode()
    h = hints_from_body("/v1/completions", body)
    assert h is not None and h.load_tokens == 2 * (400 // 4 + 50)
    assert h.prefix_keys == prefix_keys("x" * 400)


def test_hints_of_a_chat_without_max_tokens_use_the_default() -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    h = hints_from_body("/v1/chat/completions", json.dumps({"messages": messages}).encode())
    assert h is not None and h.load_tokens > DEFAULT_MAX_TOKENS and len(h.prefix_keys) >= 4


def test_chats_with_one_system_prompt_share_a_prefix_and_their_salt_keeps_them_apart() -> None:
    def chat(user: str, salt: str | None = None) -> RoutingHints:
        body: dict[str, object] = {
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        }
        if salt:
            body["cache_salt"] = salt
        result = hints_from_body("/v1/chat/completions", json.dumps(body).encode())
        assert result is not None
        return result

    assert chat("a").prefix_keys[:3] == chat("b").prefix_keys[:3]
    assert not set(chat("a", "t1").prefix_keys) & set(chat("a", "t2").prefix_keys)


def test_per_key_salt_joins_the_request_salt() -> None:
    body = json.dumps({"prompt": SYSTEM}).encode()
    one, two = (
        hints_from_body("/v1/completions", body, "Bearer k1"),
        hints_from_body("/v1/completions", body, "Bearer k2"),
    )
    assert one is not None and two is not None and not set(one.prefix_keys) & set(two.prefix_keys)


@pytest.mark.parametrize(
    "path, body",
    [("/v1/models", b""), ("/v1/completions", b"not json"), ("/v1/completions", b'{"prompt": 5}')],
)
def test_other_routes_and_unparsable_bodies_get_no_hints(path: str, body: bytes) -> None:
    assert hints_from_body(path, body) is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_json_nested_beyond_the_parsers_depth_gets_no_hints(path: str) -> None:
    # json.loads raises RecursionError (not ValueError) here; the replica then answers the request itself.
    assert hints_from_body(path, b"[" * 100_000) is None
    assert hints_from_body(path, b'{"prompt": ' + b"[" * 100_000 + b', "messages": 1}') is None


def test_a_prompt_with_a_lone_surrogate_still_gets_its_keys() -> None:
    body = b'{"prompt": "' + b"\\ud800" * BLOCK_CHARS + b'"}'  # the JSON escape, not the character
    h = hints_from_body("/v1/completions", body)
    assert h is not None and len(h.prefix_keys) == 1


def test_token_id_prompts_count_one_token_per_id() -> None:
    h = hints_from_body("/v1/completions", json.dumps({"prompt": list(range(40)), "max_tokens": 10}).encode())
    assert h is not None and h.load_tokens == 50


def test_a_new_prefix_goes_to_the_least_loaded_replica() -> None:
    policy = PrefixAffinityPolicy(slack_tokens=100)
    policy.on_routed("r1", "A", hints("other" * 50, load=500))
    decision = policy.choose(["A", "B"], hints(SYSTEM))
    assert (decision.replica, decision.affinity) == ("B", False)


def test_a_known_prefix_goes_to_its_replica_within_the_slack() -> None:
    policy = PrefixAffinityPolicy(slack_tokens=1000)
    policy.on_routed("r1", "A", hints(SYSTEM + "first", load=500))
    decision = policy.choose(["A", "B"], hints(SYSTEM + "second"))
    assert (decision.replica, decision.affinity, decision.matched_blocks) == ("A", True, len(prefix_keys(SYSTEM)))


def test_beyond_the_slack_the_least_loaded_wins_and_then_holds_the_prefix_too() -> None:
    policy = PrefixAffinityPolicy(slack_tokens=100)
    policy.on_routed("r1", "A", hints(SYSTEM, load=500))
    assert policy.choose(["A", "B"], hints(SYSTEM)).replica == "B"
    policy.on_routed("r2", "B", hints(SYSTEM, load=450))
    decision = policy.choose(["A", "B"], hints(SYSTEM))
    assert decision.affinity and decision.replica == "B"  # both hold it; B is less loaded


def test_finished_requests_give_their_load_back() -> None:
    policy = PrefixAffinityPolicy(slack_tokens=0)
    policy.on_routed("r1", "A", hints("x", load=300))
    assert policy.load("A", {}) == 300
    policy.on_completed("r1")
    assert policy.load("A", {}) == 0
    policy.on_completed("r1")  # a second completion of the same request changes nothing
    assert policy.load("A", {}) == 0


def test_reported_load_counts_when_it_exceeds_the_routers_own() -> None:
    policy = PrefixAffinityPolicy(slack_tokens=100)
    policy.on_routed("r1", "A", hints(SYSTEM, load=10))
    decision = policy.choose(["A", "B"], hints(SYSTEM), reported={"A": 5000})
    assert (decision.replica, decision.affinity) == ("B", False)


def test_load_is_tokens_not_request_counts() -> None:
    policy = PrefixAffinityPolicy(slack_tokens=0)
    policy.on_routed("big", "A", hints("a", load=4000))
    for i in range(5):
        policy.on_routed(f"small{i}", "B", hints("b", load=100))
    assert policy.choose(["A", "B"], None).replica == "B"


def test_ties_go_to_the_first_replica_listed() -> None:
    assert PrefixAffinityPolicy().choose(["B", "A"], None).replica == "B"


def test_a_forgotten_replica_no_longer_attracts_its_prefixes() -> None:
    policy = PrefixAffinityPolicy(slack_tokens=1000)
    policy.on_routed("r1", "A", hints(SYSTEM))
    policy.forget_replica("A")
    assert not policy.choose(["A", "B"], hints(SYSTEM)).affinity


def test_prefixes_of_replicas_not_offered_are_ignored() -> None:
    policy = PrefixAffinityPolicy(slack_tokens=1000)
    policy.on_routed("r1", "A", hints(SYSTEM))
    assert policy.choose(["B"], hints(SYSTEM)).replica == "B"


def test_choose_needs_a_replica() -> None:
    with pytest.raises(ValueError, match="no replicas"):
        PrefixAffinityPolicy().choose([], None)


def test_merged_metrics_label_every_sample_with_its_replica_and_drop_the_local_fleet_gauge() -> None:
    text = (
        "# HELP tokenmill:prompt_tokens_total Prompt tokens.\n# TYPE tokenmill:prompt_tokens_total counter\n"
        'tokenmill:prompt_tokens_total{model_name="m"} 5.0\n'
        "# HELP tokenmill:fleet_replicas Replicas.\n# TYPE tokenmill:fleet_replicas gauge\n"
        'tokenmill:fleet_replicas{model_name="m",state="current"} 1.0\n'
    )
    merged = merge_replica_metrics({"r1": text, "r2": text.replace("5.0", "7.0")})
    assert merged.count("# HELP tokenmill:prompt_tokens_total") == 1
    assert 'tokenmill:prompt_tokens_total{replica="r1",model_name="m"} 5.0' in merged
    assert 'tokenmill:prompt_tokens_total{replica="r2",model_name="m"} 7.0' in merged
    assert "fleet_replicas" not in merged


def test_the_model_joins_the_prefix_key() -> None:
    def keys(model: str) -> list[str]:
        hints = hints_from_body("/v1/completions", json.dumps({"model": model, "prompt": SYSTEM}).encode())
        assert hints is not None
        return hints.prefix_keys

    assert keys("smol@1") == keys("smol@1")
    assert not set(keys("smol@1")) & set(keys("smol@2"))  # two models, two KV caches on each replica
